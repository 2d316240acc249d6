"""ADD/STOP gates: the fixed rules, the bandit's learning, and its saved table."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feather_sched.gates import make_gate
from feather_sched.gates.bandit import UCBBanditGate
from feather_sched.gates.base import Decision, GateContext, must_add
from feather_sched.gates.heuristic import AlwaysAddGate, ChunkLossGate
from tests.helpers.strategies import documents, fields_or_any


def greedy(gate: UCBBanditGate, context: GateContext) -> Decision:
    """The bandit's learned best action in ``context``, without exploring (ADD while an
    action is untried)."""
    if must_add(context):
        return Decision.ADD
    arms = gate.table.get(gate.context_of(context))
    if not arms or any(arm.pulls == 0 for arm in arms.values()):
        return Decision.ADD
    return max(arms, key=lambda d: arms[d].mean)


def ctx(batch: int = 8, loss: int = 3, waiters: int = 0, waiting: int = 10) -> GateContext:
    return GateContext(batch_size=batch, chunk_loss=loss, sharing_waiters=waiters,
                       num_waiting=waiting)


def test_always_add_adds_even_a_total_loss() -> None:
    assert AlwaysAddGate().decide(ctx(loss=1000)) is Decision.ADD


def test_chunk_loss_gate_limits_loss_and_loosens_under_load() -> None:
    gate = ChunkLossGate(max_loss=5, max_loss_loaded=7, load_waiting=100, floor_start=4)
    assert gate.decide(ctx(batch=16, loss=5)) is Decision.ADD
    assert gate.decide(ctx(batch=16, loss=6, waiting=10)) is Decision.STOP
    assert gate.decide(ctx(batch=16, loss=6, waiting=100)) is Decision.ADD
    assert gate.decide(ctx(batch=16, loss=8, waiting=100)) is Decision.STOP


def test_chunk_loss_gate_floor_rises_while_it_holds_requests_back() -> None:
    gate = ChunkLossGate(floor_start=2, floor_step=3, floor_max=8)
    assert gate.decide(ctx(batch=1, loss=50)) is Decision.ADD
    assert gate.decide(ctx(batch=2, loss=50)) is Decision.STOP
    gate.end_step()
    assert gate.floor == 5
    assert gate.decide(ctx(batch=4, loss=50)) is Decision.ADD
    assert gate.decide(ctx(batch=5, loss=50)) is Decision.STOP
    gate.end_step()
    assert gate.floor == 8
    assert gate.decide(ctx(batch=8, loss=50)) is Decision.STOP
    gate.end_step()
    assert gate.floor == 8
    gate.end_step()
    assert gate.floor == 2


@pytest.mark.parametrize("gate", [ChunkLossGate(), UCBBanditGate()])
def test_no_gate_refuses_an_empty_batch_or_a_free_admission(gate) -> None:
    assert gate.decide(ctx(batch=0, loss=99)) is Decision.ADD
    assert gate.decide(ctx(batch=30, loss=0)) is Decision.ADD


def train(gate: UCBBanditGate, throughput: dict[Decision, float], steps: int) -> None:
    """Each step asks once in one context; the step's reward depends on the answer."""
    context = ctx(batch=8, loss=4, waiters=2)
    for _ in range(steps):
        decision = gate.decide(context)
        gate.reward([(context, decision)], batch_size=1, seconds=1 / throughput[decision])


def test_bandit_learns_that_stopping_pays() -> None:
    gate = UCBBanditGate(exploration=10.0, seed=1)
    train(gate, {Decision.ADD: 100.0, Decision.STOP: 300.0}, steps=200)
    arms = gate.table[gate.context_of(ctx(batch=8, loss=4, waiters=2))]
    assert arms[Decision.STOP].pulls > 150
    assert greedy(gate, ctx(batch=8, loss=4, waiters=2)) is Decision.STOP


def test_bandit_learns_that_adding_pays() -> None:
    gate = UCBBanditGate(exploration=10.0, seed=1)
    train(gate, {Decision.ADD: 300.0, Decision.STOP: 100.0}, steps=200)
    assert greedy(gate, ctx(batch=8, loss=4, waiters=2)) is Decision.ADD


def test_bandit_rewards_exactly_the_decisions_it_is_given() -> None:
    gate = UCBBanditGate(seed=0)
    contexts = [ctx(batch=b, loss=3) for b in (4, 8, 12)]
    decisions = [(c, gate.decide(c)) for c in contexts]
    gate.reward(decisions[:2], batch_size=12, seconds=0.5)
    for context, decision in decisions[:2]:
        arm = gate.table[gate.context_of(context)][decision]
        assert (arm.pulls, arm.total) == (1, 24.0)
    assert all(arm.pulls == 0 for arm in gate.table[gate.context_of(contexts[2])].values())


def test_bandit_learns_nothing_from_admissions_no_gate_may_refuse() -> None:
    gate = UCBBanditGate(seed=0)
    gate.reward([(ctx(batch=0, loss=3), Decision.ADD), (ctx(batch=5, loss=0), Decision.ADD)],
                batch_size=5, seconds=0.1)
    assert gate.table == {}


def test_bandit_context_bins_follow_the_paper() -> None:
    gate = UCBBanditGate()
    assert gate.context_of(ctx(batch=9, loss=12, waiters=7)) == (2, 5, 1)
    assert gate.context_of(ctx(batch=10_000, loss=-40, waiters=10_000)) == (15, -5, 15)


def test_bandit_is_deterministic_for_a_seed() -> None:
    def run(seed: int) -> list[Decision]:
        gate = UCBBanditGate(seed=seed)
        out = []
        for step in range(60):
            context = ctx(batch=4 + step % 3, loss=2 + step % 4)
            out.append(gate.decide(context))
            gate.reward([(context, out[-1])], batch_size=4, seconds=0.01 + 0.001 * (step % 5))
        return out

    assert run(3) == run(3)
    assert any(run(3) != run(seed) for seed in range(4, 10))


def test_bandit_table_round_trips_and_warm_starts(tmp_path) -> None:
    gate = UCBBanditGate(exploration=10.0, seed=1)
    train(gate, {Decision.ADD: 100.0, Decision.STOP: 300.0}, steps=50)
    path = tmp_path / "bandit.json"
    gate.save(path)
    warm = make_gate("bandit", exploration=10.0)
    warm.load(path)
    assert warm.table == gate.table
    assert greedy(warm, ctx(batch=8, loss=4, waiters=2)) is Decision.STOP


def test_bandit_refuses_a_table_learned_with_other_bins(tmp_path) -> None:
    path = tmp_path / "bandit.json"
    UCBBanditGate(batch_bin=8).save(path)
    with pytest.raises(ValueError, match="binning"):
        UCBBanditGate().load(path)


@pytest.mark.parametrize(
    ("kind", "options", "message"),
    [
        ("greedy", {}, "unknown gate kind 'greedy'"),
        ("always", {"max_loss": 3}, "takes no options"),
        ("chunk-loss", {"max_loss": -1}, "max_loss must be non-negative"),
        ("chunk-loss", {"speed": 1}, "bad option for gate 'chunk-loss'"),
        ("bandit", {"exploration": -2.0}, "exploration must be non-negative"),
        ("bandit", {"batch_bin": 0}, "batch_bin must be positive"),
    ],
)
def test_bad_gate_options_fail_clearly(kind: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_gate(kind, **options)


def test_step_time_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        UCBBanditGate().reward([(ctx(batch=4, loss=3), Decision.ADD)], batch_size=4,
                               seconds=0.0)


def test_a_table_write_cut_short_leaves_the_previous_table(tmp_path) -> None:
    """A file-size limit (standing in for a full disk) stops the write half-way."""
    import subprocess
    import sys

    path = tmp_path / "bandit.json"
    small = UCBBanditGate(seed=0)
    train(small, {Decision.ADD: 100.0, Decision.STOP: 300.0}, steps=20)
    small.save(path)
    before = path.read_text()
    script = f"""
import resource, signal
from feather_sched.gates.base import Decision, GateContext, must_add
from feather_sched.gates.bandit import UCBBanditGate
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
gate = UCBBanditGate(seed=0)
for batch in range(60):
    for loss in range(1, 6):
        context = GateContext(batch_size=batch, chunk_loss=loss, sharing_waiters=batch,
                              num_waiting=10)
        gate.reward([(context, Decision.ADD)], batch_size=4, seconds=0.1)
resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) + 200}, {len(before) + 200}))
try:
    gate.save({str(path)!r})
except OSError as error:
    print("failed", error.errno)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    assert done.stdout.startswith("failed"), done.stdout + done.stderr
    assert path.read_text() == before
    assert not list(tmp_path.glob(".*.tmp"))
    UCBBanditGate().load(path)


# ---- the saved table, checked at load ---------------------------------------------------

BINNING = UCBBanditGate()._binning()
ROWS = fields_or_any({
    "context": st.tuples(st.integers(0, 15), st.integers(-5, 5), st.integers(0, 15)).map(list),
    "action": st.sampled_from(["add", "stop"]),
    "pulls": st.integers(1, 10**6),
    "total": st.floats(0, 1e9),
})
TABLES = fields_or_any({"format": st.just("feather-bandit"), "version": st.just(1),
                        "binning": st.just(BINNING), "table": st.lists(ROWS, max_size=4)})


@pytest.mark.parametrize(("row", "field"), [
    ({"total": float("nan")}, '"total"'), ({"total": float("inf")}, '"total"'),
    ({"total": -1.0}, '"total"'), ({"pulls": -3}, '"pulls"'), ({"pulls": 2.5}, '"pulls"'),
    ({"context": [1, 2]}, '"context"'), ({"context": [99, 0, 0]}, '"context"'),
    ({"action": "wait"}, '"action"'),
])
def test_a_bad_value_in_a_saved_table_is_refused_naming_the_file_and_field(
        tmp_path, row: dict, field: str) -> None:
    """A NaN total once passed the load and crashed the first gated decision."""
    path = tmp_path / "bandit.json"
    good = {"context": [1, 2, 0], "action": "add", "pulls": 3, "total": 30.0}
    table = {"format": "feather-bandit", "version": 1, "binning": BINNING, "table": [good]}
    path.write_text(json.dumps(table | {"table": [good, good | {"action": "stop"},
                                                  good | row]}))
    with pytest.raises(ValueError, match=rf"^{path}: row 2 of \"table\" is malformed: {field}"):
        UCBBanditGate().load(path)
    for wrong in ({"version": 2}, {"table": {}}, {"table": [good, good]}):
        path.write_text(json.dumps(table | wrong))
        with pytest.raises(ValueError, match=rf"^{path}: .*{next(iter(wrong))}"):
            UCBBanditGate().load(path)


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(documents(TABLES))
def test_a_table_file_loads_whole_or_is_refused_naming_the_file(tmp_path, content) -> None:
    """Whatever the file holds: the load raises ValueError naming the file, or gives a
    table every decision can use."""
    path = tmp_path / "bandit.json"
    path.write_bytes(content)
    gate = UCBBanditGate()
    try:
        gate.load(path)
    except ValueError as error:
        assert str(error).startswith(f"{path}: ")
        return
    for arms in gate.table.values():
        assert all(math.isfinite(arm.total) and arm.total >= 0 for arm in arms.values())
    for context in list(gate.table):  # a decision in an unseen bin adds its row
        decided = ctx(batch=4 * context[0] + 1, loss=context[1] or 1, waiters=4 * context[2])
        assert gate.decide(decided) in Decision and greedy(gate, decided) in Decision
