"""The model gate: STOP where a candidate's group would split the batch's shared prefix
runs (ordering off), ADD where it costs what it would cost in a homogeneous batch."""

from __future__ import annotations

import pytest

from feather_sched.core.config import FeatherConfig
from feather_sched.costmodel.cost import CostModel
from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS
from feather_sched.gates import make_gate
from feather_sched.gates.base import BatchLayout, Decision, GateContext
from feather_sched.gates.model import ModelGate
from feather_sched.gates.step_model import StepPrior
from feather_sched.telemetry.steplog import BatchEntry

PREFIX = 10240
"""Fits the RTX 6000 Ada's L2 per layer for Llama-3-8B, so a group run re-reads from L2."""


def prior() -> StepPrior:
    return StepPrior.of(CostModel(HARDWARE["rtx6000-ada"], MODELS["llama-3-8b"]))


def gate(ordered: bool, **options) -> ModelGate:
    """A gate that has seen one step: 64 decodes of group "a"."""
    layout = BatchLayout.FEATHER if ordered else BatchLayout.ENGINE
    gate = ModelGate.with_prior(prior(), layout=layout, **options)
    gate.observe([BatchEntry("a", PREFIX, PREFIX + 20, 1)] * 64, 0.05)
    return gate


def candidate(group: str = "b", waiters: int = 0, batch: int = 64,
              stops_left: int | None = None, free_seats: int | None = None) -> GateContext:
    return GateContext(batch_size=batch, chunk_loss=80, sharing_waiters=waiters,
                       num_waiting=waiters + 1, candidate_group=group,
                       candidate_tokens=PREFIX + 20, candidate_prefix_tokens=PREFIX,
                       group_waiters=waiters, free_seats=free_seats, stops_left=stops_left)


def test_a_stop_that_would_only_leave_seats_empty_is_not_taken() -> None:
    """While the running group still grows, a STOP keeps its seats; once it has stopped
    growing (no prefill in the last two steps), a group that fits whole is admitted."""
    unordered = gate(ordered=False)
    growing = [BatchEntry("a", PREFIX, PREFIX + 20, 1)] * 63 + [BatchEntry("a", PREFIX,
                                                                           PREFIX + 20, 20)]
    decoding = [BatchEntry("a", PREFIX, PREFIX + 21, 1)] * 64
    unordered.observe(growing, 0.05)
    assert unordered.decide(candidate(waiters=7, free_seats=192)) is Decision.STOP
    unordered.observe(decoding, 0.05)
    assert unordered.decide(candidate(waiters=7, free_seats=192)) is Decision.STOP  # 1 step
    unordered.observe(decoding, 0.05)
    assert unordered.decide(candidate(waiters=7, free_seats=7)) is Decision.STOP  # 8 > 7
    assert unordered.decide(candidate(waiters=7)) is Decision.STOP  # seats unknown
    assert unordered.decide(candidate(waiters=7, free_seats=8)) is Decision.ADD
    # the group admitted now grows: the next new group of this pass is priced as usual
    assert unordered.decide(candidate("c", waiters=7, free_seats=100)) is Decision.STOP
    assert ModelGate.with_prior(prior(), layout=BatchLayout.ENGINE, window=0).window == 0
    with pytest.raises(ValueError, match="window"):
        ModelGate.with_prior(prior(), layout=BatchLayout.ENGINE, window=-1)


def test_a_new_group_that_would_split_the_batch_waits_when_order_is_the_engines() -> None:
    assert gate(ordered=False).decide(candidate(waiters=7)) is Decision.STOP


def test_the_same_group_joins_a_batch_feather_orders() -> None:
    ordered = gate(ordered=True)
    assert ordered.decide(candidate(waiters=7)) is Decision.ADD
    assert ordered.model.steps == 0  # nothing to predict, nothing learned


def test_what_the_gate_does_not_judge() -> None:
    unordered = gate(ordered=False)
    assert unordered.decide(candidate(waiters=7, stops_left=2)) is Decision.STOP
    assert unordered.decide(candidate("a", waiters=7)) is Decision.ADD  # the batch's group
    assert unordered.decide(candidate("c", waiters=7, batch=0)) is Decision.ADD  # empty batch
    assert unordered.decide(candidate("d", waiters=7, stops_left=1)) is Decision.ADD


def test_an_admission_joins_the_batch_the_next_candidate_is_priced_against() -> None:
    unordered = gate(ordered=False)
    assert unordered.decide(candidate(waiters=7, stops_left=1)) is Decision.ADD
    assert unordered.decide(candidate(waiters=6)) is Decision.ADD  # "b" runs now


def test_cold_it_admits_until_it_has_measured_steps() -> None:
    cold = ModelGate.with_prior("none", layout=BatchLayout.ENGINE)
    cold.observe([BatchEntry("a", PREFIX, PREFIX + 20, 1)] * 64, 0.05)
    assert cold.decide(candidate(waiters=7)) is Decision.ADD
    assert not cold.model.ready


def test_options_by_name_and_from_the_feather_config() -> None:
    named = make_gate("model", prior="rtx6000-ada/llama-3-8b", lookahead=4)
    assert isinstance(named, ModelGate) and named.lookahead == 4
    assert named.model.prior == prior()
    with pytest.raises(ValueError, match="unknown prior"):
        make_gate("model", prior="a100")
    with pytest.raises(ValueError, match="bad option for gate 'model'"):
        make_gate("model", exploration=3)
    config = FeatherConfig(gate="model", order_running=False)
    assert config.make_gate().layout is BatchLayout.ENGINE
    assert FeatherConfig(gate="model").make_gate().layout is BatchLayout.FEATHER
