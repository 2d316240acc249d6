"""ADD/STOP gates: whether to admit the tree's best waiting request into this step's batch.

STOP ends admission for the current step so the running batch stays prefix-homogeneous;
running requests are never evicted.  Layered bottom up, with no cycle:

* ``base`` - the protocol every gate implements (``Gate``, ``Decision``, ``GateContext``,
  ``must_add``);
* ``heuristic`` - ``AlwaysAddGate`` (today's engines: fill the batch while resources
  last) and ``ChunkLossGate`` (the authors' hand-tuned gate);
* ``bandit`` - ``UCBBanditGate``, the paper's UCB1 contextual bandit (warm-startable);
* ``step_model`` - the step-time model fitted online, and ``model`` - ``ModelGate``, which
  compares the throughput it predicts with and without the candidate;
* this package - the registry: ``GATE_KINDS`` and ``make_gate``.

Imports ``costmodel`` and ``telemetry``; never the core, an engine, the simulator or the
benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable

from feather_sched.gates.bandit import UCBBanditGate
from feather_sched.gates.base import Gate
from feather_sched.gates.heuristic import AlwaysAddGate, ChunkLossGate
from feather_sched.gates.model import ModelGate

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
        return _build(ModelGate.with_prior, kind, options)
    raise ValueError(f"unknown gate kind {kind!r}; choose one of {', '.join(GATE_KINDS)}")


def _build(cls: Callable[..., Gate], kind: str, options: dict) -> Gate:
    try:
        return cls(**options)
    except TypeError as error:
        raise ValueError(f"bad option for gate {kind!r}: {error}") from None

