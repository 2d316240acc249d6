"""FeatherRuntime: the one admission contract that vLLM, SGLang and the simulator drive.

A thin composition of rooms behind one contract (``core.contract.RuntimeContract``): the
``FeatherQueue``, the ``Record`` of the requests the engine holds, the ``Order`` of its
lists, the ``PassLedger`` of this pass, ``Recovery`` after a fault, urgent preemption's
rule (``core.urgent``) and the ``StepMeter``.  Adapters never reach the rooms.  The
running set is never assumed from admissions: ``begin_pass`` and ``end_pass`` take what
the engine reports.  An exception in any call is contained by the adapter's ``faults``
(``FaultGuard``), and the next ``begin_pass`` rebuilds the picture from the engine's
queues.  The contract's loop: docs/architecture.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic

from feather_sched.core.config import FeatherConfig
from feather_sched.core.faults import FaultGuard
from feather_sched.core.ledger import PassLedger
from feather_sched.core.order import Order
from feather_sched.core.queue import Admission, QueueState
from feather_sched.core.record import Record
from feather_sched.core.recovery import Recovery
from feather_sched.core.tenants import DEFAULT_TENANT
from feather_sched.core.urgent import Room, fewest_victims
from feather_sched.core.view import R, RequestId, RequestView
from feather_sched.gates.base import BatchLayout, Persistent
from feather_sched.gates.step_model import EngineShape
from feather_sched.telemetry import prometheus as metrics
from feather_sched.telemetry.stats import SchedulerStats, StepMeter
from feather_sched.telemetry.steplog import BatchEntry


class FeatherRuntime(Generic[R]):
    """Feather's admission for one scheduler, behind ``core.contract.RuntimeContract``
    (each member's contract is there; each room's docstrings give the details)."""

    def __init__(self, config: FeatherConfig, view: RequestView[R], *,
                 clock: Callable[[], float] = time.monotonic, name: str = "feather",
                 seats: int | None = None, kv_tokens: int | None = None,
                 engine: EngineShape | None = None, chunk_tokens: int | None = None,
                 on_fault: Callable[[str], None] | None = None) -> None:
        """``seats``, ``kv_tokens``: the engine's cap on running requests and its KV cache
        in tokens, where known; ``engine``: its device and model (the model gate's prior);
        ``chunk_tokens``: the tokens of one of ``view``'s chunk keys, where the engine's
        blocks round the configured size; ``on_fault``: the adapter's fall-back."""
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
        """``Record.served``.  O(1)."""
        self._record.served(request_id, computed_tokens, generated_tokens)

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

    def now(self) -> float:
        """The time on Feather's clock. O(1)."""
        return self.clock()

    def preempted(self, request: R, *, urgent: bool = False) -> None:
        """Counted per request and class, with its group's running size; at
        ``max_preemptions`` it goes last of its group (``Order.spend``). O(running)."""
        request_id = self._record.refresh(request)
        preemptions = self._record.preempted(request_id)
        limit = self.config.max_preemptions
        if limit is not None and preemptions >= limit:
            self._order.spend(request_id)
        self.meter.preempted(preemptions, priority=self.queue.priority(request_id),
                             group_size=self._order.group_size(request, request_id),
                             urgent=urgent)

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

    def promise(self, request: R) -> bool:
        """``FeatherQueue.promise``; whether ``request`` itself was promised.  O(1)."""
        request_id = self.view.request_id(request)
        return self.queue.promise(request_id) == request_id

    def rank_waiting(self, waiting: Sequence[R]) -> list[R]:
        """``Order.rank_waiting``.  O(n log n)."""
        return self._order.rank_waiting(waiting)

    def describe_batch(self, rows: Iterable[tuple[R, int, int]]) -> list[BatchEntry]:
        """``Record.describe_batch``.  O(keys of the batch)."""
        return self._record.describe_batch(rows)

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
            self._ledger.report(self.meter.sink, settled, self.clock(),
                                len({self.group(r) for r in running}), stats)
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
        running_ids, waiting_ids = set(ids), set()
        for request in waiting:
            waiting_ids.add(self.view.request_id(request))
            if self._record.stale(request):
                self.enter_waiting(request)
        for request_id in self._record.unseen(running_ids, waiting_ids):
            self.discard(request_id)

    def _reconcile_running(self, running: Sequence[R]) -> list[RequestId]:
        """``reconcile``'s running half; returns ``running``'s request ids, in order.
        Nothing to do for the mirror's list (``order.Mirror``)."""
        ids = self._order.unchanged(running)
        if ids is not None:
            return ids
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
