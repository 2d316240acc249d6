"""sim.programs: the closed loop of agent turns, output blocks cached for the next turn,
and the three retentions (LRU, CacheTTL's pins, Feather's sessions) within their bounds."""

from __future__ import annotations

from itertools import pairwise

import pytest

from feather_sched.core.sessions import RetentionConfig
from feather_sched.results.summary import summarize
from feather_sched.sim import programs
from feather_sched.sim.engine import SimEngine
from feather_sched.sim.policies import make_policy
from feather_sched.sim.runner import SimPlan
from feather_sched.workloads.agents import AgentShape, AgentWorkload, LogNormal, agent_programs
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import shared_prefix_groups

SMALL = AgentShape(agent_types=2, system_tokens=LogNormal(512, 0.2, 256, 1024),
                   task_tokens=LogNormal(200, 0.5, 32, 800),
                   turns=LogNormal(4, 0.5, 2, 8), output_tokens=LogNormal(20, 0.5, 4, 64),
                   tool_output_tokens=LogNormal(100, 0.8, 8, 600),
                   tool_s=LogNormal(0.5, 1.0, 0.01, 5.0))


def setup(kind: str, seed: int = 0, programs_n: int = 12, num_blocks: int = 2000,
          share: float = 0.5):
    agents = agent_programs(programs=programs_n, arrival=ArrivalSpec("poisson", 4.0),
                            shape=SMALL, seed=seed)
    plan = SimPlan.from_options(agents.open_loop(), num_blocks=num_blocks,
                                charge_scheduler_time=False)
    engine = SimEngine(plan.cost_model("fcfs"), plan.engine_config())
    turns = programs.Turns.of(agents)
    reload_s = programs.reload_seconds(engine.cost_model, 8192)
    if kind == "ttl":
        retention = programs.TtlRetention(engine, turns, reload_s)
        policy = programs.ProgramFcfsPolicy(turns.start_s)
    elif kind == "sessions":
        retention = programs.SessionRetention(engine, turns, reload_s,
                                              RetentionConfig(max_held_share=share))
        policy = programs.feather_with_sessions(engine, retention, {"gate": "always"}, kind)
    else:
        retention = programs.LruRetention(engine, turns)
        policy = make_policy(kind, {}, engine)
    return agents, engine, policy, retention


@pytest.mark.parametrize("kind", ["fcfs", "ttl", "sessions", "feather-always"])
def test_each_turn_arrives_its_tool_time_after_its_predecessor_ends(kind):
    agents, engine, policy, retention = setup(kind)
    result = programs.run_programs(engine, policy, agents, retention)
    records = {r.request_id: r for r in result.records}
    assert len(records) == sum(len(p.turns) for p in agents.programs)
    for program in agents.programs:
        for before, after in pairwise(program.turns):
            ended = records[before.spec.request_id].finished_s
            assert records[after.spec.request_id].submitted_s == \
                pytest.approx(ended + after.tool_s)
    assert all(r.success for r in records.values())
    engine.pool.check()
    run = result.run_result()
    run.jobs = True
    summary = summarize(run)
    assert summary["jobs_completed"] == len(agents.programs)
    assert summary["mean_jct_s"] > 0 and len(summary["turn_ttft_ms"]) >= 2


def test_a_next_turn_hits_its_predecessors_prompt_and_output_in_a_roomy_pool():
    agents, engine, policy, retention = setup("fcfs", programs_n=4, num_blocks=20000)
    records = {r.request_id: r for r in
               programs.run_programs(engine, policy, agents, retention).records}
    for program in agents.programs:
        for before, after in pairwise(program.turns):
            grown = before.spec.prompt.size + before.spec.output_len - 1  # KV computed
            assert records[after.spec.request_id].cached_tokens == grown // 16 * 16


def test_sessions_hold_within_their_bound_under_pressure():
    """A pool of a few programs' worth, four seeds: the blocks held never exceed the
    share, holds are released (expiry, next turn, displacement or a stall), every turn
    ends.  A seed whose gaps outlast what a reload costs against its hold makes none."""
    shares = []
    for seed in range(4):
        agents, engine, policy, retention = setup("sessions", seed, programs_n=16,
                                                  num_blocks=600, share=0.3)
        result = programs.run_programs(engine, policy, agents, retention)
        assert all(r.success for r in result.records)
        counts = retention.counts()
        assert counts["max_held_share"] <= 0.3
        assert (counts["held"] > 0) is (counts["max_held_share"] > 0)
        assert retention.held == {}  # nothing is held once every program has ended
        engine.pool.check()
        shares.append(counts["max_held_share"])
    assert max(shares) > 0.25  # the bound was reached for


def test_ttl_pins_are_released_and_the_pool_stays_consistent():
    agents, engine, policy, retention = setup("ttl", programs_n=16, num_blocks=600)
    result = programs.run_programs(engine, policy, agents, retention)
    assert all(r.success for r in result.records)
    counts = retention.counts()
    assert counts["released_at_next_turn"] + counts["expiries"] + \
        counts["released_when_stalled"] > 0
    engine.pool.check()


def test_without_sessions_feather_with_sessions_is_feather():
    """No loss where there are no sessions: single-turn requests are never held nor
    promoted, so every request's times are Feather's own."""
    workload = shared_prefix_groups(groups=6, prompts_per_group=10, prefix_len=900,
                                    suffix_len=120, output_len=24,
                                    arrival=ArrivalSpec("poisson", 40.0), seed=2)
    plan = SimPlan.from_options(workload, num_blocks=700, charge_scheduler_time=False)
    plain = SimEngine(plan.cost_model("fcfs"), plan.engine_config())
    expected = plain.run(workload, make_policy("feather-always", {}, plain)).records
    engine = SimEngine(plan.cost_model("fcfs"), plan.engine_config())
    agents = AgentWorkload.single_turns(workload)
    retention = programs.SessionRetention(engine, programs.Turns.of(agents),
                                          programs.reload_seconds(engine.cost_model, 8192))
    policy = programs.feather_with_sessions(engine, retention, {"gate": "always"}, "s")
    got = programs.run_programs(engine, policy, agents, retention).records
    assert [(r.request_id, r.token_times_s) for r in got] == \
        [(r.request_id, r.token_times_s) for r in expected]
    assert retention.counts()["held"] == 0
