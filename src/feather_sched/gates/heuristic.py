"""The fixed gates: ``AlwaysAddGate`` (what vLLM and SGLang do today: fill the batch while
resources last) and ``ChunkLossGate`` (the hand-tuned gate of the authors' vLLM pull
request: admit while the candidate costs at most a few chunks of shared prefix)."""

from __future__ import annotations

from dataclasses import dataclass, field

from feather_sched.gates.base import Decision, Decisions, GateContext, Unobservant, must_add


class AlwaysAddGate(Unobservant):
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
class ChunkLossGate(Unobservant):
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



def _check_non_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be non-negative, got {value}")

