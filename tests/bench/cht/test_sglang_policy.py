"""SGLang's real scheduler, timed: LPM must do real work, above 128 requests too."""

import math

import numpy as np
import pytest

from feather_sched.bench.cht.sglang_policy import PolicyTiming, sglang_installed, time_sglang_policy

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

PREFIX, SUFFIX, GROUPS, CACHED_GROUP = 256, 16, 4, 2


def _group_prompts(count: int, seed: int = 0) -> tuple[list[np.ndarray], list[int]]:
    """``count`` prompts cycling through GROUPS fixed prefixes, plus each one's group.

    The prefixes are the same for every call; ``seed`` only draws the suffixes.
    """
    prefix_rng, suffix_rng = np.random.default_rng(0), np.random.default_rng(seed)
    prefixes = [prefix_rng.integers(1, 32_000, PREFIX, dtype=np.int32) for _ in range(GROUPS)]
    groups = [index % GROUPS for index in range(count)]
    prompts = [
        np.concatenate([prefixes[g], suffix_rng.integers(1, 32_000, SUFFIX, dtype=np.int32)])
        for g in groups
    ]
    return prompts, groups


def _run(policy: str, count: int, repeats: int = 2) -> tuple[PolicyTiming, list[list[int]]]:
    """Time ``policy`` with one running request of CACHED_GROUP; return the orders seen."""
    waiting, _ = _group_prompts(count)
    running, _ = _group_prompts(GROUPS, seed=1)
    orders: list[list[int]] = []
    timing = time_sglang_policy(
        policy, waiting, [running[CACHED_GROUP]], repeats=repeats, observe=orders.append
    )
    return timing, orders


def _assert_cached_group_first(count: int, orders: list[list[int]]) -> None:
    _, groups = _group_prompts(count)
    per_group = count // GROUPS
    for order in orders:
        assert sorted(order) == list(range(count))
        assert {groups[i] for i in order[:per_group]} == {CACHED_GROUP}
        assert {groups[i] for i in order[per_group:]} == set(range(GROUPS)) - {CACHED_GROUP}


def test_lpm_puts_requests_matching_the_cache_first() -> None:
    timing, orders = _run("lpm", 40)
    assert len(orders) == 2
    _assert_cached_group_first(40, orders)
    assert timing.policy == "lpm"


def test_prefix_match_cap_is_restored_after_timing() -> None:
    from sglang.srt.managers import schedule_policy
    from sglang.srt.runtime_context import get_context

    published_before = get_context().is_config_namespace_published("disagg")
    _run("lpm", 8, repeats=1)
    assert schedule_policy.WAITING_QUEUE_PREFIX_MATCH_MAX == 128
    assert get_context().is_config_namespace_published("disagg") == published_before


def test_lpm_still_reorders_above_the_128_request_cap() -> None:
    _, orders = _run("lpm", 200)
    _assert_cached_group_first(200, orders)


def test_dfs_weight_runs_and_times_positive() -> None:
    timing, orders = _run("dfs-weight", 40)
    assert timing.policy == "dfs-weight"
    assert timing.decision_ms > 0 and timing.insert_us_per_request > 0
    assert math.isfinite(timing.decision_ms)
    _assert_cached_group_first(40, orders)


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        time_sglang_policy("fcfs", [], [])
