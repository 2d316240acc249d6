"""Prefix groups and shared tokens: one notion, checked against a brute-force model."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from feather_sched.cht import token_chunk_keys
from feather_sched.prefix import (
    SharedPrefixes,
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


def test_order_by_group_puts_large_groups_first_and_keeps_member_order() -> None:
    running = ["a1", "b1", "c1", "a2", "b2", "a3", "c2", "d1"]
    ordered = order_by_group(running, lambda r: r[0])
    assert ordered == ["a1", "a2", "a3", "b1", "b2", "c1", "c2", "d1"]
    # the engine preempts from the end: the latest member of the smallest, latest group
    assert order_by_group(["x1", "y1", "x2", "y2", "z1"], lambda r: r[0])[-1] == "z1"
