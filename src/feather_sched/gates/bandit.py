"""``UCBBanditGate``: the paper's tabular contextual bandit with UCB1 exploration, rewarded
with each step's throughput; its table can be saved and loaded (warm start)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from feather_sched.gates.base import Decision, Decisions, GateContext, Unobservant, must_add
from feather_sched.telemetry.files import read_json, replace_atomically

# Paper defaults for the bandit (see the module docstring of UCBBanditGate).
BATCH_BIN = 4
BATCH_BINS = 16
LOSS_CLAMP = 5
WAITERS_BIN = 4
WAITERS_BINS = 16
EXPLORATION = 200.0

Context = tuple[int, int, int]


@dataclass
class _Arm:
    pulls: int = 0
    total: float = 0.0

    @property
    def mean(self) -> float:
        return self.total / self.pulls


@dataclass
class UCBBanditGate(Unobservant):
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



def _known_fields(data: dict, known: Sequence[str], *, required: bool = False) -> None:
    """ValueError naming the fields of ``data`` not in ``known`` (or, if ``required``,
    missing from it)."""
    unknown = sorted(str(name) for name in data if name not in known)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}")
    missing = [name for name in known if name not in data] if required else []
    if missing:
        raise ValueError(f"missing field(s) {missing}")



def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
