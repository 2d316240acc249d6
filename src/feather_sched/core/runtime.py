"""FeatherRuntime: the one admission contract that vLLM, SGLang and the simulator drive.

A thin composition of rooms, each with one job and its own state, behind one contract
(``core.contract.RuntimeContract``: every member an adapter may use, each with its
contract; docs/architecture.md's table is generated from it): the ``FeatherQueue``; the
``Record`` of the requests the engine holds; the ``Order`` of its running and waiting
lists; the ``PassLedger`` of this pass's admissions and the steps awaiting their reward;
``Recovery`` after a fault; urgent preemption's rule (``core.urgent``); and the
``StepMeter`` with stats, step log and saved gate state.  Adapters never reach the rooms.

Invariants: the running set is never assumed from admissions: ``begin_pass`` and
``end_pass`` each take what the engine reports as running, so a request it skipped, parked
or ran by a path Feather does not see is placed where the engine has it.  An exception in
any call is contained by the adapter calling through ``faults`` (``FaultGuard``), and the
next ``begin_pass``, given the engine's own queues, rebuilds Feather's picture.  Nothing
here imports an engine.  The contract with an example loop: docs/architecture.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from operator import is_
from typing import Generic

from feather_sched.core.config import FeatherConfig
from feather_sched.core.faults import FaultGuard
from feather_sched.core.ledger import PassLedger
from feather_sched.core.order import Order
from feather_sched.core.prefix import describe_batch
from feather_sched.core.queue import Admission, QueueState
from feather_sched.core.record import Record
from feather_sched.core.recovery import Recovery
from feather_sched.core.tenants import DEFAULT_TENANT, service_of
from feather_sched.core.urgent import Room, fewest_victims
from feather_sched.core.view import R, RequestId, RequestView
from feather_sched.gates.base import BatchLayout, Persistent
from feather_sched.gates.step_model import EngineShape
from feather_sched.telemetry import prometheus as metrics
from feather_sched.telemetry.stats import SchedulerStats, StepMeter
from feather_sched.telemetry.steplog import BatchEntry

__all__ = ["FeatherRuntime", "R", "RequestId", "RequestView"]


class FeatherRuntime(Generic[R]):
    """Feather's admission for one scheduler, behind ``core.contract.RuntimeContract``
    (each member's contract is there; each room's docstrings give the details)."""

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
        self.name, self.config, self.view, self.clock = name, config, view, clock
        self.queue = queue = config.make_queue(clock=clock, engine=engine,
                                               chunk_tokens=chunk_tokens)
        queue.seats, queue.kv_tokens = seats, kv_tokens
        self._ledger = PassLedger(queue)
        self.counts = self._ledger.counts
        gate = queue.gate
        self.meter = StepMeter(name, stats_file=config.stats_file, step_log=config.step_log,
                               state_file=config.state_file,
                               gate=gate if isinstance(gate, Persistent) else None,
                               admissions=self.counts, save_every_s=config.save_every_s,
                               sink=metrics.PrometheusSink(name, config.max_tenant_labels,
                                                           tenants=(DEFAULT_TENANT,))
                               if metrics.enabled() else None)
        self.faults = FaultGuard(name, config.max_faults, self.meter, reset=self.drop,
                                 on_fault=on_fault)
        self._record = Record(view, queue, clock, self.meter)
        self._order = Order(config, view, queue, self._record, clock)
        self._recovery = Recovery(view, clock, queue, self._record, self._order,
                                  self._ledger, self._count_states)

    @property
    def wants_batches(self) -> bool:
        """For the step log, or for a gate that learns from batches (``Gate.observes``)."""
        return self.config.step_log is not None or self.queue.gate.observes

    @property
    def layout(self) -> BatchLayout:
        """The queue's layout (``FeatherQueue.layout``)."""
        return self.queue.layout

    @property
    def batch_has_groups(self) -> bool:
        """Feather's layout and a prefix group running two or more. O(1)."""
        return self.queue.layout is BatchLayout.FEATHER and self.queue.has_running_group()

    def engine_keeps_its_order(self) -> None:
        """Told to the queue and its gate (``FeatherQueue.use_layout``)."""
        self.queue.use_layout(BatchLayout.ENGINE)

    # ---- requests ---------------------------------------------------------------------

    def __len__(self) -> int:
        """Requests waiting in Feather's queue."""
        return len(self.queue)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._record.tracked

    def request(self, request_id: RequestId) -> R:
        """The engine's request object for an id Feather knows."""
        return self._record.tracked[request_id].request

    def enter_waiting(self, request: R) -> None:
        """New, preempted, skipped or re-keyed alike (``Record.refresh``)."""
        request_id = self._record.refresh(request)
        if self.queue.state(request_id) is not QueueState.WAITING:
            self.queue.requeue(request_id)

    def discard(self, request_id: RequestId) -> bool:
        """Forgotten in any state, counted out once.  O(its keys)."""
        if not self._record.forget(request_id):
            return False
        self._order.spent.discard(request_id)
        if request_id in self.queue:  # not after a fault emptied the picture (``drop``)
            self._order.remove(request_id)
        self._count_states()
        if not self._record.tracked:
            self.meter.save()  # drained: a run's end is on file even if shutdown is cut short
        return True

    def hold(self, request_id: RequestId) -> None:
        """No candidate until it returns; its admission void (``PassLedger.void``)."""
        if self.queue.state(request_id) is QueueState.HELD:
            return
        self.queue.hold(request_id)
        self._ledger.void(request_id)

    @property
    def fair_share(self) -> bool:
        """Whether fair share between tenants is on (``fairness``: ``tenants``, ``vtc``)."""
        return self.queue.share is not None

    @property
    def counts_service(self) -> bool:
        """Fair share is on, or the metrics sink counts each named tenant's service."""
        return self.queue.share is not None or (
            self.meter.sink is not None and self._record.tenant is not None)

    def served(self, request_id: RequestId, computed_tokens: int,
               generated_tokens: int) -> None:
        """Charged to the request's tenant (``TenantShare.charge``) and its series;
        nothing for a request Feather does not know.  O(1)."""
        tracked = self._record.tracked.get(request_id)
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
        """Rebuilt after a fault (``resync``), reconciled, then ordered (``Order.
        for_pass``): O(running) in C while the list is the mirror's, else the sort."""
        if self.faults.dirty:
            if waiting is None:
                raise ValueError("begin_pass after a fault needs the engine's waiting queue")
            self.resync(running, waiting, held)
        ids = self._reconcile_running(running)
        self.queue.new_step()
        self._ledger.taken.clear()
        return self._order.for_pass(running, ids)

    def order(self, running: Sequence[R]) -> list[R]:
        """``Order.order``.  O(n log n)."""
        return self._order.order(running)

    def batch_order(self, running: Sequence[R]) -> list[R]:
        """``Order.order``, each group gathered (``prefix.gather_groups``).  O(n log n)."""
        return self._order.order(running, gathered=True)

    def preemption_victim(self, running: Sequence[R]) -> R:
        """The end of ``order(running)``.  O(n log n)."""
        return self.order(running)[-1]

    def urgent_victims(self, running: Sequence[R], request: R, room: Room[R]) -> list[R]:
        """``urgent.fewest_victims`` among the running requests that may give way
        (``Record.may_give_way``), each counted as an urgent victim."""
        limit = self.config.max_urgent_preemptions
        if not limit:
            return []
        priority, record = self.view.priority(request), self._record
        may_go = [r for r in running if record.may_give_way(r, priority, limit)]
        victims = fewest_victims(may_go, room, self.preemption_victim)
        record.urgent_victims(victims)
        return victims

    def age_key(self, request: R) -> tuple[int, float, float]:
        """``Order.age_key``: class, then age, the oldest first. O(1)."""
        return self._order.age_key(request)

    def preempted(self, request: R, *, urgent: bool = False) -> None:
        """Counted per request and class, with its group's running size; at
        ``max_preemptions`` it goes last of its group (``Order.spend``). O(running)."""
        request_id = self._record.refresh(request)
        tracked = self._record.tracked[request_id]
        tracked.preemptions += 1
        limit = self.config.max_preemptions
        if limit is not None and tracked.preemptions >= limit:
            self._order.spend(request_id)
        group = self.group(request)
        queue = self.queue
        siblings = sum(1 for r in queue.running_ids()
                       if r != request_id and queue.group(r) == group)
        self.meter.preempted(tracked.preemptions, priority=queue.priority(request_id),
                             group_size=siblings + 1, urgent=urgent)

    def passes_due(self, request: R) -> bool:
        """``Order.passes_due``.  O(requeued requests)."""
        return self._order.passes_due(request)

    def decide(self, offered: R | None = None) -> Admission | None:
        """The queue's answer, cached until something changes, counted once when fresh."""
        offered_id = None
        if offered is not None:
            self.enter_waiting(offered)
            offered_id = self.view.request_id(offered)
        admission = self.queue.decide(offered_id)
        if admission is None:
            return None
        self._ledger.take(admission)
        return admission

    def promise(self, request: R) -> None:
        """``FeatherQueue.promise``.  O(1)."""
        self.queue.promise(self.view.request_id(request))

    def rank_waiting(self, waiting: Sequence[R]) -> list[R]:
        """``Order.rank_waiting``.  O(n log n)."""
        return self._order.rank_waiting(waiting)

    def describe_batch(self, rows: Iterable[tuple[R, int, int]]) -> list[BatchEntry]:
        """In Feather's chunks (``prefix.describe_batch``); a request Feather does not
        track keyed by the view.  O(keys of the batch)."""
        queue, view, tracked = self.queue, self.view, self._record.tracked
        described = []
        for request, context, new in rows:
            request_id = view.request_id(request)
            keys = queue.keys(request_id) if request_id in tracked else \
                view.chunk_keys(request)
            described.append((request_id, keys, context, new))
        return describe_batch(described, queue.chunk_tokens)

    def candidate(self) -> R | None:
        """The queue's candidate, without asking the gate."""
        request_id = self.queue.candidate()
        return None if request_id is None else self.request(request_id)

    def admit(self, request: R) -> None:
        """Checked, charged (``PassLedger``) and appended to the mirror (``Order``)."""
        request_id = self.view.request_id(request)
        taken = self._ledger.last_add(request_id)
        mirror = self._order.current()
        self.queue.admit(request_id)
        self._ledger.admitted(taken, self._record.tracked[request_id].prompt_tokens)
        if mirror is not None:
            self._order.appends(mirror, request, request_id)

    def end_pass(self, step: Hashable, running: Sequence[R]) -> None:
        """Reconciled, settled (``PassLedger.settle``) and bound to ``step``; it counts
        as served (``FaultGuard.served``)."""
        decided = bool(self._ledger.taken)
        self.reconcile(running)
        settled = self._ledger.settle(self.is_running)
        stats = self._count_states()
        if self.meter.sink is not None:
            now, queue = self.clock(), self.queue
            self.meter.sink.pass_ended(
                asked=settled.asked, add=len(settled.admitted) - settled.forced,
                stop=settled.stops, forced=settled.forced,
                admitted=[(queue.tenant(r), now - queue.arrival_s(r))
                          for r in settled.admitted],
                groups=len({self.group(r) for r in running}), waiting=stats.waiting,
                running=stats.running)
        self._ledger.close(step, settled.credit)
        self.faults.served(decided)

    def end_step(self, step: Hashable, batch_size: int, seconds: float,
                 batch: Sequence[BatchEntry] | None = None) -> None:
        """Step ``step`` ran ``batch_size`` requests in ``seconds``: reward and record it."""
        decisions = self._ledger.reward(step)
        if not batch_size:
            return
        if batch is not None:
            self.queue.gate.observe(batch, seconds)
        if decisions and seconds > 0:
            self.queue.gate.reward(decisions, batch_size, seconds)
        self.meter.step(batch_size, seconds, batch)

    # ---- reconciliation ---------------------------------------------------------------

    def reconcile(self, running: Iterable[R], waiting: Iterable[R] | None = None) -> None:
        """Running: running (new ones added), the rest held; given ``waiting``, those
        entered and any request in neither list discarded.  O(running + waiting) when
        something changed."""
        if not isinstance(running, Sequence):
            running = list(running)
        ids = self._reconcile_running(running)
        if waiting is None:
            return
        queue, view, tracked = self.queue, self.view, self._record.tracked
        running_ids, waiting_ids = set(ids), set()
        for request in waiting:
            request_id = view.request_id(request)
            waiting_ids.add(request_id)
            known = tracked.get(request_id)
            if known is None or known.prompt_tokens != view.prompt_tokens(request) or \
                    queue.state(request_id) is not QueueState.WAITING:
                self.enter_waiting(request)
        if len(self._record.tracked) > len(running_ids) + len(waiting_ids):
            for request_id in [r for r in self._record.tracked
                               if r not in running_ids and r not in waiting_ids]:
                self.discard(request_id)

    def _reconcile_running(self, running: Sequence[R]) -> list[RequestId]:
        """``reconcile``'s running half; returns ``running``'s request ids, in order.
        Nothing to do for the mirror's list (``order.Mirror``)."""
        mirror = self._order.current()
        if mirror is not None and len(running) == len(mirror.requests) and \
                all(map(is_, running, mirror.requests)):
            return mirror.ids
        queue = self.queue
        ids = list(map(self.view.request_id, running))
        running_ids = set(ids)
        if not queue.runs_exactly(running_ids):
            for request in running:
                request_id = self._record.refresh(request)
                state = queue.state(request_id)
                if state is QueueState.WAITING:
                    queue.admit(request_id)
                elif state is QueueState.HELD:
                    queue.run(request_id)
            for request_id in [r for r in queue.running_ids() if r not in running_ids]:
                self.hold(request_id)
        self._order.reconciled(running, ids)
        return ids

    def resync(self, running: Sequence[R], waiting: Iterable[R],
               held: Iterable[R] = ()) -> None:
        """Rebuild Feather's picture from the engine's after a fault (``Recovery.
        resync``); a request Feather knew that is in none is counted out once.  Clears
        ``faults.dirty``."""
        gone = self._recovery.resync(running, waiting, held)
        self.faults.dirty = False
        self._record.count_left(gone)

    def drop(self) -> None:
        """Empty Feather's picture after a fault (``FaultGuard.reset``, ``Recovery.
        drop``).  O(tracked)."""
        self._recovery.drop()

    def group(self, request: R) -> Hashable:
        """The request's prefix group (``prefix.group_of`` over its chunk keys)."""
        return self._order.group(request)

    def close(self) -> None:
        """Save the meter's files once more (engine shutdown)."""
        self.meter.close()

    def _count_states(self) -> SchedulerStats:
        """Bring the waiting and running counts in the stats up to date; O(1)."""
        stats = self.meter.stats
        stats.waiting, stats.running = len(self.queue), self.queue.num_running
        return stats
