"""``PassLedger``: the admissions of the pass in progress, and the steps waiting for reward.

Each fresh answer of a pass (``take``) is counted as asked once; ``admitted`` marks the
ADD the engine acted on (fair share charges its tenant), ``void`` takes it back with the
charge refunded when the engine holds the request instead.  At the pass's end
(``settle``) an ADD counts only when its request runs, a STOP with the step it shaped;
the decisions that held are bound to the step (``close``) until its reward
(``reward``).  Bounded: ``MAX_OPEN_STEPS`` steps of ``MAX_STEP_DECISIONS`` decisions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from feather_sched.core.queue import Admission, FeatherQueue
from feather_sched.core.view import RequestId
from feather_sched.gates.base import Decision, GateContext
from feather_sched.telemetry.prometheus import PrometheusSink
from feather_sched.telemetry.stats import AdmissionCounts, SchedulerStats

MAX_OPEN_STEPS = 64
"""Steps formed but not yet reported; older ones are dropped unrewarded (an engine that
never reports a step, e.g. an empty one, cannot grow this without bound)."""
MAX_STEP_DECISIONS = 4096
"""Decisions kept for one step; several passes may wait for one step (an engine that
never decodes, e.g. prefill-only serving, must not grow a list without bound)."""

Credit = list[tuple[GateContext, Decision]]
"""Decisions that took effect, as the gate is shown them (``Gate.reward``)."""


@dataclass
class Taken:
    """A fresh answer of this pass, and whether its request was admitted."""

    admission: Admission
    admitted: bool = False
    charged: float = 0.0
    """What the admission charged its tenant under fair share (``TenantShare.admitted``),
    refunded if the engine does not run the request after all."""


@dataclass
class Settled:
    """What a pass's answers came to (``PassLedger.settle``)."""

    asked: int
    admitted: list[RequestId]
    stops: int
    forced: int
    credit: Credit


class PassLedger:
    """This pass's answers (``taken``), the admission counts, and the open steps."""

    def __init__(self, queue: FeatherQueue) -> None:
        self.queue = queue
        self.counts = AdmissionCounts()
        self.taken: list[Taken] = []
        self._open_steps: OrderedDict[Hashable, Credit] = OrderedDict()

    def take(self, admission: Admission) -> None:
        """The queue answered ``admission``: counted as asked if it is fresh (not the
        last answer again, cached)."""
        if not self.taken or self.taken[-1].admission is not admission:
            self.counts.asked += 1
            self.taken.append(Taken(admission))

    def last_add(self, request_id: RequestId) -> Taken:
        """The last answer, which must be an ADD of ``request_id`` not yet admitted
        (RuntimeError otherwise): the engine admits the request."""
        last = self.taken[-1] if self.taken else None
        if last is None or last.admission.request_id != request_id or \
                last.admission.decision is not Decision.ADD or last.admitted:
            raise RuntimeError(f"admit({request_id!r}) without an ADD decision for it")
        return last

    def admitted(self, taken: Taken, prompt_tokens: int) -> None:
        """``taken`` (``last_add``) was admitted: under fair share its tenant is charged
        ``prompt_tokens`` (``TenantShare.admitted``)."""
        taken.admitted = True
        share = self.queue.share
        if share is not None:
            taken.charged = share.admitted(self.queue.tenant(taken.admission.request_id),
                                           prompt_tokens)

    def void(self, request_id: RequestId) -> None:
        """The engine held ``request_id`` instead of running it: an admission of it in
        this pass is void, its charge refunded (``TenantShare.refund``)."""
        share = self.queue.share
        for taken in self.taken:
            if taken.admission.request_id == request_id and taken.admitted:
                taken.admitted = False
                if share is not None:
                    share.refund(self.queue.tenant(request_id), taken.charged)

    def settle(self, is_running: Callable[[RequestId], bool]) -> Settled:
        """The pass ends: the ADDs whose request ``is_running`` and the gate's STOPs are
        counted; the decisions that held are the credit."""
        credit: Credit = []
        admitted: list[RequestId] = []
        stops = forced = 0
        for taken in self.taken:
            admission = taken.admission
            if admission.decision is Decision.STOP:
                if admission.context is not None:  # the gate's STOP, not its echo
                    stops += 1
                    credit.append((admission.context, Decision.STOP))
            elif taken.admitted and is_running(admission.request_id):
                admitted.append(admission.request_id)
                forced += admission.forced
                if admission.context is not None:
                    credit.append((admission.context, Decision.ADD))
        counts = self.counts
        counts.stop, counts.forced, counts.add = (counts.stop + stops, counts.forced + forced,
                                                  counts.add + len(admitted) - forced)
        return Settled(len(self.taken), admitted, stops, forced, credit)

    def report(self, sink: PrometheusSink, settled: Settled, now: float, groups: int,
               stats: SchedulerStats) -> None:
        """The pass's answers on the metrics ``sink`` (``pass_ended``), with the running
        prefix ``groups`` and the waiting and running counts of ``stats``."""
        queue = self.queue
        sink.pass_ended(
            asked=settled.asked, add=len(settled.admitted) - settled.forced,
            stop=settled.stops, forced=settled.forced,
            admitted=[(queue.tenant(r), now - queue.arrival_s(r)) for r in settled.admitted],
            groups=groups, waiting=stats.waiting, running=stats.running)

    def close(self, step: Hashable, credit: Credit) -> None:
        """The pass formed ``step``: its answers are forgotten, ``credit`` bound to it."""
        self.taken.clear()
        if credit:
            decisions = self._open_steps.setdefault(step, [])
            decisions.extend(credit)
            del decisions[:-MAX_STEP_DECISIONS]
            self._open_steps.move_to_end(step)
            while len(self._open_steps) > MAX_OPEN_STEPS:
                self._open_steps.popitem(last=False)

    def reward(self, step: Hashable) -> Credit | None:
        """The decisions bound to ``step``, now unbound (it ran)."""
        return self._open_steps.pop(step, None)

    def bound(self, step: Hashable) -> Credit:
        """The decisions bound to ``step`` so far (a copy)."""
        return list(self._open_steps.get(step, []))
