"""FeatherRuntime: the one admission contract that vLLM, SGLang and the simulator drive.

It holds all of Feather's state for one scheduler (options, the ``FeatherQueue``,
admission counts, the ``StepMeter`` with stats, step log and saved gate state) behind one
contract: ``core.contract.RuntimeContract`` declares every member an adapter may use,
each with its contract (docs/architecture.md's table is generated from it); adapters
never reach the queue or the view.

Invariants: the running set is never assumed from admissions: ``begin_pass`` and
``end_pass`` each take what the engine reports as running, so a request it skipped, parked
or ran by a path Feather does not see is placed where the engine has it.  An ADD counts
(and is rewarded) only when its request runs at the end of the pass; a STOP counts and is
rewarded with the step it shaped.  An exception in any call is contained by the adapter
calling through ``faults`` (``FaultGuard.call``/``attempt``; ``faults.serves`` says
whether Feather serves the pass; ``on_fault``, given here, is the adapter's fall-back),
and the next ``begin_pass``, given the engine's own queues, rebuilds Feather's picture.
Adapters read requests through a ``RequestView``; nothing here imports an engine.  The
contract with an example loop: docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from operator import is_, itemgetter
from typing import Generic, Protocol, TypeVar

from feather_sched.core.config import FeatherConfig
from feather_sched.core.faults import FaultGuard
from feather_sched.core.prefix import describe_batch, gather_groups, group_of, order_by_group
from feather_sched.core.queue import Admission, QueueState
from feather_sched.core.tenants import DEFAULT_TENANT, service_of
from feather_sched.core.urgent import Room
from feather_sched.gates.base import BatchLayout, Decision, GateContext, Persistent
from feather_sched.gates.step_model import EngineShape
from feather_sched.telemetry import prometheus as metrics
from feather_sched.telemetry.stats import AdmissionCounts, SchedulerStats, StepMeter
from feather_sched.telemetry.steplog import BatchEntry

R = TypeVar("R")
RequestId = Hashable

MAX_OPEN_STEPS = 64
"""Steps formed but not yet reported; older ones are dropped unrewarded (an engine that
never reports a step, e.g. an empty one, cannot grow this without bound)."""
MAX_STEP_DECISIONS = 4096
"""Decisions kept for one step; several passes may wait for one step (an engine that
never decodes, e.g. prefill-only serving, must not grow a list without bound)."""

logger = logging.getLogger("feather_sched")


class RequestView(Protocol[R]):
    """How an adapter reads its engine's request type.  ``request_id`` is best an
    ``operator.attrgetter`` (the runtime maps it over the running list twice a pass)."""

    def request_id(self, request: R) -> RequestId: ...

    def chunk_keys(self, request: R) -> list:
        """The prompt's cumulative chunk keys (see ``cht``)."""

    def prompt_tokens(self, request: R) -> int:
        """Prompt length; a request whose prompt grew (a streaming session) is re-keyed."""

    def arrival_s(self, request: R) -> float | None:
        """Arrival time on the queue's clock, or None for now."""

    def priority(self, request: R) -> int:
        """Priority class, lower more urgent (0 where the engine has no priorities)."""

    # Optional: ``tenant(request) -> Hashable``, whom the request is served for (OpenAI's
    # ``user``, a header); a view without it puts every request in ``DEFAULT_TENANT``.


@dataclass
class _Tracked(Generic[R]):
    request: R
    prompt_tokens: int
    arrival_s: float
    """As the queue was given it (kept when the queue is rebuilt, ``resync``)."""
    preemptions: int = 0
    urgent_preemptions: int = 0
    """Times it was one of ``urgent_victims``."""
    tenant: Hashable = DEFAULT_TENANT
    """As the queue was given it: ``served`` charges it without asking the queue."""


@dataclass
class _Taken:
    """A fresh answer of this pass, and whether its request was admitted."""

    admission: Admission
    admitted: bool = False
    charged: float = 0.0
    """What the admission charged its tenant under fair share (``TenantShare.admitted``),
    refunded if the engine does not run the request after all."""


@dataclass
class _Mirror(Generic[R]):
    """The engine's running list as Feather last reconciled it, kept in step by Feather's
    own calls: an admission appends (as vLLM, SGLang and the simulator append to their
    lists), an exit removes.  While ``epoch`` is the queue's running epoch, the queue's
    running set is exactly ``ids``; an engine list holding the very objects of
    ``requests``, in order, needs no reconciling."""

    requests: list[R]
    ids: list[RequestId]
    epoch: int
    ordered: bool
    """Whether ``requests`` is in Feather's order (``FeatherRuntime.order``)."""


class FeatherRuntime(Generic[R]):
    """Feather's admission for one scheduler, behind ``core.contract.RuntimeContract``."""

    def __init__(self, config: FeatherConfig, view: RequestView[R], *,
                 clock: Callable[[], float] = time.monotonic, name: str = "feather",
                 seats: int | None = None, kv_tokens: int | None = None,
                 engine: EngineShape | None = None, chunk_tokens: int | None = None,
                 on_fault: Callable[[str], None] | None = None) -> None:
        """``seats``: the engine's cap on running requests, ``kv_tokens``: its KV cache in
        tokens, where the adapter knows them; ``engine``: its device and model, for the
        model gate's prior; ``chunk_tokens``: the tokens one of ``view``'s chunk keys
        stands for, where the engine's blocks round the configured size; ``on_fault``:
        the adapter's fall-back after a fault (``FaultGuard``)."""
        self.name = name
        self.config = config
        self.view = view
        self.clock = clock
        self.queue = config.make_queue(clock=clock, engine=engine, chunk_tokens=chunk_tokens)
        self.queue.seats = seats
        self.queue.kv_tokens = kv_tokens
        self.counts = AdmissionCounts()
        gate = self.queue.gate
        self.meter = StepMeter(name, stats_file=config.stats_file, step_log=config.step_log,
                               state_file=config.state_file,
                               gate=gate if isinstance(gate, Persistent) else None,
                               admissions=self.counts, save_every_s=config.save_every_s,
                               sink=metrics.PrometheusSink(name, config.max_tenant_labels,
                                                           tenants=(DEFAULT_TENANT,))
                               if metrics.enabled() else None)
        self.faults = FaultGuard(name, config.max_faults, self.meter, reset=self.drop,
                                 on_fault=on_fault)
        self._tracked: dict[RequestId, _Tracked[R]] = {}
        self._unsettled: dict[RequestId, _Tracked[R]] = {}
        """Requests tracked when a fault emptied the picture (``drop``), until the rebuild
        (``resync``) or their ``discard``: so each is still counted out once, and keeps
        its arrival and preemption counts."""
        self._taken: list[_Taken] = []
        self._open_steps: OrderedDict[Hashable, list[tuple[GateContext, Decision]]] = \
            OrderedDict()
        self._mirror: _Mirror[R] | None = None
        """The engine's running list as last reconciled (``_Mirror``)."""
        self._tenant: Callable[[R], Hashable] | None = getattr(view, "tenant", None)
        """The view's ``tenant``, where it has one: fair share's, and the per-tenant
        series' whether fair share is on or off."""
        self._places: dict[Hashable, int] | None = None
        """Under fair share with ``order_running``, each tenant's place in the running
        order as the pass began (``TenantShare.ranking``: the most served last)."""
        self._spent: set[RequestId] = set()
        """Requests preempted ``max_preemptions`` times: last of their group to go
        (``_spent_first``)."""

    @property
    def wants_batches(self) -> bool:
        """Whether ``end_step`` should be given each step's batch: for the step log, or
        for a gate that learns from batches (``Gate.observes``)."""
        return self.config.step_log is not None or self.queue.gate.observes

    @property
    def layout(self) -> BatchLayout:
        """How the engine lays its batch out: ``FEATHER`` (each prefix group one run, in
        ``batch_order``) with ``order_running`` on, unless the adapter found the engine
        keeps its own order (``engine_keeps_its_order``); else ``ENGINE``."""
        return self.queue.layout

    @property
    def batch_has_groups(self) -> bool:
        """Whether a batch's layout can matter: it is Feather's and a prefix group runs
        with two or more members (a batch that shares nothing gains nothing from being
        laid out, so adapters skip ``batch_order`` then). O(1)."""
        return self.queue.layout is BatchLayout.FEATHER and self.queue.has_running_group()

    def engine_keeps_its_order(self) -> None:
        """The adapter found that batch ordering cannot act in this engine: the layout is
        the engine's (``BatchLayout.ENGINE``), told to the queue, which keeps the tree's
        order (then the batch's), and to the gate, which prices the engine's order.
        ``begin_pass`` still orders the running list (``order_running``): its end is the
        preemption victim."""
        self.queue.use_layout(BatchLayout.ENGINE)

    # ---- requests ---------------------------------------------------------------------

    def __len__(self) -> int:
        """Requests waiting in Feather's queue."""
        return len(self.queue)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tracked

    def request(self, request_id: RequestId) -> R:
        """The engine's request object for an id Feather knows."""
        return self._tracked[request_id].request

    def enter_waiting(self, request: R) -> None:
        """The engine holds ``request`` in the waiting queue Feather orders.

        Idempotent: a new request is added, a running or held one returns to waiting
        (preemption, a skip undone), a waiting one stays.  A request whose prompt grew
        since Feather last saw it (a resumed streaming session) gets new chunk keys.
        """
        request_id = self._refresh(request)
        if self.queue.state(request_id) is not QueueState.WAITING:
            self.queue.requeue(request_id)

    def discard(self, request_id: RequestId) -> bool:
        """The engine let go of the request; forget it in any state.  O(its keys).

        Returns True when Feather knew it, False otherwise, so every exit path of an
        engine may call this and a request still leaves exactly once.
        """
        tracked = self._tracked.pop(request_id, None) or \
            self._unsettled.pop(request_id, None)
        if tracked is None:
            return False
        self._spent.discard(request_id)
        self._count_left([tracked])
        if request_id in self.queue:  # not after a fault emptied the picture (``drop``)
            mirror = self._current_mirror()
            in_mirror = mirror is not None and self._mirror_drops(mirror, request_id)
            self.queue.remove(request_id)
            if in_mirror:
                mirror.epoch = self.queue.running_epoch
        self._count_states()
        if not self._tracked:
            self.meter.save()  # drained: a run's end is on file even if shutdown is cut short
        return True

    def hold(self, request_id: RequestId) -> None:
        """The engine took a request out of Feather's waiting queue without running it.

        It is no candidate until the engine returns it (``enter_waiting``) or runs it
        (seen at the next reconciliation); an admission of it in this pass is void, and
        what it charged the tenant is refunded (``TenantShare.refund``).
        """
        if self.queue.state(request_id) is QueueState.HELD:
            return
        self.queue.hold(request_id)
        share = self.queue.share
        for taken in self._taken:
            if taken.admission.request_id == request_id and taken.admitted:
                taken.admitted = False
                if share is not None:
                    share.refund(self.queue.tenant(request_id), taken.charged)

    @property
    def fair_share(self) -> bool:
        """Whether fair share between tenants is on (``fairness``: ``tenants``, ``vtc``)."""
        return self.queue.share is not None

    @property
    def counts_service(self) -> bool:
        """Whether ``served`` does anything: fair share is on, or the metrics sink counts
        each named tenant's service; an adapter may skip the calls otherwise."""
        return self.queue.share is not None or (
            self.meter.sink is not None and self._tenant is not None)

    def served(self, request_id: RequestId, computed_tokens: int,
               generated_tokens: int) -> None:
        """A step computed ``computed_tokens`` prompt tokens for the request (a prefix-cache
        hit is not computed; a recomputation after preemption is) and generated
        ``generated_tokens``: its tenant's service, under fair share (``TenantShare.
        charge``) and on its metrics series.  Nothing for a request Feather does not know
        (call it before ``discard``), as after a fault until the rebuild (``drop``).
        O(1)."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        share = self.queue.share
        if share is not None:
            share.charge(tracked.tenant, computed_tokens, generated_tokens)
        if self.meter.sink is not None:
            self.meter.sink.served(tracked.tenant,
                                   service_of(computed_tokens, generated_tokens))

    def is_running(self, request_id: RequestId) -> bool:
        """Whether Feather has the request in its running set."""
        return request_id in self.queue and self.queue.state(request_id) is QueueState.RUNNING

    # ---- one scheduling pass ----------------------------------------------------------

    def begin_pass(self, running: Sequence[R], waiting: Iterable[R] | None = None,
                   held: Iterable[R] = ()) -> list[R]:
        """Start a pass: reconcile with the engine's running list, reopen admission.

        After a fault (``faults.dirty``) Feather's picture is first rebuilt from the
        engine's own sets (``resync``): ``running``, its whole ``waiting`` queue (required
        then: ValueError without it) and the requests it ``held`` outside both.

        Returns ``running`` in Feather's order (``order``), whose end an engine preempts
        first; with ``order_running`` off, as given (the engine's order, which keeps what
        was admitted together together: docs/results.md#gates), so an engine that preempts
        the end of its list must take ``preemption_victim``, or the latest arrival of the
        least urgent class by its own rule (vLLM's priority policy).  O(running) plus the
        sort; O(running) in C while the list is the one Feather last returned or saw,
        changed only by appended admissions and exits it was told of, none moving a
        group's rank (``_Mirror``).
        """
        if self.faults.dirty:
            if waiting is None:
                raise ValueError("begin_pass after a fault needs the engine's waiting queue")
            self.resync(running, waiting, held)
        ids = self._reconcile_running(running)
        self.queue.new_step()
        self._taken.clear()
        mirror = self._mirror
        if not self.config.order_running or self.config.is_vtc:
            return list(running)
        share = self.queue.share
        places = None if share is None else share.ranking()
        if mirror.ordered and places == self._places:
            return list(running)
        self._places = places
        ranked = self._ranking(running, ids, gathered=False)
        mirror.requests = list(map(running.__getitem__, ranked))
        mirror.ids = list(map(ids.__getitem__, ranked))
        mirror.ordered = True
        return list(mirror.requests)

    def order(self, running: Sequence[R]) -> list[R]:
        """``running`` in Feather's order, which is also its preemption order (the end
        first): by priority class, then each prefix group contiguous, groups by their
        oldest member's arrival, members by arrival (``prefix.order_by_group``). With
        ``order_running`` off, or while no group runs two members, simply by class and
        arrival.  Under fair share (with ``order_running``) each class is ordered so by
        tenant, the tenants by their counters as the pass began, the most served last
        (``TenantShare.ranking``): the engine preempts the most served tenant's requests
        first, and a tenant whose requests share nothing no longer pays for every
        preemption because its singletons are the youngest groups.  Under ``fairness:
        vtc``, the engine's own order as given (its end, the latest admitted, is VTC's
        victim, as under vLLM's FCFS).  O(n log n); the arrival sort alone on a list
        already sorted is O(n).
        """
        return self._ordered(running, self._ids(running), gathered=False)

    def batch_order(self, running: Sequence[R]) -> list[R]:
        """``order(running)`` with each prefix group gathered where its first member
        stands, across priority classes (``prefix.gather_groups``): how a batch is laid
        out, one run per group (vLLM's Model Runner V2 follows it, SGLang's decode batch
        is permuted into it; vLLM's V1 runner gathers the same way in its own batch).
        The same as ``order`` where one class runs. O(n log n)."""
        return self._ordered(running, self._ids(running), gathered=True)

    def _ordered(self, running: Sequence[R], ids: list[RequestId], *,
                 gathered: bool) -> list[R]:
        """``running`` (whose request ids are ``ids``) in ``order``'s order, or
        ``batch_order``'s where ``gathered``."""
        return list(map(running.__getitem__, self._ranking(running, ids, gathered=gathered)))

    def _ranking(self, running: Sequence[R], ids: list[RequestId], *,
                 gathered: bool) -> Sequence[int]:
        """The indices of ``running`` in ``_ordered``'s order: sorted by ``_order_keys``,
        each group contiguous within its block (its class, and tenant under fair share),
        and with ``gathered`` each group gathered across blocks."""
        if self.config.is_vtc:
            return range(len(running))
        queue = self.queue
        keys = self._order_keys(running, ids)
        if not self.config.order_running or (
                not queue.has_running_group() and len(running) == queue.num_running):
            return sorted(range(len(running)), key=keys.__getitem__)
        try:
            groups = queue.groups(ids)
        except KeyError:
            groups = [self.group(request) for request in running]
        block = itemgetter(0) if self._places is None else itemgetter(0, 1)
        blocks = list(map(block, keys))
        one_block = len(set(blocks)) == 1
        runs = groups if one_block else list(zip(blocks, groups, strict=True))
        ranked = self._spent_first(order_by_group(range(len(running)), runs, keys), ids, runs)
        if gathered and not one_block:
            ranked = gather_groups(ranked, [groups[i] for i in ranked])
        return ranked

    def _order_keys(self, running: Sequence[R], ids: list[RequestId]) -> list[tuple]:
        """What ``order`` sorts ``running`` (whose ids are ``ids``) by: the ``age_key``s,
        under fair share with each tenant's place (``_places``) after the class.  O(n),
        in C without fair share."""
        queue = self.queue
        try:
            ages = queue.age_keys(ids)
        except KeyError:  # a request the queue never saw
            ages = [self.age_key(request) for request in running]
        if self._places is None:
            return ages
        tenants = [queue.tenant(i) if i in queue else self._tenant_of(r)
                   for i, r in zip(ids, running, strict=True)]
        return list(map(self._placed, ages, tenants))

    def _order_key(self, request_id: RequestId) -> tuple:
        """``_order_keys`` of one request the queue knows.  O(1)."""
        queue = self.queue
        age = queue.age_key(request_id)
        return age if self._places is None else self._placed(age, queue.tenant(request_id))

    def _placed(self, age: tuple, tenant: Hashable) -> tuple:
        """``age`` (an ``age_key``) with the tenant's place in ``_places`` after the class
        (a tenant the ranking did not see last).  O(1)."""
        places = self._places
        return (age[0], places.get(tenant, len(places)), *age[1:])

    def _spent_first(self, ranked: list[int], ids: list[RequestId],
                     groups: Sequence[Hashable]) -> list[int]:
        """``ranked`` (indices into ``ids``, each group contiguous) with, inside each
        group, its members at ``max_preemptions`` moved to the front, so that the
        group's other members are preempted before them.  O(n log n); ``ranked`` as is
        while none is at the bound."""
        spent = self._spent
        if not spent or not any(ids[i] in spent for i in ranked):
            return ranked
        where: dict[Hashable, int] = {}
        for place, i in enumerate(ranked):
            where.setdefault(groups[i], place)
        return sorted(ranked, key=lambda i: (where[groups[i]], ids[i] not in spent))

    def preemption_victim(self, running: Sequence[R]) -> R:
        """The request to preempt when the engine runs out of KV blocks: the end of
        ``order(running)``, the newest member of the youngest group (by its oldest running
        member) of the least urgent class. Preempting a group from its newest member
        frees its prefix when the last goes, and a request is preempted only while every
        other running group of its class or a less urgent one has a member that arrived
        before its own group's oldest: never for a group made only of younger requests
        (an old singleton never pays for a stream of young majority requests). Under
        fair share, all that among the requests of the class's most served tenant
        (``order``). With ``order_running`` off: the latest arrival of the least urgent
        class; within its group, a member at ``max_preemptions`` goes after the others
        (``_spent_first``). O(n log n).
        """
        return self.order(running)[-1]

    def urgent_victims(self, running: Sequence[R], request: R, room: Room[R]) -> list[R]:
        """The running requests to preempt together for ``request``, waiting and unable to
        run for lack of KV room or a seat, where the engine's ``room`` tells whether a
        set of victims makes room (``Room.made_by``: a seat, and KV room, which a prefix
        shared with a request that stays does not free).  Those that may give way are
        the running requests of a less urgent class that were urgent victims fewer than
        ``max_urgent_preemptions`` times; among them, the shortest run of
        ``preemption_victim``'s order (the end of Feather's order first) that makes room,
        less each member, the latest first, that the others make room without.  So no
        more go than the request needs: one for a seat; for KV room, not a group's
        members whose prefix stays held.  Each is counted as an urgent victim (the
        engine preempts them all), so a request is preempted for urgency at most
        ``max_urgent_preemptions`` times in its life, and an urgent request waits for
        room only behind requests of its own class or a more urgent one, or ones already
        preempted so.  [] when even all of them leave no room, or the option is 0.
        O(k n log n) for a run of k, and up to 2k calls of ``room.made_by``."""
        limit = self.config.max_urgent_preemptions
        if not limit:
            return []
        priority, view, tracked = self.view.priority(request), self.view, self._tracked

        def may_go(candidate: R) -> bool:
            known = tracked.get(view.request_id(candidate))
            return view.priority(candidate) > priority and (
                known is None or known.urgent_preemptions < limit)

        made_by = room.made_by
        remaining, victims, found = list(filter(may_go, running)), [], False
        while remaining and not found:
            victims.append(self.preemption_victim(remaining))
            remaining.remove(victims[-1])
            found = made_by(victims)
        if not found:
            return []
        for victim in victims[-2::-1]:
            rest = [v for v in victims if v is not victim]
            if made_by(rest):
                victims = rest
        for victim in victims:
            known = tracked.get(view.request_id(victim))
            if known is not None:
                known.urgent_preemptions += 1
        return victims

    def age_key(self, request: R) -> tuple[int, float, float]:
        """Sorts requests by class, the most urgent first, then by age, the oldest first:
        (priority class, arrival time, order of entry into the queue); a request the queue
        never saw counts as arriving now, after all the others of its class. O(1)."""
        try:
            return self.queue.age_key(self.view.request_id(request))
        except KeyError:
            pass
        arrival = self.view.arrival_s(request)
        return (self.view.priority(request), self.clock() if arrival is None else arrival,
                float("inf"))

    def preempted(self, request: R, *, urgent: bool = False) -> None:
        """The engine preempted ``request`` (its own victim choice, reported afterwards;
        ``urgent``: as one of the ``urgent_victims`` of a more urgent request): counted per
        request and per class, with its group's running size; at ``max_preemptions`` it
        goes after its group's other members from then on (``order``). O(running)."""
        request_id = self._refresh(request)
        tracked = self._tracked[request_id]
        tracked.preemptions += 1
        limit = self.config.max_preemptions
        if limit is not None and tracked.preemptions >= limit:
            self._spent.add(request_id)
            if self._mirror is not None:
                self._mirror.ordered = False  # its group's order changes (``_spent_first``)
        group = self.group(request)
        queue = self.queue
        siblings = sum(1 for r in queue.running_ids()
                       if r != request_id and queue.group(r) == group)
        self.meter.preempted(tracked.preemptions, priority=queue.priority(request_id),
                             group_size=siblings + 1, urgent=urgent)

    def passes_due(self, request: R) -> bool:
        """Whether running ``request`` now, by a path that bypasses Feather's queue, would
        pass a waiting request that a bound has made due: one that arrived before it in
        its class or a more urgent one. The adapter then lets the due request go first.
        ``request`` is read as the engine has it now (a streaming session's next turn is
        a new arrival). O(requeued requests)."""
        due = self.queue.due()
        if due is None or self.view.request_id(request) == due:
            return False
        arrival = self.view.arrival_s(request)
        if arrival is None:
            arrival = self.age_key(request)[1]
        return (self.view.priority(request), arrival) > \
            (self.queue.priority(due), self.queue.arrival_s(due))

    def decide(self, offered: R | None = None) -> Admission | None:
        """The admission for ``offered`` (default: the queue's candidate); None if none.

        The answer is cached until something changes, and counted once when fresh.
        """
        offered_id = None
        if offered is not None:
            self.enter_waiting(offered)
            offered_id = self.view.request_id(offered)
        admission = self.queue.decide(offered_id)
        if admission is None:
            return None
        if not self._taken or self._taken[-1].admission is not admission:
            self.counts.asked += 1
            self._taken.append(_Taken(admission))
        return admission

    def promise(self, request: R) -> None:
        """The engine preempted running requests (``urgent_victims``) to make room for
        waiting ``request`` on its ADD: that ADD holds until it runs or the pass ends,
        the gate not asked again as the victims return to waiting
        (``FeatherQueue.promise``).  O(1)."""
        self.queue.promise(self.view.request_id(request))

    def rank_waiting(self, waiting: Sequence[R]) -> list[R]:
        """``waiting`` (the engine's waiting list) in the order Feather would admit it:
        the candidate first (``candidate``), then the requests Feather holds waiting as
        the queue ranks them (class, shared prefix with the running set, arrival:
        ``FeatherQueue.rank_key``; under fair share, those of tenants the share admits
        now first, and the least served tenant first among requests sharing as much),
        then the rest (running, held or unknown to Feather) in their given order.  For an
        engine that walks its own list; the list is not changed.  O(n log n), plus
        ``TenantShare.eligible_tenants`` once per class under fair share."""
        first = self.queue.candidate()
        queue, view, share = self.queue, self.view, self.queue.share
        admitted: dict[int, set[Hashable]] = {}

        def held_back(request_id: RequestId) -> bool:
            if share is None:
                return False
            priority = queue.priority(request_id)
            if priority not in admitted:
                admitted[priority] = set(share.eligible_tenants(priority))
            return queue.tenant(request_id) not in admitted[priority]

        def rank(request: R) -> tuple:
            request_id = view.request_id(request)
            if request_id == first:
                return (0,)
            if request_id in queue and queue.state(request_id) is QueueState.WAITING:
                key = queue.rank_key(request_id)
                return (1, key[0], held_back(request_id), *key[1:])
            return (2,)

        return sorted(waiting, key=rank)

    def describe_batch(self, rows: Iterable[tuple[R, int, int]]) -> list[BatchEntry]:
        """A step's batch for the step log and a gate that observes (``end_step``):
        ``rows`` of (request, context tokens, new tokens) in the batch's order, described
        in Feather's chunks (``prefix.describe_batch``), the same in every engine; a
        request Feather does not track is keyed by the view.  O(keys of the batch)."""
        queue, view, tracked = self.queue, self.view, self._tracked
        described = []
        for request, context, new in rows:
            request_id = view.request_id(request)
            keys = queue.keys(request_id) if request_id in tracked else \
                view.chunk_keys(request)
            described.append((request_id, keys, context, new))
        return describe_batch(described, queue.chunk_tokens)

    def candidate(self) -> R | None:
        """The request ``decide()`` would judge next, without asking the gate (for an
        engine that orders its own list by it); None when nothing waits."""
        request_id = self.queue.candidate()
        return None if request_id is None else self.request(request_id)

    def admit(self, request: R) -> None:
        """The engine admits ``request``; it must be the subject of the last ADD.  Under
        fair share its tenant is charged ``TenantShare.admitted`` for its prompt (given
        back by ``hold`` if the engine skips it in this pass)."""
        request_id = self.view.request_id(request)
        last = self._taken[-1] if self._taken else None
        if last is None or last.admission.request_id != request_id or \
                last.admission.decision is not Decision.ADD or last.admitted:
            raise RuntimeError(f"admit({request_id!r}) without an ADD decision for it")
        mirror = self._current_mirror()
        self.queue.admit(request_id)
        last.admitted = True
        share = self.queue.share
        if share is not None:
            last.charged = share.admitted(self.queue.tenant(request_id),
                                          self._tracked[request_id].prompt_tokens)
        if mirror is not None:
            self._mirror_appends(mirror, request, request_id)

    def end_pass(self, step: Hashable, running: Sequence[R]) -> None:
        """The pass formed ``step``: reconcile, count and bind the decisions that held.
        It counts as served (``FaultGuard.served``)."""
        decided = bool(self._taken)
        self.reconcile(running)
        credit: list[tuple[GateContext, Decision]] = []  # taken effect, shown to the gate
        admitted: list[RequestId] = []
        stops = forced = 0
        for taken in self._taken:
            admission = taken.admission
            if admission.decision is Decision.STOP:
                if admission.context is not None:  # the gate's STOP, not its echo
                    stops += 1
                    credit.append((admission.context, Decision.STOP))
            elif taken.admitted and self.is_running(admission.request_id):
                admitted.append(admission.request_id)
                forced += admission.forced
                if admission.context is not None:
                    credit.append((admission.context, Decision.ADD))
        counts = self.counts
        counts.stop, counts.forced, counts.add = (counts.stop + stops, counts.forced + forced,
                                                  counts.add + len(admitted) - forced)
        stats = self._count_states()
        if self.meter.sink is not None:
            now = self.clock()
            self.meter.sink.pass_ended(
                asked=len(self._taken), add=len(admitted) - forced, stop=stops, forced=forced,
                admitted=[(self.queue.tenant(r), now - self.queue.arrival_s(r))
                          for r in admitted],
                groups=len({self.group(r) for r in running}), waiting=stats.waiting,
                running=stats.running)
        self._taken.clear()
        self.faults.served(decided)
        if credit:
            decisions = self._open_steps.setdefault(step, [])
            decisions.extend(credit)
            del decisions[:-MAX_STEP_DECISIONS]
            self._open_steps.move_to_end(step)
            while len(self._open_steps) > MAX_OPEN_STEPS:
                self._open_steps.popitem(last=False)

    def end_step(self, step: Hashable, batch_size: int, seconds: float,
                 batch: Sequence[BatchEntry] | None = None) -> None:
        """Step ``step`` ran ``batch_size`` requests in ``seconds``: reward and record it."""
        decisions = self._open_steps.pop(step, None)
        if not batch_size:
            return
        if batch is not None:
            self.queue.gate.observe(batch, seconds)
        if decisions and seconds > 0:
            self.queue.gate.reward(decisions, batch_size, seconds)
        self.meter.step(batch_size, seconds, batch)

    # ---- reconciliation ---------------------------------------------------------------

    def reconcile(self, running: Iterable[R], waiting: Iterable[R] | None = None) -> None:
        """Make Feather's running set the engine's.

        A request the engine runs is running (added if new, re-keyed if its prompt grew);
        a request Feather had running that the engine no longer runs is held.  Given
        ``waiting`` (the engine's whole waiting queue), those requests are entered and
        any request in neither list is discarded: it left the engine by a path Feather
        did not see.  O(running + waiting) when something changed.
        """
        if not isinstance(running, Sequence):
            running = list(running)
        ids = self._reconcile_running(running)
        if waiting is None:
            return
        queue, view = self.queue, self.view
        running_ids = set(ids)
        waiting_ids = set()
        for request in waiting:
            request_id = view.request_id(request)
            waiting_ids.add(request_id)
            tracked = self._tracked.get(request_id)
            if tracked is None or tracked.prompt_tokens != view.prompt_tokens(request) or \
                    queue.state(request_id) is not QueueState.WAITING:
                self.enter_waiting(request)
        if len(self._tracked) > len(running_ids) + len(waiting_ids):
            gone = [r for r in self._tracked if r not in running_ids and r not in waiting_ids]
            for request_id in gone:
                self.discard(request_id)

    def _reconcile_running(self, running: Sequence[R]) -> list[RequestId]:
        """``reconcile``'s running half; returns ``running``'s request ids, in order.
        Nothing to do for the mirror's list (``_Mirror``)."""
        mirror = self._current_mirror()
        if mirror is not None and len(running) == len(mirror.requests) and \
                all(map(is_, running, mirror.requests)):
            return mirror.ids
        queue = self.queue
        ids = self._ids(running)
        running_ids = set(ids)
        if not queue.runs_exactly(running_ids):
            for request in running:
                request_id = self._refresh(request)
                state = queue.state(request_id)
                if state is QueueState.WAITING:
                    queue.admit(request_id)
                elif state is QueueState.HELD:
                    queue.run(request_id)
            for request_id in [r for r in queue.running_ids() if r not in running_ids]:
                self.hold(request_id)
        self._mirror = _Mirror(list(running), ids, queue.running_epoch, ordered=False)
        return ids

    def _current_mirror(self) -> _Mirror[R] | None:
        """The mirror, if the queue's running set has not changed behind it."""
        mirror = self._mirror
        return mirror if mirror is not None and \
            mirror.epoch == self.queue.running_epoch else None

    def _mirror_appends(self, mirror: _Mirror[R], request: R, request_id: RequestId) -> None:
        """The engine appends an admitted request to its running list.  Feather's order
        (``order``) still holds if it runs alone in its prefix group and is no older than
        the list's last: a new group that ranks last. O(1)."""
        queue = self.queue
        mirror.ordered = mirror.ordered and queue.group_runners(request_id) <= 1 and (
            not mirror.ids or self._order_key(mirror.ids[-1]) <= self._order_key(request_id))
        mirror.requests.append(request)
        mirror.ids.append(request_id)
        mirror.epoch = queue.running_epoch

    def _mirror_drops(self, mirror: _Mirror[R], request_id: RequestId) -> bool:
        """Take a request that is leaving (``discard``, before the queue forgets it) out
        of the mirror; False if it is not there (not running).  Feather's order still
        holds unless it was the oldest of a group that runs on (the group ranked by its
        age).  O(running), in C."""
        if self.queue.state(request_id) is not QueueState.RUNNING:
            return False
        ids = mirror.ids
        try:
            at = ids.index(request_id)  # the mirror's ids are the running set
        except ValueError:  # never expected: the next pass reconciles in full
            self._mirror = None
            return False
        if self._spent:  # a group's members may stand out of age order (``_spent_first``)
            mirror.ordered = False
        elif mirror.ordered and at + 1 < len(ids):
            key = self._run_key
            mirror.ordered = key(ids[at]) != key(ids[at + 1]) or \
                (at > 0 and key(ids[at - 1]) == key(ids[at]))
        del mirror.requests[at], ids[at]
        return True

    def _run_key(self, request_id: RequestId) -> tuple:
        """What ``order`` keeps contiguous: the class (and tenant, under fair share) and
        the prefix group. O(1)."""
        queue = self.queue
        if self._places is None:
            return queue.priority(request_id), queue.group(request_id)
        return *self._order_key(request_id)[:2], queue.group(request_id)

    def _ids(self, requests: Sequence[R]) -> list[RequestId]:
        """The requests' ids; C speed where the view's ``request_id`` is an attrgetter."""
        return list(map(self.view.request_id, requests))

    def resync(self, running: Sequence[R], waiting: Iterable[R],
               held: Iterable[R] = ()) -> None:
        """Rebuild Feather's picture from the engine's after a fault: the queue is cleared
        and refilled with the engine's ``running`` and ``waiting`` requests, and those it
        ``held`` outside both (parked in a queue of its own), in arrival order (each keeps
        its arrival time and preemption count; the gate keeps what it learned; the
        waiting bounds count afresh); a request Feather knew that is in none left unseen
        and is counted out once.  Clears ``faults.dirty``.  A fault midway leaves the
        picture empty (``drop``), to be rebuilt again.  O(their keys + n log n)."""
        view = self.view
        known = {**self._unsettled, **self._tracked}
        self._tracked, self._unsettled = {}, known
        now = self.clock()

        def arrival(request: R) -> float:
            old = known.get(view.request_id(request))
            if old is not None and old.prompt_tokens == view.prompt_tokens(request):
                return old.arrival_s
            given = view.arrival_s(request)
            return now if given is None else given

        try:
            self._clear()
            entries = [(state, arrival(request), request)
                       for state, requests in ((QueueState.RUNNING, running),
                                               (QueueState.WAITING, waiting),
                                               (QueueState.HELD, held))
                       for request in requests]
            entries.sort(key=lambda entry: (entry[0] is not QueueState.RUNNING, entry[1]))
            for state, arrival_s, request in entries:
                old = known.get(view.request_id(request))
                request_id = self._track(request, arrival_s, old)
                if state is QueueState.RUNNING:
                    self.queue.admit(request_id)
                elif state is QueueState.HELD:
                    self.queue.hold(request_id)
        except BaseException:
            self.drop()  # those it did not see again count out when a rebuild completes
            raise
        self._unsettled = {}
        self._count_states()
        self.faults.dirty = False
        self._count_left([old for r, old in known.items() if r not in self._tracked])

    def drop(self) -> None:
        """Empty Feather's picture after a fault (``FaultGuard.reset``): a fault may leave
        the queue half-updated, where a call could raise again; an empty picture answers
        every call an adapter makes until the rebuild (``served`` charges nobody,
        ``discard`` counts a request out once, from ``_unsettled``), so a fault counts
        once.  The tenants' counters and the gate keep what they had.  O(tracked)."""
        self._unsettled.update(self._tracked)
        self._tracked = {}
        self._clear()
        self._count_states()

    def _clear(self) -> None:
        """The queue, this pass's answers and the running list's mirror, forgotten."""
        self._taken.clear()
        self._mirror = None
        self._places = None
        self.queue.clear()

    # ---- order ------------------------------------------------------------------------

    def group(self, request: R) -> Hashable:
        """The request's prefix group (``prefix.group_of`` over its chunk keys)."""
        request_id = self.view.request_id(request)
        if request_id in self._tracked:
            return self.queue.group(request_id)
        return group_of(self.view.chunk_keys(request), request_id)

    # ---- lifecycle --------------------------------------------------------------------

    def close(self) -> None:
        """Save the meter's files once more (engine shutdown)."""
        self.meter.close()

    # ---- internals --------------------------------------------------------------------

    def _count_states(self) -> SchedulerStats:
        """Bring the waiting and running counts in the stats up to date; O(1)."""
        stats = self.meter.stats
        stats.waiting, stats.running = len(self.queue), self.queue.num_running
        return stats

    def _refresh(self, request: R) -> RequestId:
        """Track ``request`` (new, or re-keyed when its prompt grew); returns its id."""
        view = self.view
        request_id = view.request_id(request)
        tracked = self._tracked.get(request_id)
        prompt_tokens = view.prompt_tokens(request)
        if tracked is not None and tracked.prompt_tokens == prompt_tokens:
            tracked.request = request
            return request_id
        arrival = view.arrival_s(request)
        if tracked is not None:
            self.queue.remove(request_id)
        elif (tracked := self._unsettled.pop(request_id, None)) is not None and \
                tracked.prompt_tokens == prompt_tokens:  # known before a fault (``drop``)
            arrival = tracked.arrival_s
        return self._track(request, arrival, tracked)

    def _track(self, request: R, arrival_s: float | None,
               before: _Tracked[R] | None = None) -> RequestId:
        """Track ``request`` and add it to the queue as waiting (arrival None: now); a
        request tracked ``before`` (re-keyed, or rebuilt after a fault) keeps its counts
        of preemptions, so ``max_urgent_preemptions`` bounds its whole life; one that was
        not is counted in (once: tracked, it is counted out once, ``_count_left``)."""
        view = self.view
        request_id = view.request_id(request)
        arrival = self.clock() if arrival_s is None else arrival_s
        prompt_tokens = view.prompt_tokens(request)
        tenant = self._tenant_of(request)
        tracked = self._tracked[request_id] = _Tracked(request, prompt_tokens, arrival,
                                                       tenant=tenant)
        if before is None:
            self.meter.stats.requests_entered += 1
        else:
            tracked.preemptions = before.preemptions
            tracked.urgent_preemptions = before.urgent_preemptions
        self.queue.add(request_id, view.chunk_keys(request), arrival, prompt_tokens,
                       view.priority(request), tenant)
        return request_id

    def _tenant_of(self, request: R) -> Hashable:
        """The request's tenant as the view names it (``DEFAULT_TENANT`` where it names
        none)."""
        return DEFAULT_TENANT if self._tenant is None else self._tenant(request)

    def _count_left(self, gone: Sequence[_Tracked[R]]) -> None:
        """Count requests out (they left the engine): the stats, then the sink."""
        self.meter.stats.requests_left += len(gone)
        if self.meter.sink is not None:
            for tracked in gone:
                self.meter.sink.request_left(tracked.preemptions)
