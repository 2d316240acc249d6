"""Simulated engines behind a router: one clock, every request once, groups kept together."""

from __future__ import annotations

import pytest

from feather_sched.costmodel.cost import CostModel
from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS
from feather_sched.routing.baselines import make_router
from feather_sched.routing.feather import FeatherRouter
from feather_sched.sim.engine import EngineConfig, SimEngine
from feather_sched.sim.fcfs import FcfsPolicy
from feather_sched.sim.policies import make_policy
from feather_sched.sim.replicas import (
    Ingresses,
    precise_index,
    run_replicas,
    simulate_replicas,
)
from feather_sched.sim.runner import SimPlan
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import shared_prefix_groups

CONFIG = EngineConfig(num_blocks=2048, charge_scheduler_time=False)


def workload(rate: float, groups: int = 4, per_group: int = 8):
    return shared_prefix_groups(groups=groups, prompts_per_group=per_group, prefix_len=512,
                                suffix_len=16, output_len=8, jitter=0.5,
                                arrival=ArrivalSpec(kind="poisson", rate=rate), seed=3)


def engine() -> SimEngine:
    return SimEngine(CostModel(HARDWARE["h100-sxm"], MODELS["llama-3-8b"]), CONFIG)


def plan(rate: float, groups: int = 4) -> SimPlan:
    return SimPlan(workload=workload(rate, groups), hardware=HARDWARE["h100-sxm"],
                   model=MODELS["llama-3-8b"], engine=CONFIG)


@pytest.mark.parametrize("scheduler", ["fcfs", "feather-bandit"])
def test_every_request_ends_once_over_replicas(scheduler: str) -> None:
    load = plan(rate=400.0)
    result = simulate_replicas(load, make_router("power-of-two", range(3), seed=2), scheduler)
    ids = [r.request_id for r in result.run.records]
    assert ids == [spec.request_id for spec in load.workload]
    assert all(r.success and r.output_len == spec.output_len
               for r, spec in zip(result.run.records, load.workload, strict=True))
    assert sum(s.requests for s in result.replicas) == len(ids)
    assert all(s.busy_s > 0 for s in result.replicas)
    assert 1.0 <= result.imbalance <= 3.0
    summary = result.summary()
    assert summary["completed"] == len(ids) and len(summary["groups_per_replica"]) == 3


def test_one_replica_is_the_plain_engine() -> None:
    load = workload(rate=300.0)
    plain = engine()
    alone = plain.run(load, make_policy("feather-bandit", {}, plain))
    single = engine()
    routed = run_replicas(load, FeatherRouter(["only"]),
                          {"only": (single, make_policy("feather-bandit", {}, single))},
                          name="one")
    assert [r.token_times_s for r in routed.run.records] == \
        [r.token_times_s for r in alone.records]
    assert routed.run.duration_s == alone.duration_s
    assert len(routed.run.steps or []) == len(alone.steps)


class Spy(FeatherRouter):
    """Records how many requests are in flight when each is routed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight: list[int] = []

    def _choose(self, keys, session):
        self.in_flight.append(len(self))
        return super()._choose(keys, session)


def test_the_router_sees_finishes_at_their_simulated_time() -> None:
    """At each arrival the router counts exactly the earlier requests not yet finished
    at that simulated time (not those a step already running will finish later)."""
    spy = Spy(range(3))
    records = simulate_replicas(plan(rate=200.0), spy, "fcfs").run.records
    expected = [sum(1 for earlier in records[:i] if earlier.finished_s > r.submitted_s)
                for i, r in enumerate(records)]
    assert spy.in_flight == expected
    assert max(expected) > 1


def test_feather_routing_keeps_each_group_on_one_replica_while_load_allows() -> None:
    light = plan(rate=20.0)
    kept = simulate_replicas(light, FeatherRouter(range(4)), "fcfs")
    assert sum(s.groups for s in kept.replicas) == 4  # no group split
    scattered = simulate_replicas(light, make_router("round-robin", range(4)), "fcfs")
    assert sum(s.groups for s in scattered.replicas) > 4


def test_router_and_engines_must_agree_on_replicas() -> None:
    sim = engine()
    with pytest.raises(ValueError, match="not the engines"):
        run_replicas(workload(10.0), FeatherRouter(range(2)), {0: (sim, FcfsPolicy())}, "x")


def test_a_precise_router_holds_exactly_what_each_engines_pool_caches() -> None:
    small = EngineConfig(num_blocks=96, charge_scheduler_time=False)  # replicas evict
    load = SimPlan(workload=workload(rate=100.0, groups=6), hardware=HARDWARE["h100-sxm"],
                   model=MODELS["llama-3-8b"], engine=small)
    index = precise_index(small)
    router = FeatherRouter(range(3), index=index)
    engines = {}
    for replica in router.replicas:
        sim = SimEngine(CostModel(HARDWARE["h100-sxm"], MODELS["llama-3-8b"]), small)
        engines[replica] = (sim, FcfsPolicy())
    result = run_replicas(load.workload, router, engines, "precise")
    assert all(r.success for r in result.run.records)
    for replica, (sim, _) in engines.items():
        assert index.cache.blocks(replica) == sim.pool.num_cached > 0
        assert all(index.cache.holds(replica, key) for key in sim.pool._cached)
    assert any(sim.pool.num_cached < sum(len(set(r.keys)) for r in sim.requests)
               for sim, _ in engines.values())  # something was evicted


def test_ingresses_deal_requests_in_turn_and_each_sees_all_events() -> None:
    load = plan(rate=200.0)
    routers = [FeatherRouter(range(2), index=precise_index(CONFIG)) for _ in range(2)]
    result = simulate_replicas(load, Ingresses(routers), "fcfs")
    assert [r.request_id for r in result.run.records] == \
        [spec.request_id for spec in load.workload]
    assert all(len(r) == 0 for r in routers)
    assert routers[0].index.cache.blocks(0) == routers[1].index.cache.blocks(0) > 0
    with pytest.raises(ValueError, match="same replicas"):
        Ingresses([FeatherRouter(range(2)), FeatherRouter(range(3))])
