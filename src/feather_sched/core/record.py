"""``Record``: the requests the engine holds, as Feather knows them beyond the queue.

Each tracked request keeps its engine object, its prompt length (a longer prompt re-keys
it), its arrival and tenant as the queue was given them, and its preemption counts, which
outlive the queue's picture of it: ``unsettled`` keeps the requests a fault dropped
(``FeatherRuntime.drop``) until the rebuild (``Recovery.resync``) or their exit, so each
is counted in once and out once and keeps its arrival.  Tracking a request adds it to the
queue as waiting; moving it between states is the runtime's.  O(1) a call unless noted.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic

from feather_sched.core.prefix import describe_batch
from feather_sched.core.queue import FeatherQueue, QueueState
from feather_sched.core.tenants import DEFAULT_TENANT, service_of
from feather_sched.core.view import R, RequestId, RequestView
from feather_sched.telemetry.stats import StepMeter
from feather_sched.telemetry.steplog import BatchEntry


@dataclass
class Tracked(Generic[R]):
    request: R
    prompt_tokens: int
    arrival_s: float
    """As the queue was given it (kept when the queue is rebuilt, ``resync``)."""
    preemptions: int = 0
    urgent_preemptions: int = 0
    """Times it was one of ``urgent_victims``."""
    tenant: Hashable = DEFAULT_TENANT
    """As the queue was given it: ``served`` charges it without asking the queue."""


class Record(Generic[R]):
    """The engine's requests Feather tracks (``tracked``) and those a fault left
    ``unsettled``; each is counted in (``requests_entered``) and out (``requests_left``,
    the sink's ``request_left``) exactly once."""

    def __init__(self, view: RequestView[R], queue: FeatherQueue,
                 clock: Callable[[], float], meter: StepMeter) -> None:
        self.view, self.queue, self.clock, self.meter = view, queue, clock, meter
        self.tracked: dict[RequestId, Tracked[R]] = {}
        self.unsettled: dict[RequestId, Tracked[R]] = {}
        """Requests tracked when a fault emptied the picture (``unsettle``), until the
        rebuild or their ``forget``: so each is still counted out once, and keeps its
        arrival and preemption counts."""
        self.tenant: Callable[[R], Hashable] | None = getattr(view, "tenant", None)
        """The view's ``tenant``, where it has one: fair share's, and the per-tenant
        series' whether fair share is on or off."""

    def refresh(self, request: R) -> RequestId:
        """Track ``request`` (new, or re-keyed when its prompt grew); returns its id."""
        view = self.view
        request_id = view.request_id(request)
        tracked = self.tracked.get(request_id)
        prompt_tokens = view.prompt_tokens(request)
        if tracked is not None and tracked.prompt_tokens == prompt_tokens:
            tracked.request = request
            return request_id
        arrival = view.arrival_s(request)
        if tracked is not None:
            self.queue.remove(request_id)
        elif (tracked := self.unsettled.pop(request_id, None)) is not None and \
                tracked.prompt_tokens == prompt_tokens:  # known before a fault (``drop``)
            arrival = tracked.arrival_s
        return self.track(request, arrival, tracked)

    def track(self, request: R, arrival_s: float | None,
              before: Tracked[R] | None = None) -> RequestId:
        """Track ``request`` and add it to the queue as waiting (arrival None: now); a
        request tracked ``before`` (re-keyed, or rebuilt after a fault) keeps its counts
        of preemptions, so ``max_urgent_preemptions`` bounds its whole life; one that was
        not is counted in (once: tracked, it is counted out once, ``count_left``)."""
        view = self.view
        request_id = view.request_id(request)
        arrival = self.clock() if arrival_s is None else arrival_s
        prompt_tokens = view.prompt_tokens(request)
        tenant = self.tenant_of(request)
        tracked = self.tracked[request_id] = Tracked(request, prompt_tokens, arrival,
                                                     tenant=tenant)
        if before is None:
            self.meter.stats.requests_entered += 1
        else:
            tracked.preemptions = before.preemptions
            tracked.urgent_preemptions = before.urgent_preemptions
        self.queue.add(request_id, view.chunk_keys(request), arrival, prompt_tokens,
                       view.priority(request), tenant)
        return request_id

    def tenant_of(self, request: R) -> Hashable:
        """The request's tenant as the view names it (``DEFAULT_TENANT`` where it names
        none)."""
        return DEFAULT_TENANT if self.tenant is None else self.tenant(request)

    def forget(self, request_id: RequestId) -> bool:
        """The request left the engine: untracked (or unsettled) and counted out; False
        if it was neither."""
        tracked = self.tracked.pop(request_id, None) or self.unsettled.pop(request_id, None)
        if tracked is None:
            return False
        self.count_left([tracked])
        return True

    def stale(self, request: R) -> bool:
        """Whether the engine's waiting ``request`` must be entered (``enter_waiting``):
        new to Feather, re-keyed (its prompt grew), or not waiting in the queue."""
        request_id = self.view.request_id(request)
        known = self.tracked.get(request_id)
        return known is None or known.prompt_tokens != self.view.prompt_tokens(request) or \
            self.queue.state(request_id) is not QueueState.WAITING

    def unseen(self, running: set[RequestId], waiting: set[RequestId]) -> list[RequestId]:
        """The tracked requests in neither the engine's ``running`` nor its ``waiting``:
        they left it by a path Feather did not see.  O(tracked) where there may be one."""
        if len(self.tracked) <= len(running) + len(waiting):
            return []
        return [r for r in self.tracked if r not in running and r not in waiting]

    def unsettle(self) -> None:
        """A fault emptied the queue: every tracked request waits, unsettled, for the
        rebuild or its exit.  O(tracked)."""
        self.unsettled.update(self.tracked)
        self.tracked = {}

    def count_left(self, gone: Sequence[Tracked[R]]) -> None:
        """Count requests out (they left the engine): the stats, then the sink."""
        self.meter.stats.requests_left += len(gone)
        if self.meter.sink is not None:
            for tracked in gone:
                self.meter.sink.request_left(tracked.preemptions)

    def served(self, request_id: RequestId, computed_tokens: int,
               generated_tokens: int) -> None:
        """A step computed ``computed_tokens`` prompt tokens for the request and generated
        ``generated_tokens``: its tenant's service, under fair share (``TenantShare.
        charge``) and on its metrics series.  Nothing for a request not tracked (as
        after a fault until the rebuild).  O(1)."""
        tracked = self.tracked.get(request_id)
        if tracked is None:
            return
        share = self.queue.share
        if share is not None:
            share.charge(tracked.tenant, computed_tokens, generated_tokens)
        if self.meter.sink is not None:
            self.meter.sink.served(tracked.tenant,
                                   service_of(computed_tokens, generated_tokens))

    def describe_batch(self, rows: Iterable[tuple[R, int, int]]) -> list[BatchEntry]:
        """A step's batch: ``rows`` of (request, context tokens, new tokens) described in
        Feather's chunks (``prefix.describe_batch``), the same in every engine; a request
        not tracked is keyed by the view.  O(keys of the batch)."""
        queue, view, tracked = self.queue, self.view, self.tracked
        described = []
        for request, context, new in rows:
            request_id = view.request_id(request)
            keys = queue.keys(request_id) if request_id in tracked else \
                view.chunk_keys(request)
            described.append((request_id, keys, context, new))
        return describe_batch(described, queue.chunk_tokens)

    def preempted(self, request_id: RequestId) -> int:
        """The engine preempted the tracked request: its preemptions, counted."""
        tracked = self.tracked[request_id]
        tracked.preemptions += 1
        return tracked.preemptions

    def may_give_way(self, request: R, priority: int, limit: int) -> bool:
        """Whether running ``request`` may be an urgent victim for a request of class
        ``priority``: it is of a less urgent class and was one fewer than ``limit``
        times (one Feather does not track: by its class alone)."""
        known = self.tracked.get(self.view.request_id(request))
        return self.view.priority(request) > priority and (
            known is None or known.urgent_preemptions < limit)

    def urgent_victims(self, victims: Sequence[R]) -> None:
        """Each of ``victims`` was named an urgent victim once more."""
        for victim in victims:
            known = self.tracked.get(self.view.request_id(victim))
            if known is not None:
                known.urgent_preemptions += 1
