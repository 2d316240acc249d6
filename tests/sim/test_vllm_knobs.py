"""vLLM's knobs replayed in the simulator (their order against vLLM 0.34's own scheduler:
tests/integrations/vllm/test_vllm_knobs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS
from feather_sched.gates.base import Decision
from feather_sched.scheduler_names import parse_scheduler
from feather_sched.sim.engine import EngineConfig, SimEngine
from feather_sched.sim.policies import make_policy
from feather_sched.sim.runner import SimPlan, simulate
from feather_sched.sim.vllm_knobs import ActiveCapPolicy, CacheAwarePolicy, reorder_window
from feather_sched.workloads.synthetic import shared_prefix_groups


class Pool:
    block_tokens = 16

    def __init__(self, cached: set, usage: float) -> None:
        self.cached, self.usage = cached, usage

    def match(self, keys: list) -> list:
        n = 0
        while n < len(keys) and keys[n] in self.cached:
            n += 1
        return keys[:n]


def req(name: str, group: str, blocks: int, preemptions: int = 0) -> SimpleNamespace:
    keys = [f"{group}{i}" for i in range(blocks)] + [name]
    return SimpleNamespace(request_id=name, keys=keys, num_tokens=16 * len(keys) + 1,
                           preemptions=preemptions)


def order(policy) -> list[str]:
    policy.begin_pass([])
    names = []
    while (offer := policy.decide()) is not None:
        names.append(offer.request_id)
        policy.admit(policy._queue[0])
    return names


def test_the_window_moves_only_movable_requests_into_their_own_slots() -> None:
    cached = {"a": 0, "b": 5, "c": 9, "d": 5, "e": 1}
    moved = reorder_window(list("abcde"), lambda r: r != "c", cached.get)
    assert moved == ["b", "d", "c", "e", "a"]
    assert reorder_window(list("ab"), lambda r: r == "a", cached.get) == ["a", "b"]


@pytest.mark.parametrize(("usage", "window", "expected"), [
    (0.6, 8, ["stuck", "warm1", "warm2", "cold1", "cold2"]),
    (0.4, 8, ["stuck", "cold1", "warm1", "cold2", "warm2"]),   # below the threshold
    (0.6, 3, ["stuck", "warm1", "cold1", "cold2", "warm2"]),   # warm2 past the window
])
def test_cache_aware_admission_as_vllm_034(usage: float, window: int, expected) -> None:
    pool = Pool({"w0", "w1", "w2"}, usage)
    policy = CacheAwarePolicy(SimpleNamespace(pool=pool), window, 0.5)
    # a preempted request goes back to the head, and keeps its slot there
    for request in (req("cold1", "c", 3), req("stuck", "s", 3, preemptions=1),
                    req("warm1", "w", 3), req("cold2", "d", 3), req("warm2", "w", 3)):
        policy.enter_waiting(request)
    assert order(policy) == expected


def test_the_active_cap_stops_admission_at_the_cap() -> None:
    policy = ActiveCapPolicy(2)
    for name in "abc":
        policy.enter_waiting(req(name, name, 1))
    running = policy.begin_pass([req("r", "r", 1)])
    offer = policy.decide()
    assert offer.decision is Decision.ADD
    policy.admit(policy._queue[0])
    running.append("admitted")
    assert policy.decide().decision is Decision.STOP


def test_knob_names_parse_with_defaults_and_reject_bad_values() -> None:
    assert parse_scheduler("vllm-cache-aware-w32-t0.25").knobs == (
        ("window", 32.0), ("threshold", 0.25))
    assert parse_scheduler("vllm-cache-aware-t0").knob("window") == 256
    assert parse_scheduler("vllm-active-cap-noshared").knob("cap") == 64
    assert parse_scheduler("vllm-active-cap-8-shared").shared_prefix is True
    engine = SimEngine(None, EngineConfig())
    assert make_policy("vllm-active-cap-8", {}, engine).cap == 8
    with pytest.raises(ValueError, match="unknown scheduler"):
        parse_scheduler("vllm-active-cap-8x")
    with pytest.raises(ValueError, match="threshold"):
        make_policy("vllm-cache-aware-t2", {}, engine)


def test_a_capped_run_never_runs_more_than_its_cap() -> None:
    workload = shared_prefix_groups(groups=4, prompts_per_group=16, prefix_len=512,
                                    suffix_len=16, output_len=20)
    plan = SimPlan(workload, HARDWARE["h100-sxm"], MODELS["llama-3-8b"])
    capped = simulate(plan, "vllm-active-cap-8")
    assert max(step.batch_size for step in capped.steps) <= 8
    assert len(capped.records) == 64 and not any(r.error for r in capped.records)
