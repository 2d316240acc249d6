"""The gate protocol: what every ADD/STOP gate answers, sees and learns from.

A gate decides whether to admit the tree's best waiting request into this step's batch
(ADD) or to end admission for the step (STOP) so the running batch stays
prefix-homogeneous; running requests are never evicted.  This module holds the types
every gate and its callers share (``Decision``, ``GateContext``, ``Gate``, ``must_add``)
and imports no gate; the gates build on it and the registry (``feather_sched.gates``)
sits on top.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol, runtime_checkable

from feather_sched.telemetry.steplog import BatchEntry


class Decision(Enum):
    ADD = "add"
    STOP = "stop"


class BatchLayout(Enum):
    """How the engine lays out each step's batch: the one name for this fact.

    ``FEATHER``: each prefix group one contiguous run, in Feather's running order (the
    ``order_running`` option on, where the adapter can apply it); ``ENGINE``: the engine's
    own order (the option off, or an engine where ordering cannot act), in which the
    admission order is what puts a group's members side by side.  The runtime owns it
    and tells the queue and the gate (``Gate.use_layout``).
    """

    FEATHER = "feather"
    ENGINE = "engine"


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
    so a reward reaches exactly the decisions it measures); ``observe`` shows each
    executed step's batch, in execution order, with its time, whenever the engine
    described it (for a gate whose ``observes`` is true, or for the step log: a gate that
    learns nothing from batches ignores it); ``end_step`` closes a scheduling pass;
    ``use_layout`` says how the engine lays the batch out, before the first decision and
    whenever it changes.
    """

    observes: bool
    """Whether it learns from ``observe``: engines describe their batches for it then."""
    always_adds: bool
    """Whether ``decide`` answers ADD whatever the context: the queue then asks nothing
    and builds no context (an ADD not shown to the gate is not rewarded either)."""
    stops_in_ordered_batches: bool
    """Whether the gate may STOP a candidate while the batch is laid out in Feather's
    order (``BatchLayout.FEATHER``).  Where it may, the queue keeps the tree's candidate
    even while everything fits (a STOP on an older stranger would hold back the running
    groups' siblings the gate admits)."""

    def decide(self, context: GateContext) -> Decision: ...

    def reward(self, decisions: Decisions, batch_size: int, seconds: float) -> None: ...

    def observe(self, batch: Sequence[BatchEntry], seconds: float) -> None: ...

    def end_step(self) -> None: ...

    def use_layout(self, layout: BatchLayout) -> None: ...


@runtime_checkable
class Persistent(Protocol):
    """A gate whose learning outlives the engine: saved to the ``state_file`` as it goes,
    loaded from it (or the ``shared_state_file``) at start-up (the bandit's table)."""

    learned_decisions: int
    """Rewarded decisions it holds (logged when loaded)."""

    def save(self, path: str | Path) -> None: ...

    def load(self, path: str | Path) -> None: ...


def must_add(context: GateContext) -> bool:
    """Admissions no gate may refuse: an empty batch, or a candidate that loses nothing."""
    return context.batch_size == 0 or context.chunk_loss <= 0


class Unobservant:
    """A gate that learns nothing from the batches it is shown and decides alike in any
    layout."""

    observes = False

    def observe(self, batch: Sequence[BatchEntry], seconds: float) -> None:
        """Batch composition is not part of this gate's decision."""

    def use_layout(self, layout: BatchLayout) -> None:
        """The layout is not part of this gate's decision."""

