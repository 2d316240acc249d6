"""The radix-tree baseline answers like brute force, so its timings measure real work."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from feather_sched.bench.cht.radix_baseline import IN_BATCH_CHECK_TOKENS, TokenRadixTree, lpm_order

token_lists = st.lists(st.lists(st.integers(0, 2), max_size=12), max_size=12)


def longest_stored_prefix(stored: list[list[int]], query: list[int]) -> int:
    best = 0
    for tokens in stored:
        n = 0
        while n < min(len(tokens), len(query)) and tokens[n] == query[n]:
            n += 1
        best = max(best, n)
    return best


@given(token_lists, token_lists)
def test_match_prefix_is_the_longest_stored_prefix(stored, queries) -> None:
    tree = TokenRadixTree()
    for tokens in stored:
        tree.insert(tokens)
    for query in queries + stored:
        assert tree.match_prefix(query) == longest_stored_prefix(stored, query)


def test_lpm_puts_cached_prefixes_first_and_pushes_back_in_batch_duplicates() -> None:
    shared = list(range(100, 100 + IN_BATCH_CHECK_TOKENS + 8))
    cache = TokenRadixTree()
    cache.insert([7] * 50)
    waiting = [
        [*shared, 1],      # 0: nothing cached, first of its prefix
        [7] * 40 + [2],    # 1: 40 cached tokens
        [*shared, 3],      # 2: shares 40 tokens with request 0: pushed back
        [7] * 10 + [4],    # 3: 10 cached tokens
        [5, 6],            # 4: nothing
    ]
    assert lpm_order(cache, waiting) == [1, 3, 0, 4, 2]
