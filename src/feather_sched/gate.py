"""ADD/STOP gates: whether to admit the tree's best waiting request into this step's batch.

STOP ends admission for the current step so the running batch stays prefix-homogeneous;
running requests are never evicted.  Four policies:

* ``AlwaysAddGate`` - what vLLM and SGLang do today: fill the batch while resources last.
* ``ChunkLossGate`` - the hand-tuned gate of the authors' vLLM pull request: admit while
  the candidate costs at most a few chunks of shared prefix, otherwise only while the
  batch is below a floor that rises the longer the gate keeps holding requests back.
* ``UCBBanditGate`` - the paper's tabular contextual bandit with UCB1 exploration,
  rewarded with each step's throughput; its table can be saved and loaded (warm start).
* ``ModelGate`` (``model_gate``) - compares the throughput a step-time model fitted
  online predicts with and without the candidate.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

from feather_sched.files import read_json, replace_atomically
from feather_sched.steplog import BatchEntry

# Paper defaults for the bandit (see the module docstring of UCBBanditGate).
BATCH_BIN = 4
BATCH_BINS = 16
LOSS_CLAMP = 5
WAITERS_BIN = 4
WAITERS_BINS = 16
EXPLORATION = 200.0


class Decision(Enum):
    ADD = "add"
    STOP = "stop"


@dataclass(frozen=True)
class GateContext:
    """What the gate sees about one admission: the batch and the candidate's effect."""

    batch_size: int
    """Requests already running (before the candidate)."""
    chunk_loss: int
    """Chunks of prefix shared by the whole batch that admitting the candidate gives up."""
    sharing_waiters: int
    """Other waiting requests that share the batch's prefix once the candidate joins."""
    num_waiting: int
    """Waiting requests, candidate included."""
    candidate_group: Hashable = None
    """The candidate's prefix group (``prefix.group_of``)."""
    candidate_tokens: int = 0
    """The candidate's prompt tokens."""
    candidate_prefix_tokens: int = 0
    """Tokens of its prompt that another request, running or waiting, also holds."""
    group_waiters: int = 0
    """Other waiting requests of the candidate's prefix group (``sharing_waiters`` counts
    those sharing the batch's prefix once it joins: every waiter, for a new group)."""
    free_seats: int | None = None
    """Requests the engine could still run beside the batch (its cap on running requests
    less those running); None where the adapter does not know the cap."""
    stops_left: int | None = None
    """STOPs the fairness bound allows before a waiting request is admitted over the
    gate (``fairness.OvertakeBound.stops_left``); None without a stop limit."""


Decisions = Sequence[tuple[GateContext, Decision]]
"""The gate's decisions that formed one executed batch, in the order they were taken."""


class Gate(Protocol):
    """An ADD/STOP policy.

    ``decide`` answers for one candidate; ``reward`` hands back the decisions that formed
    an executed batch with that batch's size and measured time (the caller keys steps,
    so a reward reaches exactly the decisions it measures); ``observe`` shows every
    executed step's batch, in execution order, with its time, to a gate whose
    ``observes`` is true (engines describe their batches only for such gates, or for the
    step log); ``end_step`` closes a scheduling pass.
    """

    observes: bool
    always_adds: bool
    """Whether ``decide`` answers ADD whatever the context: the queue then asks nothing
    and builds no context (an ADD not shown to the gate is not rewarded either)."""
    stops_in_ordered_batches: bool
    """Whether the gate may STOP a candidate while Feather lays the batch out. Where it
    may, the queue keeps the tree's candidate even while everything fits (a STOP on an
    older stranger would hold back the running groups' siblings the gate admits);
    a gate that does not say is taken to STOP."""

    def decide(self, context: GateContext) -> Decision: ...

    def reward(self, decisions: Decisions, batch_size: int, seconds: float) -> None: ...

    def observe(self, batch: Sequence[BatchEntry], seconds: float) -> None: ...

    def end_step(self) -> None: ...


def must_add(context: GateContext) -> bool:
    """Admissions no gate may refuse: an empty batch, or a candidate that loses nothing."""
    return context.batch_size == 0 or context.chunk_loss <= 0


class _Unobservant:
    """A gate that learns nothing from the batches it is shown."""

    observes = False

    def observe(self, batch: Sequence[BatchEntry], seconds: float) -> None:
        """Batch composition is not part of this gate's decision."""


class AlwaysAddGate(_Unobservant):
    """Admit whenever the engine has room: today's engines' behaviour."""

    always_adds = True
    stops_in_ordered_batches = False

    def decide(self, context: GateContext) -> Decision:
        return Decision.ADD

    def reward(self, decisions: Decisions, batch_size: int, seconds: float) -> None:
        """Nothing to learn."""

    def end_step(self) -> None:
        """No per-step state."""


@dataclass
class ChunkLossGate(_Unobservant):
    """The upstream pull request's heuristic gate.

    ADD when the candidate loses at most ``max_loss`` chunks of shared prefix
    (``max_loss_loaded`` once ``load_waiting`` or more requests wait).  Otherwise ADD only
    while the batch is smaller than a floor that starts at ``floor_start`` and rises by
    ``floor_step`` for every step in a row in which the gate said STOP, up to
    ``floor_max``; a step without STOP resets it.  The rising floor keeps a long
    heterogeneous queue from starving behind a small homogeneous batch.
    """

    always_adds = False
    stops_in_ordered_batches = True  # it judges chunk loss, whatever the layout
    max_loss: int = 5
    max_loss_loaded: int = 7
    load_waiting: int = 256
    floor_start: int = 4
    floor_step: int = 1
    floor_max: int = 256
    _stopped_steps: int = field(default=0, init=False)
    _stopped_now: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        _check_non_negative(
            max_loss=self.max_loss,
            max_loss_loaded=self.max_loss_loaded,
            load_waiting=self.load_waiting,
            floor_start=self.floor_start,
            floor_step=self.floor_step,
        )
        if self.floor_max < self.floor_start:
            raise ValueError("floor_max must be at least floor_start")

    @property
    def floor(self) -> int:
        return min(self.floor_max, self.floor_start + self.floor_step * self._stopped_steps)

    def decide(self, context: GateContext) -> Decision:
        if must_add(context):
            return Decision.ADD
        loaded = context.num_waiting >= self.load_waiting
        limit = self.max_loss_loaded if loaded else self.max_loss
        if context.chunk_loss <= limit or context.batch_size < self.floor:
            return Decision.ADD
        self._stopped_now = True
        return Decision.STOP

    def reward(self, decisions: Decisions, batch_size: int, seconds: float) -> None:
        """The heuristic does not learn."""

    def end_step(self) -> None:
        self._stopped_steps = self._stopped_steps + 1 if self._stopped_now else 0
        self._stopped_now = False


Context = tuple[int, int, int]


@dataclass
class _Arm:
    pulls: int = 0
    total: float = 0.0

    @property
    def mean(self) -> float:
        return self.total / self.pulls


@dataclass
class UCBBanditGate(_Unobservant):
    """The paper's contextual bandit: one UCB1 learner per discretised context.

    Context = (batch size // ``batch_bin`` capped at ``batch_bins - 1``, chunk loss
    clamped to [-``loss_clamp``, ``loss_clamp``], sharing waiters // ``waiters_bin``
    capped at ``waiters_bins - 1``).  In each context an untried action is tried first,
    then the action maximising ``mean + exploration * sqrt(ln n / pulls)``; equal scores
    are broken by a seeded RNG so runs are reproducible.  The reward of an engine step is
    batch size / step seconds and goes to every decision taken while forming that batch.
    Admissions that lose no prefix, or fill an empty batch, are always ADD and not learned.
    """

    always_adds = False
    stops_in_ordered_batches = True  # it learns STOPs from chunk loss, whatever the layout

    exploration: float = EXPLORATION
    batch_bin: int = BATCH_BIN
    batch_bins: int = BATCH_BINS
    loss_clamp: int = LOSS_CLAMP
    waiters_bin: int = WAITERS_BIN
    waiters_bins: int = WAITERS_BINS
    seed: int | None = 0
    table: dict[Context, dict[Decision, _Arm]] = field(default_factory=dict)
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.exploration < 0:
            raise ValueError("exploration must be non-negative")
        _check_positive(
            batch_bin=self.batch_bin,
            batch_bins=self.batch_bins,
            loss_clamp=self.loss_clamp,
            waiters_bin=self.waiters_bin,
            waiters_bins=self.waiters_bins,
        )
        self._rng = random.Random(self.seed)

    def context_of(self, context: GateContext) -> Context:
        return (
            min(context.batch_size // self.batch_bin, self.batch_bins - 1),
            max(-self.loss_clamp, min(self.loss_clamp, context.chunk_loss)),
            min(context.sharing_waiters // self.waiters_bin, self.waiters_bins - 1),
        )

    def decide(self, context: GateContext) -> Decision:
        if must_add(context):
            return Decision.ADD
        arms = self.table.setdefault(self.context_of(context), {d: _Arm() for d in Decision})
        return self._choose(arms)

    def _choose(self, arms: dict[Decision, _Arm]) -> Decision:
        untried = [d for d, arm in arms.items() if arm.pulls == 0]
        if untried:
            return self._rng.choice(untried)
        log_total = math.log(sum(arm.pulls for arm in arms.values()))
        scores = {
            d: arm.mean + self.exploration * math.sqrt(log_total / arm.pulls)
            for d, arm in arms.items()
        }
        best = max(scores.values())
        return self._rng.choice([d for d, s in scores.items() if s == best])

    def reward(self, decisions: Decisions, batch_size: int, seconds: float) -> None:
        """Credit ``batch_size / seconds`` to each learned decision that formed the batch."""
        if not seconds > 0:
            raise ValueError(f"step time must be positive, got {seconds}")
        value = batch_size / seconds
        for context, decision in decisions:
            if must_add(context):
                continue
            arms = self.table.setdefault(self.context_of(context), {d: _Arm() for d in Decision})
            arm = arms[decision]
            arm.pulls += 1
            arm.total += value

    def end_step(self) -> None:
        """Decisions wait for their batch's reward; nothing to do here."""

    def greedy(self, context: GateContext) -> Decision:
        """The learned best action, without exploring (for inspection and reports)."""
        if must_add(context):
            return Decision.ADD
        arms = self.table.get(self.context_of(context))
        if not arms or any(arm.pulls == 0 for arm in arms.values()):
            return Decision.ADD
        return max(arms, key=lambda d: arms[d].mean)

    # ---- warm start -------------------------------------------------------------------

    @property
    def learned_decisions(self) -> int:
        """Rewarded decisions in the table."""
        return sum(arm.pulls for arms in self.table.values() for arm in arms.values())

    def save(self, path: str | Path) -> None:
        """Write the learned table (and the binning it was learned with) as JSON, replacing
        ``path`` atomically (a write cut short leaves the previous table)."""
        rows = [
            {"context": list(key), "action": d.value, "pulls": arm.pulls, "total": arm.total}
            for key, arms in sorted(self.table.items())
            for d, arm in arms.items()
            if arm.pulls
        ]
        replace_atomically(path, json.dumps({"format": "feather-bandit", "version": 1,
                                             "binning": self._binning(), "table": rows}))

    def load(self, path: str | Path) -> None:
        """Replace the table with one saved by ``save``, every value checked: format and
        version, the binning (this gate's), each row's context (three integers within the
        binning), action, pulls (a positive integer) and total (a finite non-negative
        number), no row twice.  ValueError naming the file and the field (OSError if it
        cannot be read); the table is then unchanged.  O(rows)."""
        data = read_json(path)
        try:
            self.table = self._table_of(data)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    def _table_of(self, data: object) -> dict[Context, dict[Decision, _Arm]]:
        if not isinstance(data, dict) or data.get("format") != "feather-bandit":
            raise ValueError("not a feather bandit table (no \"format\": \"feather-bandit\")")
        _known_fields(data, ("format", "version", "binning", "table"))
        if type(data.get("version")) is not int or data["version"] != 1:
            raise ValueError(f"\"version\": this gate reads version 1, got "
                             f"{data.get('version')!r}")
        if data.get("binning") != self._binning():
            raise ValueError(f"\"binning\": the table was learned with {data.get('binning')!r}, "
                             f"this gate uses {self._binning()}")
        rows = data.get("table")
        if not isinstance(rows, list):
            raise ValueError("\"table\": missing or not a list")
        table: dict[Context, dict[Decision, _Arm]] = {}
        for index, row in enumerate(rows):
            try:
                key, decision, arm = self._row(row)
            except ValueError as error:
                raise ValueError(f"row {index} of \"table\" is malformed: {error}") from None
            arms = table.setdefault(key, {d: _Arm() for d in Decision})
            if arms[decision].pulls:
                raise ValueError(f"row {index} of \"table\" repeats context {list(key)} "
                                 f"action {decision.value!r}")
            arms[decision] = arm
        return table

    def _row(self, row: object) -> tuple[Context, Decision, _Arm]:
        if not isinstance(row, dict):
            raise ValueError("not an object")
        _known_fields(row, ("context", "action", "pulls", "total"), required=True)
        bounds = ((0, self.batch_bins - 1), (-self.loss_clamp, self.loss_clamp),
                  (0, self.waiters_bins - 1))
        key = row["context"]
        if not isinstance(key, list) or len(key) != 3 or any(
                type(x) is not int or not low <= x <= high
                for x, (low, high) in zip(key, bounds, strict=True)):
            raise ValueError(f"\"context\" must be three integers within "
                             f"{[list(b) for b in bounds]}, got {key!r}")
        if row["action"] not in [d.value for d in Decision]:
            raise ValueError(f"\"action\" must be \"add\" or \"stop\", got {row['action']!r}")
        pulls, total = row["pulls"], row["total"]
        if type(pulls) is not int or pulls < 1:
            raise ValueError(f"\"pulls\" must be a positive integer, got {pulls!r}")
        if type(total) not in (int, float) or not math.isfinite(total) or total < 0:
            raise ValueError(f"\"total\" must be a finite non-negative number, got {total!r}")
        return (key[0], key[1], key[2]), Decision(row["action"]), _Arm(pulls, float(total))

    def _binning(self) -> dict[str, int]:
        return {
            "batch_bin": self.batch_bin,
            "batch_bins": self.batch_bins,
            "loss_clamp": self.loss_clamp,
            "waiters_bin": self.waiters_bin,
            "waiters_bins": self.waiters_bins,
        }


GATE_KINDS = ("always", "chunk-loss", "bandit", "model")


def make_gate(kind: str, **options: object) -> Gate:
    """Build a gate by name (``always``, ``chunk-loss``, ``bandit``, ``model``) from
    keyword options."""
    if kind == "always":
        if options:
            raise ValueError(f"gate 'always' takes no options, got {sorted(options)}")
        return AlwaysAddGate()
    if kind == "chunk-loss":
        return _build(ChunkLossGate, kind, options)
    if kind == "bandit":
        return _build(UCBBanditGate, kind, options)
    if kind == "model":
        from feather_sched.model_gate import ModelGate  # it builds on this module

        return _build(ModelGate.with_prior, kind, options)
    raise ValueError(f"unknown gate kind {kind!r}; choose one of {', '.join(GATE_KINDS)}")


def _build(cls: Callable[..., Gate], kind: str, options: dict) -> Gate:
    try:
        return cls(**options)
    except TypeError as error:
        raise ValueError(f"bad option for gate {kind!r}: {error}") from None


def _known_fields(data: dict, known: Sequence[str], *, required: bool = False) -> None:
    """ValueError naming the fields of ``data`` not in ``known`` (or, if ``required``,
    missing from it)."""
    unknown = sorted(str(name) for name in data if name not in known)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}")
    missing = [name for name in known if name not in data] if required else []
    if missing:
        raise ValueError(f"missing field(s) {missing}")


def _check_non_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be non-negative, got {value}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
