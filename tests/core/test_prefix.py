"""Prefix groups and shared tokens: one notion, checked against a brute-force model."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from feather_sched.core.cht import token_chunk_keys
from feather_sched.core.prefix import (
    SharedPrefixes,
    gather_groups,
    group_of,
    keys_per_chunk,
    order_by_group,
    shared_tokens,
)


def test_a_group_is_the_first_chunk() -> None:
    assert group_of([7, 8, 9], "r") == 7
    assert group_of([], "r") == ("solo", "r")
    assert group_of([1, 2, 3, 4], "r", keys_per_chunk=4) == 4  # 16-token blocks, 64-token chunk
    assert group_of([1, 2, 3], "r", keys_per_chunk=4) == ("solo", "r")
    assert [keys_per_chunk(b, 128) for b in (16, 128, 256)] == [8, 1, 1]


def brute_force_shared(key_lists: list[list[int]]) -> list[int]:
    """Leading keys another member holds, by comparing every pair."""
    shared = []
    for i, keys in enumerate(key_lists):
        best = 0
        for j, other in enumerate(key_lists):
            if i != j:
                common = 0
                while common < min(len(keys), len(other)) and keys[common] == other[common]:
                    common += 1
                best = max(best, common)
        shared.append(best)
    return shared


prompts = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), max_size=8)


@given(prompts)
def test_shared_tokens_match_pairwise_prefixes(raw: list[list[int]]) -> None:
    key_lists = [token_chunk_keys(prompt, 2) for prompt in raw]
    expected = [n * 2 for n in brute_force_shared(key_lists)]
    assert shared_tokens(key_lists, tokens_per_key=2) == expected


@given(prompts, st.data())
def test_counts_follow_additions_and_removals(raw: list[list[int]], data) -> None:
    key_lists = [token_chunk_keys(prompt, 2) for prompt in raw]
    shared = SharedPrefixes(key_lists)
    keep = data.draw(st.lists(st.booleans(), min_size=len(key_lists), max_size=len(key_lists)))
    for keys, kept in zip(key_lists, keep, strict=True):
        if not kept:
            shared.remove(keys)
    kept_lists = [k for k, kept in zip(key_lists, keep, strict=True) if kept]
    assert [shared.shared_keys(k) for k in kept_lists] == brute_force_shared(kept_lists)


def test_order_by_group_serves_groups_by_their_oldest_member() -> None:
    running = ["b3", "a5", "c2", "a1", "b4", "d6", "c7"]
    ages = [int(r[1]) for r in running]
    ordered = order_by_group(running, [r[0] for r in running], ages)
    assert ordered == ["a1", "a5", "c2", "c7", "b3", "b4", "d6"]
    # the engine preempts from the end: the newest member of the youngest group, even
    # where an older group's member arrived later
    assert order_by_group(["x1", "x9", "y5"], ["x", "x", "y"], [1, 9, 5])[-1] == "y5"


def test_groups_whose_oldest_ages_tie_keep_their_first_members_order() -> None:
    assert order_by_group(["q", "p", "q2"], ["Q", "P", "Q"], [0, 0, 0]) == ["q", "q2", "p"]


def test_gather_groups_moves_members_up_to_their_first_and_nothing_else() -> None:
    requests = ["a1", "x", "b1", "a2", "y", "b2", "a3"]
    groups = [r[0] if r[0] in "ab" else r for r in requests]
    assert gather_groups(requests, groups) == ["a1", "a2", "a3", "x", "b1", "b2", "y"]
    assert gather_groups(["x", "y"], ["x", "y"]) == ["x", "y"]


@given(st.lists(st.integers(0, 5), max_size=40))
def test_gather_groups_is_the_first_seen_bucketing(groups: list[int]) -> None:
    requests = list(range(len(groups)))
    buckets: dict[int, list[int]] = {}
    for request, group in zip(requests, groups, strict=True):
        buckets.setdefault(group, []).append(request)
    assert gather_groups(requests, groups) == [r for bucket in buckets.values() for r in bucket]


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 20)), max_size=30))
def test_order_by_group_is_a_permutation_grouped_and_preempts_the_youngest_group(
        members: list[tuple[int, int]]) -> None:
    requests = list(range(len(members)))
    groups = [group for group, _ in members]
    ages = [(age, i) for i, (_, age) in enumerate(members)]
    ordered = order_by_group(requests, groups, ages)
    assert sorted(ordered) == requests
    runs = [groups[i] for k, i in enumerate(ordered)
            if k == 0 or groups[ordered[k - 1]] != groups[i]]
    assert len(runs) == len(set(runs))  # each group contiguous
    for k in range(1, len(ordered)):
        if groups[ordered[k]] == groups[ordered[k - 1]]:
            assert ages[ordered[k - 1]] < ages[ordered[k]]
    if requests:
        oldest = {g: min(a for a, h in zip(ages, groups, strict=True) if h == g) for g in groups}
        youngest = max(oldest, key=oldest.get)
        assert ordered[-1] == max((i for i in requests if groups[i] == youngest),
                                  key=ages.__getitem__)

