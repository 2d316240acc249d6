"""The simulator's policies: SGLang's real rules, Feather's real queue."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from feather_sched.cli import app
from feather_sched.core.config import FeatherConfig
from feather_sched.core.runtime import FeatherRuntime
from feather_sched.costmodel.cost import CostModel
from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS
from feather_sched.gates.base import BatchLayout
from feather_sched.results.summary import summarize
from feather_sched.sim.engine import EngineConfig, SimEngine, SimRequest
from feather_sched.sim.fcfs import FcfsPolicy, PriorityPolicy
from feather_sched.sim.policies import (
    LPM_MAX_WAITING,
    DfsWeightPolicy,
    HrrnPolicy,
    LpmPolicy,
    RoutingKeyPolicy,
    make_policy,
)
from feather_sched.sim.runner import BLOCK_TOKENS, SimPlan, kv_pool_blocks, simulate
from feather_sched.workloads.spec import ArrivalSpec, RequestSpec, Workload, prioritized
from feather_sched.workloads.synthetic import (
    minority_groups,
    multi_tenant,
    no_sharing,
    shared_prefix_groups,
    singleton_before_a_stream,
)


class Req:
    """The little of SimRequest the SGLang policies read."""

    def __init__(self, name: str, keys: list, group: int = -1) -> None:
        self.request_id = name
        self.keys = keys
        self.preemptions = 0
        self.prompt_len = 16 * len(keys)
        self.spec = SimpleNamespace(group=group)


class Pool:
    block_tokens = 16

    def __init__(self, cached: set) -> None:
        self.cached = cached

    def match(self, keys: list) -> list:
        n = 0
        while n < len(keys) and keys[n] in self.cached:
            n += 1
        return keys[:n]


class Engine:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.now = 0.0


def keys(group: str, blocks: int, tail: str) -> list:
    return [f"{group}{i}" for i in range(blocks)] + [tail]


def admitted(policy, count: int) -> list[str]:
    """What the policy admits, one pass, ``count`` times in a row."""
    names = []
    for _ in range(count):
        answer = policy.decide()
        request = next(r for r in policy._queue if r.request_id == answer.request_id)
        policy.admit(request)
        names.append(request.request_id)
    return names


def test_lpm_orders_by_cached_prefix_and_pushes_back_in_batch_duplicates() -> None:
    policy = LpmPolicy(Engine(Pool({"a0", "a1", "a2", "a3"})), match_s=0.0)
    waiting = [Req("b1", keys("b", 4, "x1")), Req("a1", keys("a", 4, "x2")),
               Req("b2", keys("b", 4, "x3")), Req("c1", keys("c", 1, "x4"))]
    for request in waiting:
        policy.enter_waiting(request)
    policy.begin_pass([])
    assert admitted(policy, 4) == ["a1", "b1", "c1", "b2"]


def test_lpm_falls_back_to_fcfs_above_its_limit_and_charges_matching() -> None:
    policy = LpmPolicy(Engine(Pool({"a0", "a1"})), match_s=1e-3)
    requests = [Req(f"r{i}", keys("z" if i % 2 else "a", 2, f"t{i}"))
                for i in range(LPM_MAX_WAITING + 1)]
    for request in requests:
        policy.enter_waiting(request)
    policy.begin_pass([])
    assert policy.decide().request_id == requests[0].request_id
    assert policy.charged_s == 0.0
    policy.admit(requests[0])
    policy.begin_pass([])
    assert policy.decide().request_id in {r.request_id for r in requests if r.keys[0] == "a0"}
    assert policy.charged_s == pytest.approx(LPM_MAX_WAITING * 1e-3, rel=0.2)


def test_dfs_weight_visits_the_heaviest_cached_subtree_first() -> None:
    policy = DfsWeightPolicy(Engine(Pool({"a0", "a1", "b0", "b1"})), match_s=0.0)
    names = ["a1", "b1", "b2", "b3", "n1"]
    for name in names:
        policy.enter_waiting(Req(name, keys(name[0], 2, f"tail-{name}")))
    policy.begin_pass([])
    assert admitted(policy, len(names)) == ["b1", "b2", "b3", "a1", "n1"]


def test_hrrn_ages_by_prefill_tokens_over_uncached_tokens() -> None:
    policy = HrrnPolicy(Engine(Pool({"w0", "w1", "w2", "w3"})), match_s=0.0)
    prefilled = SimpleNamespace(step=1, scheduled_tokens=160, num_output_tokens=0)
    policy.enter_waiting(Req("long", keys("l", 9, "t1")))     # 160 uncached tokens
    policy.end_pass(1, [prefilled])                           # it waited 160: ratio +1
    policy.enter_waiting(Req("short", keys("s", 1, "t2")))    # 32 uncached, waited 0
    policy.enter_waiting(Req("warm", keys("w", 4, "t3")))     # 16 uncached, waited 0
    policy.begin_pass([])
    assert admitted(policy, 3) == ["long", "short", "warm"]
    policy.end_pass(2, [SimpleNamespace(step=2, scheduled_tokens=32, num_output_tokens=0)])
    for name, tail in (("short", "t2"), ("warm", "t3")):
        policy.enter_waiting(Req(name, keys(name[0], 4 if name == "warm" else 1, tail)))
    policy.begin_pass([])   # both waited 32 tokens: 32/32 < 32/16
    assert admitted(policy, 2) == ["warm", "short"]


def test_routing_key_puts_the_running_batchs_keys_first_by_count() -> None:
    policy = RoutingKeyPolicy()
    waiting = [Req("none", keys("n", 1, "a")), Req("g3", keys("c", 1, "b"), group=3),
               Req("g2", keys("b", 1, "c"), group=2), Req("g1", keys("a", 1, "d"), group=1),
               Req("g1-again", keys("a", 1, "e"), group=1)]
    for request in waiting:
        policy.enter_waiting(request)
    running = [Req(f"r{g}{i}", [], group=g) for g, n in ((1, 2), (2, 1)) for i in range(n)]
    assert policy.begin_pass(running) == running
    assert admitted(policy, 5) == ["g1", "g1-again", "g2", "none", "g3"]


def test_names_build_policies_and_bad_names_fail() -> None:
    engine = SimEngine(None, EngineConfig())
    feather = make_policy("feather-bandit-noorder", {}, engine)
    assert isinstance(feather, FeatherRuntime) and feather.layout is BatchLayout.ENGINE
    assert type(make_policy("priority", {}, engine)) is PriorityPolicy
    assert type(make_policy("fcfs", {}, engine)) is FcfsPolicy
    with pytest.raises(ValueError, match="unknown scheduler 'lifo'"):
        make_policy("lifo", {}, engine)
    with pytest.raises(ValueError, match="unknown scheduler 'fcfs-nocache'"):
        make_policy("fcfs-nocache", {}, engine)


@pytest.mark.parametrize(("block_tokens", "chunk_tokens"), [(16, 128), (48, 96), (256, 256)])
def test_feathers_queue_counts_a_chunk_in_whole_blocks(block_tokens, chunk_tokens) -> None:
    """A chunk key is every k-th block key, as in vLLM: 128 tokens in whole blocks."""
    runtime = make_policy("feather-model", {}, SimEngine(None, EngineConfig(
        block_tokens=block_tokens)))
    assert runtime.queue.chunk_tokens == runtime.view.chunk_tokens == chunk_tokens


def plan_for(workload, schedulers, **engine) -> SimPlan:
    """The plan, the scheduler's wall-clock time off the simulated clock: the outcome
    must not depend on how busy the machine running the test is."""
    engine = EngineConfig(num_blocks=40_000, charge_scheduler_time=False, **engine)
    return SimPlan(workload=workload, hardware=HARDWARE["h100-sxm"], model=MODELS["llama-3-8b"],
                   schedulers=schedulers, engine=engine)


def test_feather_reads_less_hbm_than_fcfs_on_interleaved_groups() -> None:
    workload = shared_prefix_groups(groups=8, prompts_per_group=16, prefix_len=4096,
                                    suffix_len=32, output_len=20, seed=1)
    plan = plan_for(workload, [])
    fcfs, feather = simulate(plan, "fcfs"), simulate(plan, "feather-always")
    for run in (fcfs, feather):
        assert all(r.success and r.output_len == 20 for r in run.records)
    assert (feather.extra["hbm_bytes_per_output_token"]
            < fcfs.extra["hbm_bytes_per_output_token"])
    assert feather.extra["modelled_l2_hit_rate"] > fcfs.extra["modelled_l2_hit_rate"]
    assert feather.gate_counts["add"] + feather.gate_counts["forced"] == len(workload)


def test_gates_change_nothing_without_sharing() -> None:
    workload = no_sharing(requests=64, prompt_len=512, output_len=16, seed=2)
    plan = plan_for(workload, [])
    fcfs, feather = simulate(plan, "fcfs"), simulate(plan, "feather-chunk-loss")
    assert feather.gate_counts["stop"] == 0
    assert feather.duration_s == pytest.approx(fcfs.duration_s, rel=0.03)


def test_feather_sim_cli_writes_results(tmp_path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, [
        "sim", "--groups", "4", "--prompts-per-group", "8", "--prefix-len", "1024",
        "--output-len", "10", "--hardware", "rtx6000-ada", "--schedulers",
        "fcfs,sglang-lpm,sglang-dfs-weight,feather-chunk-loss,feather-bandit",
        "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 5 and all(r["completed"] == 32 for r in runs.values())
    assert runs["feather-bandit"]["hbm_bytes_per_output_token"] > 0


def test_feather_sim_engine_flags_reach_the_plan(monkeypatch) -> None:
    from feather_sched.sim import runner

    plans = []
    monkeypatch.setattr(runner, "simulate", lambda plan, name, on_done=None: plans.append(
        plan) or simulate(plan, name, on_done))

    def engine(*flags: str) -> EngineConfig:
        result = CliRunner().invoke(app, [
            "sim", "--groups", "1", "--prompts-per-group", "2", "--prefix-len", "64",
            "--output-len", "2", "--schedulers", "fcfs", *flags], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        return plans.pop().engine

    plain = engine()
    assert plain == SimPlan(workload=no_sharing(requests=1, prompt_len=8, output_len=1),
                            hardware=HARDWARE["h100-sxm"],
                            model=MODELS["llama-3-8b"]).engine_config()
    assert engine("--overlap-scheduler").overlap_scheduler and not plain.overlap_scheduler
    large = engine("--block-tokens", "128", "--max-num-seqs", "32",
                   "--no-charge-scheduler-time")
    assert (large.block_tokens, large.num_blocks, large.max_num_seqs) == (
        128, plain.num_blocks // 8, 32) and not large.charge_scheduler_time


def test_a_plan_from_options_sizes_its_kv_pool_in_its_own_blocks() -> None:
    workload = no_sharing(requests=2, prompt_len=64, output_len=2)
    model = MODELS["llama-3-8b"]
    default = SimPlan.from_options(workload).engine
    assert default.block_tokens == BLOCK_TOKENS == 16
    assert default.num_blocks == kv_pool_blocks(HARDWARE["h100-sxm"], model, 16)
    for block_tokens in (16, 32, 128):  # the same bytes, whatever the block
        assert SimPlan.from_options(workload, block_tokens=block_tokens).engine.num_blocks == (
            kv_pool_blocks(HARDWARE["h100-sxm"], model, 16) * 16 // block_tokens)
    assert SimPlan.from_options(workload, kv_cache_gib=2).engine.num_blocks == (
        2 * 2**30 // (model.kv_bytes_per_token * 16))
    assert SimPlan.from_options(workload, num_blocks=600).engine.num_blocks == 600
    with pytest.raises(ValueError, match="not both"):
        SimPlan.from_options(workload, num_blocks=600, kv_cache_gib=2)
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        SimPlan.from_options(workload, model="gpt-9")
    with pytest.raises(ValueError, match="unknown hardware 'tpu-v9'"):
        SimPlan.from_options(workload, hardware="tpu-v9")


def test_feather_sim_cli_reports_priority_classes(tmp_path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, [
        "sim", "--groups", "4", "--prompts-per-group", "8", "--prefix-len", "1024",
        "--output-len", "10", "--high-priority-share", "0.25", "--schedulers",
        "fcfs,priority,feather-model", "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert {name: r["scheduling_policy"] for name, r in runs.items()} == {
        "fcfs": "fcfs", "priority": "priority", "feather-model": "priority"}
    for summary in runs.values():
        assert [c["requests"] for c in summary["by_priority"].values()] == [8, 24]
        assert summary["preemptions"] == 0 == summary["max_preemptions_per_request"]
    assert "Per priority class" in result.output
    assert "fcfs (priorities stripped to 0)" in result.output
    for bad in ("-0.5", "1.01"):
        refused = CliRunner().invoke(app, ["sim", "--high-priority-share", bad],
                                     env={"COLUMNS": "200"})
        assert refused.exit_code != 0 and "high-priority-share" in refused.output


def test_feather_sim_cli_rejects_unknown_hardware() -> None:
    result = CliRunner().invoke(app, ["sim", "--hardware", "tpu-v9"], env={"COLUMNS": "200"})
    assert result.exit_code != 0 and "unknown hardware 'tpu-v9'" in result.output


def test_pretrain_writes_a_table_the_vllm_gate_loads(tmp_path, monkeypatch) -> None:
    from feather_sched.core.config import FeatherConfig
    from feather_sched.sim import runner

    monkeypatch.setattr(runner, "PRETRAIN_FAMILY", ((4, 16, 2048, 20), (8, 8, 1024, 20)))
    out = tmp_path / "bandit.json"
    result = CliRunner().invoke(app, ["pretrain", "--out", str(out), "--rounds", "2",
                                      "--feather-options", '{"gate_options": {"seed": 3}}'],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    gate = FeatherConfig(gate="bandit", state_file=str(out)).make_gate()
    assert sum(arm.pulls for arms in gate.table.values() for arm in arms.values()) > 0


def test_a_shared_suffix_runs_that_scheduler_with_the_cascade_kernel() -> None:
    workload = shared_prefix_groups(groups=4, prompts_per_group=16, prefix_len=4096,
                                    suffix_len=32, output_len=20, seed=1)
    plan = plan_for(workload, [])
    assert not plan.cost_model("fcfs").cascade and plan.cost_model("fcfs-shared").cascade
    plain, shared = simulate(plan, "fcfs"), simulate(plan, "fcfs-shared")
    assert shared.name == "fcfs-shared"
    assert (shared.extra["hbm_bytes_per_output_token"]
            < plain.extra["hbm_bytes_per_output_token"])
    cascading = SimPlan(workload=workload, hardware=plan.hardware, model=plan.model,
                        cascade=True)
    assert cascading.cost_model("feather-model").cascade
    assert not cascading.cost_model("feather-model-noshared").cascade


def test_the_model_gate_keeps_an_unordered_batch_homogeneous_where_that_pays() -> None:
    """The paper's setting (ordering off, no bound) on the RTX 6000 Ada, whose L2 holds a
    10K prefix per layer: the model gate STOPs new groups out of a batch whose prefix
    runs they would split; with ordering on it decides exactly as always-add."""
    workload = shared_prefix_groups(groups=8, prompts_per_group=100, prefix_len=10240,
                                    suffix_len=20, output_len=50,
                                    arrival=ArrivalSpec(kind="poisson", rate=100), seed=0)
    plan = SimPlan(workload=workload, hardware=HARDWARE["rtx6000-ada"],
                   model=MODELS["llama-3-8b"])
    always = simulate(plan, "feather-always-noorder-unbounded")
    model = simulate(plan, "feather-model-noorder-unbounded")
    assert all(r.success for r in model.records)
    assert model.gate_counts["stop"] > 100
    assert (summarize(model)["output_throughput"]
            > 1.2 * summarize(always)["output_throughput"])
    ordered = simulate(plan, "feather-model")
    assert ordered.gate_counts == simulate(plan, "feather-always").gate_counts


def singleton_against_a_stream() -> SimPlan:
    """A singleton arrives first, then 400 requests of one group at 200/s, a KV pool that
    holds a fraction of them (the case where the batch order put the singleton last)."""
    workload = singleton_before_a_stream(stream=400, prefix_len=2048, suffix_len=32,
                                         output_len=200, singleton_output_len=400,
                                         arrival=ArrivalSpec(kind="poisson", rate=200))
    return SimPlan(workload=workload, hardware=HARDWARE["h100-sxm"],
                   model=MODELS["llama-3-8b"],
                   engine=EngineConfig(num_blocks=600, charge_scheduler_time=False))


def test_an_old_singleton_is_not_preempted_for_a_stream_of_majority_requests() -> None:
    plan = singleton_against_a_stream()
    finished = {}
    for name in ("fcfs", "feather-model"):
        run = simulate(plan, name)
        assert summarize(run)["preemptions"] > 100  # the pool is tight
        finished[name] = next(r for r in run.records if r.group < 0).finished_s
    assert finished["feather-model"] <= 1.25 * finished["fcfs"], finished


def is_the_latest_arrival(victim: SimRequest, running: Sequence[SimRequest]) -> bool:
    """vLLM's rule under its priority policy: the latest arrival of the least urgent
    class."""
    key = (victim.spec.priority, victim.spec.arrival_s)
    return all((r.spec.priority, r.spec.arrival_s) <= key for r in running)


def is_the_newest_of_the_youngest_group(victim: SimRequest,
                                        running: Sequence[SimRequest],
                                        bound: int | None = None) -> bool:
    """Feather's rule: in the least urgent class, the group whose oldest running member
    arrived last, and its newest member among those preempted fewer than ``bound``
    (``max_preemptions``) times, or of them all where every member is at the bound."""
    if any(r.spec.priority > victim.spec.priority for r in running):
        return False
    oldest: dict = {}
    for r in running:
        if r.spec.priority == victim.spec.priority:
            oldest[r.group] = min(oldest.get(r.group, math.inf), r.spec.arrival_s)
    members = [r for r in running
               if r.group == victim.group and r.spec.priority == victim.spec.priority]
    bound = FeatherConfig().max_preemptions if bound is None else bound
    exposed = [r for r in members if r.preemptions < bound] or members
    return oldest[victim.group] == max(oldest.values()) and \
        victim.spec.arrival_s == max(r.spec.arrival_s for r in exposed)


@pytest.mark.parametrize("seed", range(3))
def test_no_request_is_preempted_for_a_group_of_younger_requests(seed: int,
                                                                 monkeypatch) -> None:
    """Every victim is the newest member of the youngest running group (by its oldest
    member): a request never pays for a group made only of requests younger than it."""
    seen = []
    choose = FeatherRuntime.preemption_victim

    def recording(self, running):
        victim = choose(self, running)
        seen.append(is_the_newest_of_the_youngest_group(victim, running))
        return victim

    monkeypatch.setattr(FeatherRuntime, "preemption_victim", recording)
    workload = minority_groups(majority=150, minorities=[10, 10], prefix_len=1024,
                               suffix_len=32, output_len=120,
                               arrival=ArrivalSpec(kind="poisson", rate=300), seed=seed)
    plan = SimPlan(workload=workload, hardware=HARDWARE["h100-sxm"],
                   model=MODELS["llama-3-8b"],
                   engine=EngineConfig(num_blocks=300, charge_scheduler_time=False))
    run = simulate(plan, "feather-model")
    assert all(r.success for r in run.records)
    assert len(seen) == summarize(run)["preemptions"] > 0 and all(seen)


# ---- priority classes -------------------------------------------------------------------


def sim_request(index: int, priority: int, arrival_s: float) -> SimRequest:
    spec = RequestSpec(f"r{index}", [1, 2, 3], 4, arrival_s, priority=priority)
    return SimRequest.create(spec, index, EngineConfig())


def test_the_priority_policy_is_vllms_priority_queue() -> None:
    """Waiting by (priority, arrival); a preempted request re-enters by the same key, not
    at the head; the victim is the latest arrival of the least urgent class."""
    policy = PriorityPolicy()
    requests = [sim_request(0, 1, 0.0), sim_request(1, 0, 1.0), sim_request(2, 1, 2.0),
                sim_request(3, 0, 3.0)]
    for request in requests:
        policy.enter_waiting(request)
    order = []
    while len(policy):
        answer = policy.decide()
        request = next(r for r in requests if r.request_id == answer.request_id)
        policy.admit(request)
        order.append(request.request_id)
    assert order == ["r1", "r3", "r0", "r2"]
    assert policy.decide() is None
    assert policy.preemption_victim(requests).request_id == "r2"
    assert policy.preemption_victim(requests[1::2]).request_id == "r3"
    requests[2].preemptions = 1
    for request in (requests[3], requests[2], requests[0]):
        policy.enter_waiting(request)
    assert policy.decide().request_id == "r3"
    with pytest.raises(RuntimeError, match="not the head"):
        policy.admit(requests[0])


def mixed_classes(seed: int = 0, share: float = 0.1):
    workload = shared_prefix_groups(groups=6, prompts_per_group=40, prefix_len=2048,
                                    suffix_len=32, output_len=60,
                                    arrival=ArrivalSpec(kind="poisson", rate=150), seed=seed)
    return prioritized(workload, share, seed=seed)


def test_the_urgent_class_goes_first_under_priority_and_feather_and_not_under_fcfs() -> None:
    plan = plan_for(mixed_classes(), [], max_num_seqs=32)
    runs = {name: summarize(simulate(plan, name)) for name in
            ("fcfs", "priority", "feather-model")}
    for summary in runs.values():
        assert summary["completed"] == 240
        assert [c["requests"] for c in summary["by_priority"].values()] == [24, 216]
    ttft = {name: s["by_priority"]["0"]["mean_ttft_ms"] for name, s in runs.items()}
    assert ttft["priority"] < 0.5 * ttft["fcfs"] and ttft["feather-model"] < 0.5 * ttft["fcfs"]
    fcfs_rest = runs["fcfs"]["by_priority"]["1"]["mean_ttft_ms"]
    assert runs["fcfs"]["by_priority"]["0"]["mean_ttft_ms"] == pytest.approx(fcfs_rest, rel=0.5)


@pytest.mark.parametrize(("name", "rule"), [("priority", is_the_latest_arrival),
                                            ("feather-model", is_the_newest_of_the_youngest_group)])
def test_the_victim_comes_from_the_least_urgent_class(name: str, rule, monkeypatch) -> None:
    seen = []
    policy_of = make_policy

    def recording(*args):
        policy = policy_of(*args)
        choose = policy.preemption_victim

        def victim(running):
            chosen = choose(running)
            seen.append(rule(chosen, running))
            return chosen

        policy.preemption_victim = victim
        return policy

    monkeypatch.setattr("feather_sched.sim.runner.make_policy", recording)
    workload = prioritized(minority_groups(
        majority=150, minorities=[10, 10], prefix_len=1024, suffix_len=32, output_len=120,
        arrival=ArrivalSpec(kind="poisson", rate=300), seed=1), 0.3, seed=1)
    plan = SimPlan(workload=workload, hardware=HARDWARE["h100-sxm"],
                   model=MODELS["llama-3-8b"],
                   engine=EngineConfig(num_blocks=300, charge_scheduler_time=False))
    summary = summarize(simulate(plan, name))
    assert summary["completed"] == 170
    assert len(seen) == summary["preemptions"] > 0 and all(seen)
    by_class = summary["by_priority"]
    assert by_class["0"]["preemptions"] < by_class["1"]["preemptions"]


# ---- tenants ----------------------------------------------------------------------------


def tenant_request(index: int, tenant: str, prompt_len: int = 3) -> SimRequest:
    spec = RequestSpec(f"{tenant}{index}", list(range(1, prompt_len + 1)), 4, 0.0,
                       tenant=tenant)
    return SimRequest.create(spec, index, EngineConfig())


def test_vtc_admits_the_least_served_tenants_oldest_charging_prompts_whole() -> None:
    """The simulator's ``vtc`` is Feather's runtime in ``fairness: vtc``: what vLLM's
    runs too."""
    policy = make_policy("vtc", {}, SimEngine(None, EngineConfig()))
    assert isinstance(policy, FeatherRuntime) and policy.config.fairness == "vtc"
    assert policy.layout is BatchLayout.ENGINE
    requests = [tenant_request(0, "a", 100), tenant_request(1, "a"), tenant_request(2, "b"),
                tenant_request(3, "b")]
    for request in requests:
        policy.enter_waiting(request)
    order: list[SimRequest] = []
    policy.begin_pass(order)
    while (answer := policy.decide()) is not None:
        request = next(r for r in requests if r.request_id == answer.request_id)
        policy.admit(request)
        order.append(request)
    assert [r.request_id for r in order] == ["a0", "b2", "b3", "a1"]  # a0's 100 tokens
    share = policy.queue.share
    assert share.service("a") == 103 and share.service("b") == 6
    policy.served("b2", computed_tokens=50, generated_tokens=2)  # the prompt counted once
    assert share.service("b") == 10
    assert policy.preemption_victim(order) is order[-1]  # vLLM FCFS's: the latest admitted
    assert policy.discard("b2") and not policy.discard("b2")


def tenants_flooding(seed: int = 0):
    return multi_tenant(tenants=3, requests_per_tenant=30, prefix_len=2048, suffix_len=32,
                        output_len=40, arrival=ArrivalSpec("poisson", 200), seed=seed)


def test_fair_share_keeps_the_service_gap_within_the_target_of_vtc_s() -> None:
    """The flooding tenant's shared prefix wins the tree's ranking; fair share keeps the
    largest service gap between the tenants within 1.5x VTC's on the same run (1.03x
    when written, 32 seats: the long-output tenant holds its third of them), and the
    records carry what the engine computed for each request."""
    plan = SimPlan.from_options(tenants_flooding(), schedulers=[], num_blocks=3000,
                                max_num_seqs=32)
    gaps = {name: summarize(simulate(plan, name))["max_service_gap"]
            for name in ("vtc", "feather-model-fair")}
    assert gaps["feather-model-fair"] <= 1.5 * gaps["vtc"]
    run = simulate(plan, "feather-model-fair")
    flood = [r for r in run.records if r.tenant == "t0"]
    assert sum(r.computed_tokens for r in flood) < sum(r.prompt_len for r in flood) / 4


def test_an_urgent_request_preempts_a_less_urgent_one_for_kv_room() -> None:
    """Two long class-1 requests fill the pool; a class-0 one arriving later preempts the
    newest of them at once (its TTFT one prefill), and with the option off it waits until
    their growth preempts one."""
    specs = [RequestSpec(f"low{i}", list(range(1 + 1000 * i, 1001 + 1000 * i)), 400, 0.0,
                         priority=1) for i in range(2)]
    specs.append(RequestSpec("urgent", list(range(5000, 5500)), 4, 0.05, priority=0))
    workload = Workload("urgent", specs)

    def run(options: dict) -> dict:
        engine = SimEngine(CostModel(HARDWARE["h100-sxm"], MODELS["llama-3-8b"]),
                           EngineConfig(num_blocks=155, max_num_seqs=8))
        result = engine.run(workload, make_policy("feather-model", options, engine))
        return {r.request_id: r for r in result.records}

    preempting, waiting = run({}), run({"max_urgent_preemptions": 0})
    assert preempting["urgent"].ttft_s < 0.1 < waiting["urgent"].ttft_s
    assert preempting["low1"].preemptions >= 1 and all(r.success for r in preempting.values())
