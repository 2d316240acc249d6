"""A paged KV-cache block pool with prefix caching, shaped like vLLM V1's ``BlockPool``.

Every physical block is in exactly one of three states: **free** (no owner, no cached
content, on the free list); **referenced** (owned by one or more running requests:
``ref count`` = number of owners); **evictable** (no owner, but a full prompt block
registered under its chained key, reusable by a later request with the same prefix;
evicted in LRU order of freeing, only when the free list is empty).

A request's full prompt blocks are named by chained keys (``token_chunk_keys(prompt,
block_tokens)``: key *i* identifies the whole prefix through block *i*), so a prefix hit
is the longest run of leading keys present in the cache.  Allocation is all-or-nothing,
as in vLLM's ``allocate_slots``.  With ``emit_events`` the pool reports what it caches
and evicts as vLLM's block pool does (``cache_index.BlockStored`` / ``BlockRemoved``,
taken with ``take_events``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from feather_sched.core.isolation import Namespace, token_keys
from feather_sched.routing.cache_index import BlockRemoved, BlockStored, KVEvent

BlockKey = Hashable
RequestId = Hashable


@dataclass(frozen=True)
class BlockKeys:
    """A prompt's block keys as the simulated engine names its blocks (its "block
    hashes"): ``token_chunk_keys`` at ``block_size`` tokens, in the namespace of the
    request's cache ``boundary`` (``core.isolation``)."""

    block_size: int

    def __call__(self, tokens: np.ndarray | Sequence[int], boundary: tuple = ()) -> list[int]:
        return token_keys(tokens, self.block_size, Namespace(boundary))


def blocks_for(num_tokens: int, block_tokens: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceiling division)."""
    return -(-num_tokens // block_tokens)


class BlockPool:
    """``num_blocks`` KV blocks of ``block_tokens`` tokens, shared through a prefix cache.

    Keys must be hashable and not ``None``.  ``hit_tokens / query_tokens`` counts what
    successful allocations served from the cache (vLLM's prefix-cache hit rate).
    """

    def __init__(self, num_blocks: int, block_tokens: int, emit_events: bool = False) -> None:
        if num_blocks < 1 or block_tokens < 1:
            raise ValueError(
                f"num_blocks and block_tokens must be positive, got {num_blocks}, {block_tokens}"
            )
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.hit_tokens = 0
        self.query_tokens = 0
        self._ref = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockKey, int] = {}
        self._owned: dict[RequestId, list[int]] = {}
        self._registered: dict[RequestId, int] = {}
        """Leading blocks of each request already registered in the cache."""
        self._events: list[KVEvent] | None = [] if emit_events else None
        self.reclaim: Callable[[int], None] | None = None
        """Called with the blocks a running request's ``grow`` lacks, before it fails:
        held blocks (``hold``) that may yield to it are released there."""

    # ---- counters ---------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones (as vLLM)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered under a prefix key, referenced or evictable."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's KV-cache usage)."""
        return self.num_referenced / self.num_blocks

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.query_tokens if self.query_tokens else None

    def blocks_of(self, request_id: RequestId) -> tuple[int, ...]:
        """The physical blocks a request holds, in token order (empty if none)."""
        return tuple(self._owned.get(request_id, ()))

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._owned

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, in order (none unless ``emit_events``)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    # ---- operations -------------------------------------------------------------------

    def match(self, keys: Sequence[BlockKey]) -> list[int]:
        """Physical blocks of the longest cached run of leading ``keys``; no state change."""
        cached = self._cached
        hits = []
        for key in keys:
            block = cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(
        self,
        request_id: RequestId,
        keys: Sequence[BlockKey],
        num_tokens: int,
        *,
        query_tokens: int | None = None,
    ) -> bool:
        """Give a request blocks for ``num_tokens`` tokens, reusing cached leading ``keys``.

        Returns False and changes nothing when too few blocks can be had.  On success the
        hit counters grow by the reused tokens and ``query_tokens`` (default
        ``num_tokens``: pass the request's full length to get vLLM's hit rate).
        """
        if request_id in self._owned:
            raise ValueError(f"request {request_id!r} already holds blocks")
        needed = blocks_for(num_tokens, self.block_tokens)
        hits = self.match(keys[:needed])
        revived = sum(1 for block in hits if not self._ref[block])
        fresh = needed - len(hits)
        if fresh > self.num_free - revived:
            return False
        for block in hits:
            self._reference(block)
        self._owned[request_id] = hits + self._take(fresh)
        self._registered[request_id] = len(hits)
        self.hit_tokens += min(len(hits) * self.block_tokens, num_tokens)
        self.query_tokens += num_tokens if query_tokens is None else query_tokens
        return True

    def grow(self, request_id: RequestId, num_tokens: int) -> bool:
        """Extend a request's blocks to cover ``num_tokens`` tokens in all; all-or-nothing."""
        blocks = self._blocks(request_id)
        fresh = blocks_for(num_tokens, self.block_tokens) - len(blocks)
        if fresh <= 0:
            return True
        if fresh > self.num_free and self.reclaim is not None:
            self.reclaim(fresh - self.num_free)
        if fresh > self.num_free:
            return False
        blocks += self._take(fresh)
        return True

    def free(self, request_id: RequestId) -> None:
        """Release a request's blocks; cached ones become evictable, tail blocks first."""
        blocks = self._blocks(request_id)
        del self._owned[request_id], self._registered[request_id]
        ref, key = self._ref, self._key
        for block in reversed(blocks):
            ref[block] -= 1
            if ref[block]:
                continue
            if key[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None

    def hold(self, request_id: RequestId, holder: RequestId) -> None:
        """Pass a request's blocks to ``holder`` (a session's hold): still referenced, so
        never evicted, until ``free(holder)``."""
        if holder in self._owned:
            raise ValueError(f"holder {holder!r} already holds blocks")
        self._owned[holder] = self._owned.pop(request_id)
        self._registered[holder] = self._registered.pop(request_id)

    def cache_full_blocks(
        self, request_id: RequestId, keys: Sequence[BlockKey], computed_tokens: int
    ) -> None:
        """Register the request's computed full prompt blocks under their keys.

        A key another block already holds (two requests computed the same prefix at
        once) keeps the first block; the duplicate stays private and is freed normally.
        """
        blocks = self._blocks(request_id)
        start = self._registered[request_id]
        end = min(len(keys), len(blocks), computed_tokens // self.block_tokens)
        new = []
        for i in range(start, end):
            key = keys[i]
            if key not in self._cached:
                self._cached[key] = blocks[i]
                self._key[blocks[i]] = key
                new.append(key)
        self._registered[request_id] = max(start, end)
        if new and self._events is not None:
            self._events.append(BlockStored(new, keys[start - 1] if start else None, (),
                                            self.block_tokens))

    # ---- checks -----------------------------------------------------------------------

    def check(self) -> None:
        """Verify every invariant of the pool; raises AssertionError naming the broken one."""
        owners = [0] * self.num_blocks
        for request_id, blocks in self._owned.items():
            assert len(set(blocks)) == len(blocks), f"{request_id!r} owns a block twice"
            for block in blocks:
                owners[block] += 1
        assert owners == self._ref, "ref counts differ from the owners' block lists"
        free, evictable = set(self._free), set(self._evictable)
        referenced = {b for b in range(self.num_blocks) if self._ref[b]}
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not (free & evictable or free & referenced or evictable & referenced)
        assert len(free) + len(evictable) + len(referenced) == self.num_blocks, "blocks leaked"
        assert all(self._key[b] is None for b in free), "a free block still has a key"
        assert all(self._key[b] is not None for b in evictable), "an evictable block has no key"
        keyed = {b: k for b, k in enumerate(self._key) if k is not None}
        assert keyed == {b: k for k, b in self._cached.items()}, "cache index out of sync"

    # ---- internals --------------------------------------------------------------------

    def _blocks(self, request_id: RequestId) -> list[int]:
        try:
            return self._owned[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no blocks") from None

    def _reference(self, block: int) -> None:
        if not self._ref[block]:
            del self._evictable[block]
        self._ref[block] += 1

    def _take(self, count: int) -> list[int]:
        """``count`` fresh blocks, evicting least-recently-freed cached ones if needed."""
        taken, evicted = [], []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                evicted.append(self._key[block])
                del self._cached[self._key[block]]
                self._key[block] = None
            self._ref[block] = 1
            taken.append(block)
        if evicted and self._events is not None:
            self._events.append(BlockRemoved(evicted))
        return taken
