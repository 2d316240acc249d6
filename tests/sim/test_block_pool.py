"""BlockPool: prefix hits, LRU eviction, all-or-nothing allocation, no leaked blocks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from feather_sched.core.cht import token_chunk_keys
from feather_sched.routing.cache_index import CacheIndex
from feather_sched.sim.block_pool import BlockPool, blocks_for

BLOCK = 4


def prompt(group: int, request: int, prefix_len: int, suffix_len: int) -> np.ndarray:
    """A group's prefix followed by a request's own suffix (token ids from disjoint ranges)."""
    prefix = np.random.default_rng(group).integers(1, 1000, prefix_len)
    suffix = np.random.default_rng(10_000 + request).integers(1000, 2000, suffix_len)
    return np.concatenate([prefix, suffix]).astype(np.int32)


def keys(group: int, request: int, prefix_len: int = 10, suffix_len: int = 6) -> list[int]:
    return token_chunk_keys(prompt(group, request, prefix_len, suffix_len), BLOCK)


def state(pool: BlockPool) -> dict:
    return copy.deepcopy(vars(pool))


def computed(pool: BlockPool, request: str, request_keys: list[int], tokens: int) -> None:
    """Allocate and register a request's prompt, as the engine does after a prefill."""
    assert pool.allocate(request, request_keys, tokens)
    pool.cache_full_blocks(request, request_keys, tokens)


def test_second_request_of_a_group_hits_the_groups_full_blocks() -> None:
    pool = BlockPool(num_blocks=16, block_tokens=BLOCK)
    a, b = keys(0, 0), keys(0, 1)  # 16 tokens: blocks 0-1 are prefix, 2 mixes in the suffix
    assert a[:2] == b[:2] and a[2] != b[2]
    computed(pool, "a", a, 16)
    assert (pool.hit_tokens, pool.query_tokens) == (0, 16)
    assert pool.num_cached == 4
    assert pool.match(b) == list(pool.blocks_of("a")[:2])

    assert pool.allocate("b", b, 16)
    assert (pool.hit_tokens, pool.query_tokens) == (8, 32)
    assert pool.hit_rate == 0.25
    assert pool.blocks_of("b")[:2] == pool.blocks_of("a")[:2]
    assert [pool.ref_count(block) for block in pool.blocks_of("b")] == [2, 2, 1, 1]
    assert pool.num_referenced == 6
    pool.check()


def test_freed_cached_blocks_stay_hittable_and_other_groups_miss() -> None:
    pool = BlockPool(num_blocks=16, block_tokens=BLOCK)
    computed(pool, "a", keys(0, 0), 16)
    pool.free("a")
    assert (pool.num_evictable, pool.num_free, pool.num_referenced) == (4, 16, 0)
    assert pool.usage == 0.0
    assert pool.allocate("c", keys(1, 2), 16) and pool.hit_tokens == 0
    assert pool.allocate("b", keys(0, 1), 16, query_tokens=17)
    assert (pool.hit_tokens, pool.query_tokens) == (8, 49)
    assert pool.num_evictable == 2  # a's two suffix blocks; its prefix blocks are b's again
    pool.check()


def test_eviction_takes_least_recently_freed_tail_blocks_first() -> None:
    pool = BlockPool(num_blocks=4, block_tokens=BLOCK)
    a, b = keys(0, 0, 8, 0), keys(1, 1, 8, 0)
    computed(pool, "a", a, 8)
    computed(pool, "b", b, 8)
    pool.free("a")
    pool.free("b")
    assert pool.allocate("c", [], 4)  # evicts a's tail block, freed first
    assert pool.match(a) == list(pool.match(a[:1])) and len(pool.match(a)) == 1
    assert len(pool.match(b)) == 2
    assert pool.grow("c", 12)  # then a's head, then b's tail
    assert pool.match(a) == [] and len(pool.match(b)) == 1
    pool.check()


def test_allocation_never_evicts_its_own_hits() -> None:
    pool = BlockPool(num_blocks=5, block_tokens=BLOCK)
    assert pool.allocate("x", [], 1)
    a = keys(0, 0, 8, 12)
    computed(pool, "a", a, 8)  # two cached blocks, evictable once freed
    pool.free("a")
    assert pool.num_free == 4
    before = state(pool)
    assert not pool.allocate("b", a, 20)  # 2 hits + 3 fresh, but 2 left once hits revive
    assert state(pool) == before
    assert pool.allocate("b", a, 16)
    assert pool.hit_tokens == 8 and pool.num_free == 0
    pool.check()


def test_failures_leave_the_pool_unchanged() -> None:
    pool = BlockPool(num_blocks=6, block_tokens=BLOCK)
    computed(pool, "a", keys(0, 0), 16)
    before = state(pool)
    assert not pool.allocate("b", keys(1, 1), 12)
    assert not pool.grow("a", 4 * BLOCK + 3 * BLOCK)
    assert state(pool) == before
    assert pool.grow("a", 6 * BLOCK) and pool.num_free == 0
    pool.check()


def test_misuse_is_refused() -> None:
    pool = BlockPool(num_blocks=4, block_tokens=BLOCK)
    assert pool.allocate("a", [], 1)
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate("a", [], 1)
    with pytest.raises(KeyError):
        pool.grow("nobody", 4)
    with pytest.raises(KeyError):
        pool.free("nobody")
    with pytest.raises(ValueError):
        BlockPool(0, 16)


REQUESTS = [f"r{i}" for i in range(6)]


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / grow / cache / free sequences on a small pool with three groups."""

    @initialize(num_blocks=st.integers(1, 12))
    def make_pool(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, BLOCK, emit_events=True)
        self.live: dict[str, list[int]] = {}
        self.index = CacheIndex()  # fed the pool's events, as a router is
        self.index.add_replica("pool")

    @rule(request=st.sampled_from(REQUESTS), group=st.integers(0, 2),
          tokens=st.integers(1, 40), prefix_blocks=st.integers(0, 10))
    def allocate(self, request: str, group: int, tokens: int, prefix_blocks: int) -> None:
        if request in self.live:
            return
        request_keys = keys(group, int(request[1:]), 12, 20)[:prefix_blocks]
        hits = self.pool.match(request_keys)[: blocks_for(tokens, BLOCK)]
        before, hit_tokens = state(self.pool), self.pool.hit_tokens
        if self.pool.allocate(request, request_keys, tokens):
            self.live[request] = request_keys
            blocks = self.pool.blocks_of(request)
            assert len(blocks) == blocks_for(tokens, BLOCK)
            assert list(blocks[: len(hits)]) == hits
            assert self.pool.hit_tokens - hit_tokens == min(len(hits) * BLOCK, tokens)
        else:
            assert state(self.pool) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.integers(0, 48))
    def grow(self, data: st.DataObject, tokens: int) -> None:
        request = data.draw(st.sampled_from(sorted(self.live)))
        had = len(self.pool.blocks_of(request))
        before = state(self.pool)
        if self.pool.grow(request, tokens):
            assert len(self.pool.blocks_of(request)) == max(had, blocks_for(tokens, BLOCK))
        else:
            assert state(self.pool) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.integers(0, 48))
    def cache(self, data: st.DataObject, tokens: int) -> None:
        request = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.cache_full_blocks(request, self.live[request], tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.free(request)
        del self.live[request]

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        pool = self.pool
        pool.check()
        owners: dict[int, int] = {}
        for request in self.live:
            blocks = pool.blocks_of(request)
            assert len(set(blocks)) == len(blocks), "a request owns a block twice"
            for block in blocks:
                owners[block] = owners.get(block, 0) + 1
        assert all(pool.ref_count(b) == owners.get(b, 0) >= 0 for b in range(pool.num_blocks))
        assert pool.num_referenced == len(owners)
        free_list = pool.num_free - pool.num_evictable
        assert free_list + pool.num_referenced + pool.num_evictable == pool.num_blocks
        assert free_list >= 0 and pool.num_cached >= pool.num_evictable
        assert 0 <= pool.hit_tokens <= pool.query_tokens

    @invariant()
    def its_events_tell_exactly_what_it_caches(self) -> None:
        self.index.apply("pool", self.pool.take_events())
        assert self.index.blocks("pool") == self.pool.num_cached
        assert all(self.index.holds("pool", key) for key in self.pool._cached)


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_held_blocks_are_never_evicted_until_their_holder_frees_them() -> None:
    pool = BlockPool(num_blocks=4, block_tokens=4)
    assert pool.allocate("a", ["k0", "k1"], 8)
    pool.cache_full_blocks("a", ["k0", "k1"], 8)
    pool.hold("a", "hold:a")
    assert "a" not in pool and pool.num_free == 2
    assert not pool.allocate("b", [], 12)  # the held two are not evictable
    pool.free("hold:a")
    assert pool.num_evictable == 2 and pool.match(["k0", "k1"])
    assert pool.allocate("b", [], 16)  # now they are
    pool.check()


def test_growth_asks_reclaim_for_the_blocks_it_lacks() -> None:
    pool = BlockPool(num_blocks=4, block_tokens=4)
    assert pool.allocate("a", [], 8)
    pool.hold("a", "hold:a")
    assert pool.allocate("b", [], 8)
    asked = []
    pool.reclaim = lambda blocks: (asked.append(blocks), pool.free("hold:a"))
    assert pool.grow("b", 12) and asked == [1]
    pool.check()
