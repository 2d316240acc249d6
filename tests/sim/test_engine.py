"""SimEngine: vLLM-shaped steps, preemption without leaks, persistent-batch order, rejection."""

from __future__ import annotations

import time
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from itertools import groupby
from types import SimpleNamespace

import numpy as np
import pytest

from feather_sched.core.prefix import order_by_group
from feather_sched.gates.base import BatchLayout
from feather_sched.sim.engine import EngineConfig, SimEngine, SimRequest, SimResult, SimState
from feather_sched.sim.fcfs import FcfsPolicy, PriorityPolicy
from feather_sched.sim.policies import make_policy
from feather_sched.workloads.spec import RequestSpec, Workload


class StubCost:
    """Stands in for the cost model: 1 ms plus 0.1 ms a request; remembers what it saw."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.batches: list[list] = []

    def step(self, batch: Sequence) -> SimpleNamespace:
        if self.keep:
            self.batches.append(list(batch))
        return SimpleNamespace(seconds=0.001 + 0.0001 * len(batch), hbm_bytes=1500.0,
                               l2_bytes=100.0 * len(batch), weight_bytes=500.0)

    def groups(self, engine: SimEngine) -> list[list]:
        """Each batch's workload group labels (a request's id where it has none)."""
        label = {r.group: r.spec.group if r.spec.group >= 0 else r.request_id
                 for r in engine.requests}
        return [[label[entry.group] for entry in batch] for batch in self.batches]


class ClockedFcfs(FcfsPolicy):
    """FCFS that notes the clock at every pass and what it was told."""

    def __init__(self, engine: SimEngine) -> None:
        super().__init__()
        self.engine = engine
        self.clock: list[float] = []
        self.finished: list[str] = []

    def begin_pass(self, running: Sequence[SimRequest]) -> list[SimRequest]:
        self.clock.append(self.engine.now)
        return super().begin_pass(running)

    def discard(self, request_id: str) -> bool:
        self.finished.append(request_id)
        return False


class GroupedFcfs(FcfsPolicy):
    """FCFS admission with the running list kept in prefix-group order."""

    layout = BatchLayout.FEATHER

    def begin_pass(self, running: Sequence[SimRequest]) -> list[SimRequest]:
        return order_by_group(running, [r.group for r in running], [r.index for r in running])


def spec(rid: str, group: int = -1, prefix: int = 0, suffix: int = 4, out: int = 4,
         at: float = 0.0) -> RequestSpec:
    """A prompt of a group's ``prefix`` tokens then ``suffix`` tokens unique to ``rid``."""
    head = np.random.default_rng(group + 1).integers(1, 1000, prefix)
    tail = np.random.default_rng(zlib.crc32(rid.encode())).integers(1000, 30000, suffix)
    shared = prefix if group >= 0 else 0
    return RequestSpec(rid, np.concatenate([head, tail]), out, at, group, shared)


def make_engine(cost: StubCost | None = None, **config: int | bool) -> SimEngine:
    """Tiny blocks of 4 tokens; a prefix group is named by its first 8 tokens."""
    options = {"block_tokens": 4, "num_blocks": 256, "charge_scheduler_time": False,
               "group_tokens": 8, **config}
    return SimEngine(cost or StubCost(), EngineConfig(**options))


def simulate(specs: list[RequestSpec], policy: FcfsPolicy | None = None,
             cost: StubCost | None = None, **config: int | bool) -> tuple[SimResult, SimEngine]:
    engine = make_engine(cost, **config)
    policy = FcfsPolicy() if policy is None else policy  # an empty queue is falsy
    return engine.run(Workload("test", specs), policy), engine


def assert_sound(result: SimResult, engine: SimEngine, specs: list[RequestSpec]) -> None:
    """Every request ended once, with its tokens in order, and the pool holds nothing."""
    assert [r.request_id for r in result.records] == [s.request_id for s in specs]
    for record, request in zip(result.records, specs, strict=True):
        assert record.success, record.error
        assert record.output_len == request.output_len
        assert record.submitted_s == request.arrival_s
        assert record.token_times_s[0] >= record.submitted_s
        assert record.token_times_s == sorted(record.token_times_s)
        assert record.finished_s == record.token_times_s[-1]
    assert all(r.state is SimState.FINISHED for r in engine.requests)
    pool = engine.pool
    pool.check()
    assert pool.num_referenced == 0 and pool.num_free == pool.num_blocks


def contiguous(groups: list) -> bool:
    return len(list(groupby(groups))) == len(set(groups))


def test_small_pool_preempts_yet_every_request_finishes_once() -> None:
    specs = [spec(f"r{i}", group=i % 3, prefix=16, suffix=6, out=10 + 7 * (i % 5))
             for i in range(30)]
    done: Counter[str] = Counter()
    cost = StubCost()
    engine = make_engine(cost, num_blocks=40, max_num_batched_tokens=64)
    policy = ClockedFcfs(engine)
    result = engine.run(Workload("test", specs), policy,
                        on_done=lambda r: done.update([r.request_id]))
    assert result.num_preemptions > 0
    assert sum(r.preemptions for r in engine.requests) == result.num_preemptions
    assert [r.preemptions for r in result.records] == [r.preemptions for r in engine.requests]
    assert_sound(result, engine, specs)
    assert done == Counter(s.request_id for s in specs)
    assert sorted(policy.finished) == sorted(done)
    assert policy.clock == sorted(policy.clock)
    assert all(sum(e.new_tokens for e in batch) <= 64 for batch in cost.batches)
    assert [s.batch_size for s in result.steps] == [len(b) for b in cost.batches]
    assert result.duration_s == pytest.approx(sum(0.001 + 0.0001 * len(b) for b in cost.batches))
    costs = result.costs
    assert costs.output_tokens == sum(s.output_len for s in specs)
    steps, entries = len(cost.batches), sum(len(b) for b in cost.batches)
    assert costs.l2_bytes == 100.0 * entries and costs.hbm_bytes == 1500.0 * steps
    kv_from_hbm = (1500.0 - 500.0) * steps
    assert costs.l2_hit_rate == pytest.approx(costs.l2_bytes / (costs.l2_bytes + kv_from_hbm))
    assert costs.hbm_bytes_per_output_token == pytest.approx(costs.hbm_bytes / costs.output_tokens)


def test_arrivals_are_honoured_and_idle_time_is_skipped() -> None:
    specs = [spec("early", out=3), spec("late", out=3, at=5.0)]
    engine = make_engine()
    policy = ClockedFcfs(engine)
    result = engine.run(Workload("test", specs), policy)
    assert_sound(result, engine, specs)
    late = result.records[1]
    assert late.submitted_s == 5.0 and late.token_times_s[0] > 5.0
    assert result.records[0].finished_s < 1.0
    assert 5.0 in policy.clock  # the clock jumped straight to the arrival
    assert len(result.steps) == 6


def test_prefill_is_chunked_by_the_token_budget() -> None:
    specs = [spec("long", suffix=20, out=2)]
    cost = StubCost()
    result, _ = simulate(specs, cost=cost, max_num_batched_tokens=8)
    assert [[e.new_tokens for e in b] for b in cost.batches] == [[8], [8], [4], [1]]
    assert [b[0].context_tokens for b in cost.batches] == [8, 16, 20, 21]
    assert len(result.records[0].token_times_s) == 2
    assert result.records[0].ttft_s == pytest.approx(3 * 0.0011)


def test_prefix_cache_hits_are_counted_exactly() -> None:
    # block 4: a 12-token prefix is 3 full blocks; "same" repeats a's whole 16-token prompt
    a = spec("a", group=0, prefix=12, suffix=4, out=3)
    b = spec("b", group=0, prefix=12, suffix=5, out=3, at=1.0)
    same = RequestSpec("same", a.prompt, 3, 2.0, 0, 12)
    cost = StubCost()
    result, engine = simulate([a, b, same], cost=cost)
    assert_sound(result, engine, [a, b, same])
    assert [r.cached_tokens for r in result.records] == [0, 12, 12]  # last token recomputed
    assert result.prefix_cache_hit_rate == pytest.approx(24 / (16 + 17 + 16))
    prefills = [batch[0] for batch in cost.batches if batch[0].new_tokens > 1]
    # each ran alone: nothing of its prompt is shared with another request of its step
    assert [(e.new_tokens, e.context_tokens, e.shared_tokens) for e in prefills] == [
        (16, 16, 0), (5, 17, 0), (4, 16, 0)]


def test_shared_tokens_and_groups_come_from_the_batch_keys() -> None:
    # a and b share 12 tokens (3 blocks), c shares a's first 8 only; all run together.
    a = spec("a", group=0, prefix=12, suffix=4, out=3)
    b = spec("b", group=0, prefix=12, suffix=5, out=3)
    c = RequestSpec("c", np.concatenate([a.prompt[:8], np.arange(5000, 5008)]), 3, 0.0, 7, 8)
    lone = spec("lone", suffix=12, out=3)
    cost = StubCost()
    result, engine = simulate([a, b, c, lone], cost=cost)
    assert_sound(result, engine, [a, b, c, lone])
    decode = cost.batches[-2]
    assert [e.shared_tokens for e in decode] == [12, 12, 8, 0]
    groups = [e.group for e in decode]
    assert groups[0] == groups[1] == groups[2] != groups[3]  # one group: the first 8 tokens


def test_condense_refills_holes_and_interleaves_groups() -> None:
    # slots [a0 a1 a2 a3]; a0 and a2 finish together, b0 and b1 take their slots.
    specs = [spec(f"a{i}", group=0, prefix=8, out=2 if i % 2 == 0 else 12) for i in range(4)]
    specs += [spec(f"b{i}", group=1, prefix=8, out=12) for i in range(2)]
    cost = StubCost()
    result, engine = simulate(specs, cost=cost, max_num_seqs=4)
    assert_sound(result, engine, specs)
    assert cost.groups(engine)[2] == [1, 0, 1, 0]
    assert not all(contiguous(groups) for groups in cost.groups(engine))


def test_condense_moves_the_last_slot_into_the_hole() -> None:
    specs = [spec(f"r{i}", out=2 if i == 0 else 5) for i in range(4)]
    cost = StubCost()
    _, engine = simulate(specs, cost=cost)
    assert cost.groups(engine)[1] == ["r0", "r1", "r2", "r3"]
    assert cost.groups(engine)[2] == ["r3", "r1", "r2"]


def test_newcomers_take_the_lowest_holes_in_order() -> None:
    specs = [spec(f"r{i}", out=2 if i in (0, 2) else 5) for i in range(6)]
    cost = StubCost()
    _, engine = simulate(specs, cost=cost, max_num_seqs=4)
    assert cost.groups(engine)[2] == ["r4", "r1", "r5", "r3"]


def test_an_ordering_policy_gathers_each_group_in_the_batch() -> None:
    specs = [spec(f"a{i}", group=0, prefix=8, out=2 if i % 2 == 0 else 12) for i in range(4)]
    specs += [spec(f"b{i}", group=1, prefix=8, out=12) for i in range(2)]
    specs += [spec("solo", out=6)]
    cost = StubCost()
    result, engine = simulate(specs, GroupedFcfs(), cost, max_num_seqs=4)
    assert_sound(result, engine, specs)
    assert sorted(cost.groups(engine)[3]) == [0, 0, 1, 1]
    decodes = [groups for groups, batch in zip(cost.groups(engine), cost.batches, strict=True)
               if all(e.new_tokens == 1 for e in batch)]
    assert all(contiguous(groups) for groups in decodes)
    assert max(s.groups for s in result.steps) == 2


def test_a_request_that_can_never_fit_is_rejected_not_hung() -> None:
    specs = [spec("ok", suffix=6, out=3), spec("huge-prompt", suffix=40, out=1),
             spec("huge-output", suffix=8, out=20), spec("ok2", suffix=6, out=3, at=1.0)]
    done: list[str] = []
    engine = make_engine(num_blocks=6)
    result = engine.run(Workload("test", specs), FcfsPolicy(),
                        on_done=lambda r: done.append(r.request_id))
    ok, prompt, output, ok2 = result.records
    assert ok.success and ok2.success and ok2.output_len == 3
    for rejected in (prompt, output):
        assert not rejected.success and "KV blocks" in rejected.error
        assert rejected.output_len == 0 and rejected.finished_s == 0.0
    assert sorted(done) == sorted(s.request_id for s in specs)
    engine.pool.check()


def test_a_policy_that_never_admits_raises_instead_of_looping() -> None:
    class Closed(FcfsPolicy):
        def decide(self) -> None:
            return None

    with pytest.raises(RuntimeError, match="no progress"):
        simulate([spec("r0")], Closed())


def test_scheduler_time_is_charged_to_the_clock() -> None:
    class Slow(FcfsPolicy):
        charged_s = 0.5  # modelled seconds every step

        def begin_pass(self, running: Sequence[SimRequest]) -> list[SimRequest]:
            time.sleep(0.002)
            return list(running)

    specs = [spec("r0", out=3)]
    free_result, _ = simulate(specs, Slow(), charge_scheduler_time=False)
    charged, _ = simulate(specs, Slow(), charge_scheduler_time=True)
    assert free_result.duration_s == pytest.approx(3 * 0.0011)
    assert charged.scheduler_cpu_s >= 3 * 0.002 and charged.modelled_scheduler_s == 1.5
    assert charged.duration_s >= 3 * (0.0011 + 0.002 + 0.5)


def test_overlapped_scheduler_time_costs_only_what_outlasts_the_step() -> None:
    class Modelled(FcfsPolicy):
        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.charged_s = seconds  # modelled seconds every step

    specs = [spec("r0", out=3)]  # 3 steps of 1.1 ms each
    overlap = {"charge_scheduler_time": True, "overlap_scheduler": True}
    slow, _ = simulate(specs, Modelled(0.5), **overlap)
    serial, _ = simulate(specs, Modelled(0.5), charge_scheduler_time=True)
    hidden, _ = simulate(specs, Modelled(1.0e-6), **overlap)
    # the scheduler outlasts each step: its time is the step's, not added to it
    assert 3 * 0.5 <= slow.duration_s < serial.duration_s - 3 * 0.001
    # a scheduler faster than the step (by ~1 ms here) costs the clock nothing
    assert hidden.duration_s == pytest.approx(3 * 0.0011)


def test_ten_thousand_requests_simulate_quickly() -> None:
    rng = np.random.default_rng(0)
    specs = [spec(f"r{i}", group=int(rng.integers(0, 50)), prefix=32, suffix=16,
                  out=int(rng.integers(4, 24)), at=i * 0.001) for i in range(10_000)]
    start = time.perf_counter()
    result, engine = simulate(specs, cost=StubCost(keep=False), block_tokens=16,
                              num_blocks=2048, charge_scheduler_time=True)
    elapsed = time.perf_counter() - start
    print(f"\n10,000 requests, {len(result.steps)} steps: {elapsed:.2f} s wall")
    assert all(r.success for r in result.records)
    assert result.prefix_cache_hit_rate is not None and result.prefix_cache_hit_rate > 0.3
    engine.pool.check()
    assert elapsed < 20


def test_no_admission_in_a_step_that_preempted() -> None:
    # 5 blocks of 4, 4-token budget: in step 7 r1 cannot grow and preempts itself; the
    # blocks it frees would take it back at once, but vLLM admits only in the next step.
    specs = [spec("r0", out=13), spec("r1", out=9)]
    cost = StubCost()
    result, engine = simulate(specs, cost=cost, num_blocks=5, max_num_batched_tokens=4)
    assert_sound(result, engine, specs)
    assert cost.groups(engine)[6:9] == [["r0", "r1"], ["r0"], ["r0", "r1"]]
    r1 = cost.batches[8][1]
    assert (r1.context_tokens, r1.new_tokens) == (7, 3)  # 4 cached prompt tokens + a chunk
    assert engine.requests[1].preemptions == result.num_preemptions == 2
    assert result.records[1].cached_tokens == 0  # the first admission's hit, as vLLM


# ---- urgent preemption: vLLM's protocol, before the pass ------------------------------


class Recorded:
    """Feather (``make_policy``, gate ``always``) with its pass calls recorded in order."""

    CALLS = ("begin_pass", "urgent_victims", "promise", "admit")

    def __init__(self, engine: SimEngine) -> None:
        self.runtime = make_policy("feather-always", {}, engine)
        self.calls: list[tuple[str, object]] = []
        self.tried: list[list[str]] = []
        """Each set of victims the engine's room was asked about."""

    def room(self, room):
        def made_by(victims):
            self.tried.append([v.request_id for v in victims])
            return room.made_by(victims)
        return SimpleNamespace(made_by=made_by)

    def wrap(self):
        runtime = self.runtime
        for name in self.CALLS:
            method = getattr(runtime, name)

            def call(*args, _name=name, _method=method):
                if _name == "urgent_victims":
                    args = (*args[:2], self.room(args[2]))
                result = _method(*args)
                shown = [v.request_id for v in result] if _name == "urgent_victims" else \
                    getattr(args[0], "request_id", None)
                self.calls.append((_name, shown))
                return result

            setattr(runtime, name, call)
        return runtime


def urgent_run(specs: list[RequestSpec], **config: int) -> tuple[SimEngine, Recorded]:
    engine = make_engine(**config)
    recorded = Recorded(engine)
    engine.run(Workload("urgent", specs), recorded.wrap())
    return engine, recorded


def test_an_urgent_request_without_a_seat_preempts_one_victim_before_the_pass() -> None:
    """Both seats held by class 1: the class-0 arrival preempts the end of Feather's order
    (the newer one) before the running loop, and is admitted in that same pass."""
    low = [replace(spec(f"low{i}", out=30, at=0.0), priority=1) for i in range(2)]
    urgent = replace(spec("urgent", out=2, at=0.003), priority=0)
    engine, recorded = urgent_run([*low, urgent], max_num_seqs=2)
    at = recorded.calls.index(("urgent_victims", ["low1"]))
    assert recorded.calls[at - 1][0] == "begin_pass"  # before the pass's running loop
    assert recorded.calls[at + 1:at + 3] == [("promise", "urgent"), ("admit", "urgent")]
    assert [r.preemptions for r in engine.requests] == [0, 1, 0]


def test_urgent_victims_are_pruned_to_the_fewest_that_free_the_blocks() -> None:
    """KV pressure: group A (A0, A1, sharing a 40-token prefix) is the youngest group, so
    A1 then A0 lead Feather's order, but both free fewer blocks than the urgent request
    needs; B, the oldest, frees enough alone.  vLLM's protocol preempts B only (the run
    A1, A0, B pruned), where one victim at a time would have taken all three."""
    b = replace(spec("B", suffix=80, out=20), priority=1)
    a = [replace(spec(f"A{i}", group=0, prefix=40, out=20), priority=1) for i in range(2)]
    urgent = replace(spec("urgent", suffix=64, out=2, at=0.001), priority=0)
    engine, recorded = urgent_run([b, *a, urgent], num_blocks=34)
    assert recorded.tried == [["A1"], ["A1", "A0"], ["A1", "A0", "B"], ["A1", "B"], ["B"]]
    at = recorded.calls.index(("urgent_victims", ["B"]))
    assert recorded.calls[at - 1][0] == "begin_pass"
    assert recorded.calls[at + 1:at + 3] == [("promise", "urgent"), ("admit", "urgent")]
    assert {r.request_id: r.preemptions for r in engine.requests} == \
        {"B": 1, "A0": 0, "A1": 0, "urgent": 0}
    engine.pool.check()


def test_a_baseline_never_preempts_for_urgency() -> None:
    """vLLM's own priority policy (``sim.fcfs``) has no ``UrgentPreemption``: the urgent
    request waits for a seat."""
    low = [replace(spec(f"low{i}", out=30), priority=1) for i in range(2)]
    urgent = replace(spec("urgent", out=2, at=0.003), priority=0)
    result, _ = simulate([*low, urgent], PriorityPolicy(), max_num_seqs=2)
    assert result.num_preemptions == 0
    assert result.records[2].token_times_s[0] > max(r.finished_s for r in result.records[:1])
