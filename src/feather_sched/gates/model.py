"""ModelGate: ADD or STOP by what a step-time model, fitted online, says the candidate costs.

In Feather's batch layout it admits every candidate.  In the engine's layout it prices
the candidate and up to ``lookahead`` siblings that would follow it, in extra seconds per
request per step, two ways: spread over the batch as the engine places newcomers
(*now*), and as one contiguous run (*homogeneous*).  ADD when *now* is within ``1 +
margin`` of *homogeneous*, or within the batch's average cost per request, or when a STOP
would keep seats nobody fills (``_seats_would_idle``); else STOP.  It never refuses an
empty batch, and leaves untaken the STOP that would bring a waiting request to the
fairness bound.  The model (``step_model.OnlineStepModel``) learns from executed steps,
starting from a prior (``StepPrior.for_engine`` by default).  The rule in full, and why
its parameters are what they are: docs/gates.md.

Costs: two O(batch) batch summaries per judged candidate; O(batch) per observed step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from feather_sched.gates.base import BatchLayout, Decision, Decisions, GateContext, must_add
from feather_sched.gates.step_model import AUTO, OnlineStepModel, StepPrior
from feather_sched.telemetry.steplog import BatchEntry

DEFAULT_PRIOR = AUTO
DEFAULT_LOOKAHEAD = 16
DEFAULT_MARGIN = 0.05
DEFAULT_WINDOW = 2
LEARN_EVERY = 8


class ModelGate:
    """ADD/STOP by predicted per-request step cost, now vs in a homogeneous batch."""

    stops_in_ordered_batches = False
    """It prices the batch as laid out, where a group that joins its own run costs what
    it would alone, so with ordering on it admits (``benchmarks/gate``)."""

    def __init__(self, model: OnlineStepModel, *, layout: BatchLayout = BatchLayout.FEATHER,
                 lookahead: int = DEFAULT_LOOKAHEAD, margin: float = DEFAULT_MARGIN,
                 window: int = DEFAULT_WINDOW) -> None:
        if lookahead < 0 or margin < 0 or window < 0:
            raise ValueError("lookahead, margin and window must be non-negative")
        self.model = model
        self.layout = layout
        """How the engine lays the batch out (``use_layout``)."""
        self.lookahead = lookahead
        self.margin = margin
        self.window = window
        self._batch: list[BatchEntry] = []
        """The last executed step as a decode step, plus this pass's admissions."""
        self._groups: set = set()
        """The groups in ``_batch``."""
        self._base_s: float | None = None
        """Predicted seconds of ``_batch`` (None: not predicted since it changed)."""
        self._steps = 0
        """Executed steps observed."""
        self._prefilled_at: dict = {}
        """Per group of ``_groups``, the last observed step in which one of its requests was
        in prefill (or the next, for a group this pass admitted)."""

    @classmethod
    def with_prior(cls, prior: StepPrior | str | None = DEFAULT_PRIOR, *,
                   layout: BatchLayout = BatchLayout.FEATHER,
                   lookahead: int = DEFAULT_LOOKAHEAD,
                   margin: float = DEFAULT_MARGIN, window: int = DEFAULT_WINDOW,
                   prior_steps: float = 8.0, forgetting: float = 0.995) -> ModelGate:
        """The gate from options: ``prior`` is a ``StepPrior``, None, or a name
        (``StepPrior.named``: ``auto``, the engine's profile where the runtime knows the
        engine, else none; ``none``; ``<hardware>/<model>``; a calibrated profile)."""
        if isinstance(prior, str):
            prior = StepPrior.named(prior)
        model = OnlineStepModel(prior, prior_steps=prior_steps, forgetting=forgetting)
        return cls(model, layout=layout, lookahead=lookahead, margin=margin, window=window)

    @property
    def always_adds(self) -> bool:
        """With the batch laid out in Feather's order (``BatchLayout.FEATHER``) it admits
        every candidate: a group that joins its own run costs what it would alone."""
        return self.layout is BatchLayout.FEATHER

    def use_layout(self, layout: BatchLayout) -> None:
        """Price the engine's layout from now on (the runtime says so once it knows)."""
        self.layout = layout

    def decide(self, context: GateContext) -> Decision:
        if self.always_adds:
            return Decision.ADD
        if self._joins_batch(context) or not self.model.ready or self._last_stop(context):
            self._join(context)
            return Decision.ADD
        group = self._group_entries(context, 1 + min(context.sharing_waiters, self.lookahead))
        now = self._extra_s(_spread(self._batch, group)) / len(group)
        homogeneous = self._extra_s(self._beside_group(group)) / len(group)
        average = self._base_s / len(self._batch)
        if now <= (1 + self.margin) * homogeneous or now <= average or \
                self._seats_would_idle(context):
            self._join(context)
            return Decision.ADD
        return Decision.STOP

    def _joins_batch(self, context: GateContext) -> bool:
        """Whether the candidate is admitted without being judged.

        With its size known (``candidate_tokens`` > 0): into an empty batch (``batch_size``
        0, or none described yet: no step observed and nothing admitted this pass), or of a
        group the batch already runs (it splits nothing the batch does not split already).
        Without it (``candidate_tokens`` 0: a context with the base fields only, or an
        empty prompt) the gate cannot place the candidate and falls back to ``must_add``:
        an empty batch, or a candidate that loses no chunk.  O(1).
        """
        if not context.candidate_tokens:
            return must_add(context)
        return context.batch_size == 0 or not self._batch or context.candidate_group in self._groups

    def _seats_would_idle(self, context: GateContext) -> bool:
        """Whether a STOP would keep seats nobody fills: the running groups have stopped
        growing and the candidate's group fits in the free seats (docs/gates.md).  O(groups)."""
        if context.free_seats is None or context.free_seats < 1 + context.group_waiters:
            return False
        before = self._steps - self.window
        return all(self._prefilled_at.get(group, before) <= before for group in self._groups)

    @staticmethod
    def _last_stop(context: GateContext) -> bool:
        """Whether a STOP would bring a waiting request to the fairness bound, which then
        admits in arrival order; the gate leaves that STOP untaken."""
        return context.stops_left is not None and context.stops_left <= 1

    @property
    def observes(self) -> bool:
        """Whether it learns from executed steps: only when it predicts (the engine's
        layout)."""
        return self.layout is BatchLayout.ENGINE

    def reward(self, decisions: Decisions, batch_size: int, seconds: float) -> None:
        """Learning comes from ``observe``: every step, whatever decisions formed it."""

    def observe(self, batch: Sequence[BatchEntry], seconds: float) -> None:
        """Take the executed step as the next pass's batch, and learn from it when its
        batch changed (size or a prefill) or on every ``LEARN_EVERY``-th step (why:
        docs/gates.md).  Nothing while the gate does not predict (``observes``).  O(batch)
        plus ``OnlineStepModel.observe`` when it learns."""
        if not self.observes:
            return  # nothing to predict (see ``decide``)
        self._steps += 1
        prefilled = {entry.group for entry in batch if entry.new_tokens > 1}
        if prefilled or len(batch) != len(self._batch) or self._steps % LEARN_EVERY == 0:
            self.model.observe(batch, seconds)
        self._batch = [entry if entry.new_tokens == 1 else replace(entry, new_tokens=1)
                       for entry in batch]
        self._groups = {entry.group for entry in batch}
        self._prefilled_at = {group: at for group, at in self._prefilled_at.items()
                              if group in self._groups}  # only the batch's groups are asked
        self._prefilled_at.update(dict.fromkeys(prefilled, self._steps))
        self._base_s = None

    def end_step(self) -> None:
        """A new pass starts from the last executed batch (``observe``)."""

    # ---- prediction -------------------------------------------------------------------

    def _extra_s(self, batch: list[BatchEntry]) -> float:
        if self._base_s is None:
            self._base_s = self.model.predict(self._batch)
        return max(self.model.predict(batch) - self._base_s, 0.0)

    def _group_entries(self, context: GateContext, count: int) -> list[BatchEntry]:
        """The candidate and the siblings that would follow it, as decode entries."""
        shares = context.candidate_group in self._groups or count > 1
        shared = min(context.candidate_prefix_tokens, context.candidate_tokens) if shares else 0
        entry = BatchEntry(group=context.candidate_group, shared_tokens=shared,
                           context_tokens=context.candidate_tokens, new_tokens=1)
        return [entry] * count

    def _beside_group(self, group: list[BatchEntry]) -> list[BatchEntry]:
        """The batch with ``group`` right after the last member of its group (else last)."""
        batch = self._batch
        key = group[0].group
        at = next((i + 1 for i in range(len(batch) - 1, -1, -1) if batch[i].group == key),
                  len(batch))
        return batch[:at] + group + batch[at:]

    def _join(self, context: GateContext) -> None:
        """An ADD: the candidate is part of this pass's batch from now on (its group
        grows now)."""
        if context.candidate_tokens:
            self._batch = _spread(self._batch, self._group_entries(context, 1))
            self._groups.add(context.candidate_group)
            self._prefilled_at[context.candidate_group] = self._steps + 1
            self._base_s = None


def _spread(batch: list[BatchEntry], group: list[BatchEntry]) -> list[BatchEntry]:
    """``group`` inserted at evenly spaced places of ``batch`` (holes of a persistent
    batch, where newcomers land)."""
    placed = list(batch)
    step = (len(batch) + 1) / (len(group) + 1)
    for index, entry in enumerate(group):
        placed.insert(round(step * (index + 1)) + index, entry)
    return placed
