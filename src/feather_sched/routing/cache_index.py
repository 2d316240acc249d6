"""What each replica's KV cache really holds, from its engine's own events.

Engine-agnostic (imports no engine): an engine reports, per replica, the prompt blocks it
caches and evicts as ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events named
by its chained block hashes (vLLM's KV events; the simulator's block pool emits the same),
in numbered batches.  ``EventFeed`` applies one replica's batches in order, recovering
missed ones through a replay callback or by clearing that replica's entries;
``CacheIndex`` keeps per replica exactly the blocks it holds and answers how many leading
blocks of a prompt each replica holds.  ``PreciseIndex`` is what ``FeatherRouter`` routes
by: the cache index plus the prompts routed to each replica and not finished (their blocks
are about to be stored there).  Block hashes are chained, so a prompt's hashes, computed
by the router exactly as the engine does (``BlockHasher``), are looked up as they are.
Not thread-safe: callers that feed events from another thread hold one lock
around every call (``EventFeed`` takes that lock itself).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from itertools import accumulate, repeat
from operator import and_
from typing import Any, NamedTuple

from feather_sched.core.isolation import SHARED, Namespace, engine_keys
from feather_sched.routing.prefix_index import PrefixIndex, Replica

BlockHash = Hashable


class BlockStored(NamedTuple):
    """Blocks a replica cached: their hashes in prompt order, the hash of the block before
    the first (None at a prompt's start), their token ids (empty where the engine does not
    send them, as the simulator) and the tokens a block holds."""

    hashes: Sequence[BlockHash]
    parent: BlockHash | None
    token_ids: Sequence[int]
    block_size: int


class BlockRemoved(NamedTuple):
    """Blocks a replica evicted."""

    hashes: Sequence[BlockHash]


class AllBlocksCleared(NamedTuple):
    """A replica dropped its whole prefix cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


BlockHasher = Callable[..., Sequence[BlockHash]]
"""A prompt's chained block hashes exactly as its engine computes them (full blocks only):
``hasher(tokens)``, and ``hasher(tokens, boundary)`` for a request whose engine cache
boundary (``isolation.Namespace.boundary``) is not empty, ValueError where it cannot be
modelled."""


class CacheIndex:
    """Per replica, the blocks its engine holds; per prompt, how many leading blocks each
    replica holds (what its prefix cache would hit, as the engine counts: up to the first
    block missing).

    Each hash maps to a bit mask of its holders (a bit per replica), so ``depths`` is a
    dict look-up per leading block, or per stride of blocks, in C, plus a walk of the
    strides where holders drop out.  A block stored twice on a replica (two copies, as
    vLLM allows) is held until both are removed.  ``stored``/``removed`` O(hashes);
    ``clear``/``drop`` O(the replica's blocks).
    """

    def __init__(self) -> None:
        self._owners: dict[BlockHash, int] = {}
        self._held: dict[Replica, dict[BlockHash, int]] = {}
        """Per replica, its blocks and how many copies of each."""
        self._bit: dict[Replica, int] = {}
        self._by_bit: dict[int, Replica] = {}

    def __len__(self) -> int:
        """Distinct blocks some replica holds."""
        return len(self._owners)

    @property
    def replicas(self) -> list[Replica]:
        return list(self._held)

    def blocks(self, replica: Replica) -> int:
        """Distinct blocks ``replica`` holds."""
        return len(self._held[replica])

    def holds(self, replica: Replica, block: BlockHash) -> bool:
        return block in self._held[replica]

    def add_replica(self, replica: Replica) -> None:
        """A replica known to hold nothing yet (no-op for one already known)."""
        if replica in self._held:
            return
        bit = 1
        while bit in self._by_bit:
            bit <<= 1
        self._bit[replica], self._by_bit[bit] = bit, replica
        self._held[replica] = {}

    def drop(self, replica: Replica) -> None:
        """Forget a replica (a dead one): its entries and its bit."""
        if replica in self._held:
            self.clear(replica)
            del self._held[replica], self._by_bit[self._bit.pop(replica)]

    def clear(self, replica: Replica) -> None:
        """``replica`` holds nothing (its cache was cleared, or its events were lost); no-op
        for a replica not known."""
        if replica not in self._held:
            return
        owners, clear = self._owners, ~self._bit[replica]
        for block in self._held[replica]:
            mask = owners[block] & clear
            if mask:
                owners[block] = mask
            else:
                del owners[block]
        self._held[replica] = {}

    def stored(self, replica: Replica, blocks: Iterable[BlockHash]) -> None:
        owners, held, bit = self._owners, self._held[replica], self._bit[replica]
        for block in blocks:
            copies = held.get(block, 0)
            held[block] = copies + 1
            if not copies:
                owners[block] = owners.get(block, 0) | bit

    def removed(self, replica: Replica, blocks: Iterable[BlockHash]) -> None:
        """Blocks evicted; one the index does not hold for ``replica`` is ignored (its store
        came before the events this index has)."""
        owners, held, clear = self._owners, self._held[replica], ~self._bit[replica]
        for block in blocks:
            copies = held.get(block, 0)
            if copies > 1:
                held[block] = copies - 1
            elif copies:
                del held[block]
                mask = owners[block] & clear
                if mask:
                    owners[block] = mask
                else:
                    del owners[block]

    def apply(self, replica: Replica, events: Iterable[KVEvent]) -> None:
        """One batch of a replica's events, in order (none for a replica not known: one
        dropped while its events were on their way)."""
        if replica not in self._held:
            return
        for event in events:
            if isinstance(event, BlockStored):
                self.stored(replica, event.hashes)
            elif isinstance(event, BlockRemoved):
                self.removed(replica, event.hashes)
            else:
                self.clear(replica)

    def depths(self, blocks: Sequence[BlockHash], stride: int = 1) -> dict[Replica, int]:
        """Leading ``blocks`` each replica holds, for the replicas holding the first.

        ``stride`` > 1 looks up the first block and every ``stride``-th one (and the
        last), and block by block only the strides where a replica drops out: O(blocks /
        stride + stride * drop-outs).  Exact where each replica's cached blocks are a
        prefix between two look-ups, as an engine's are when it evicts a prompt's blocks
        tail first (vLLM frees a request's blocks in reverse); a hole inside a stride
        whose last block is held is not seen.
        """
        owners = self._owners
        if not blocks or blocks[0] not in owners:
            return {}
        ends = list(range(stride - 1, len(blocks), stride))
        if not ends or ends[-1] != len(blocks) - 1:
            ends.append(len(blocks) - 1)
        # running intersection of holders at each look-up
        alive = accumulate(map(owners.get, map(blocks.__getitem__, ends), repeat(0)), and_,
                           initial=owners[blocks[0]])
        found: dict[Replica, int] = {}
        mask, start = next(alive), 1
        for end, probed in zip(ends, alive, strict=True):
            if probed & mask != mask:
                mask = self._refine(blocks, start, end, mask, found)
                if not mask:
                    return found
            start = end + 1
        self._record(mask, len(blocks), found)
        return found

    def _refine(self, blocks: Sequence[BlockHash], start: int, end: int, mask: int,
                found: dict[Replica, int]) -> int:
        """Walk ``blocks[start:end + 1]`` recording where the replicas of ``mask`` stop
        holding; returns those holding all of them."""
        owners = self._owners
        for i in range(start, end + 1):
            left = mask & owners.get(blocks[i], 0)
            if left != mask:
                self._record(mask & ~left, i, found)
                mask = left
        return mask

    def _record(self, bits: int, depth: int, found: dict[Replica, int]) -> None:
        while bits:
            low = bits & -bits
            found[self._by_bit[low]] = depth
            bits ^= low


class EventFeed:
    """One replica's numbered event batches applied to a ``CacheIndex`` exactly in order.

    Batches carry consecutive sequence numbers from 0 (vLLM's publisher counts from 0 for
    the engine's life).  A batch after a gap first replays the missing ones through
    ``replay(first_missing)``, which returns the batches the engine still keeps from there
    on (or None when it cannot replay); what the replay does not cover is recovered by
    clearing the replica's entries and applying the contiguous run of batches it did
    return that ends at the gap.  ``catch_up`` applies what the engine published before
    this feed subscribed.  A live number lower than expected means the engine restarted
    (its entries are cleared and the feed starts over), except just after ``catch_up``,
    where the live stream repeats batches the replay applied.  Index changes are made
    under ``lock`` (replays are not: they wait on the engine).  Counters: ``replayed``
    batches, ``clears`` (lost events or restarts).  O(events) per batch.
    """

    def __init__(self, index: CacheIndex, replica: Replica,
                 replay: Callable[[int], Sequence[tuple[int, Sequence[KVEvent]]] | None]
                 | None = None, lock: AbstractContextManager[Any] | None = None) -> None:
        self.index = index
        self.replica = replica
        self.replay = replay
        self.lock = lock if lock is not None else nullcontext()
        self.next_seq = 0
        """The sequence number expected next."""
        self.replayed = 0
        self.clears = 0
        self._repeats = False  # the live stream may repeat what a catch-up replayed
        with self.lock:
            index.add_replica(replica)

    def receive(self, seq: int, events: Sequence[KVEvent]) -> None:
        """A batch from the live stream."""
        if seq < self.next_seq:
            if self._repeats:
                return
            self._clear()  # the engine started over (a restarted replica)
            self.next_seq = 0
        self._repeats = False
        if seq > self.next_seq:
            self._replayed(seq)
        with self.lock:
            self.index.apply(self.replica, events)
        self.next_seq = seq + 1

    def catch_up(self) -> None:
        """Apply every batch the engine still keeps from ``next_seq`` on."""
        if self._replayed(None):
            self._repeats = True

    def _replayed(self, until: int | None) -> bool:
        """Replay batches ``next_seq`` .. ``until - 1`` (None: all it keeps) and apply
        them, clearing first what they cannot cover; whether any were applied."""
        start = self.next_seq
        replayed = self.replay(start) if self.replay is not None else None
        got = {s: events for s, events in replayed or ()
               if s >= start and (until is None or s < until)}
        if until is None:
            if not got:
                return False
            until = max(got) + 1
        first = until  # the contiguous run of replayed batches that ends at until - 1
        while first - 1 in got:
            first -= 1
        if first != start:
            self._clear()
        with self.lock:
            for s in range(first, until):
                self.index.apply(self.replica, got[s])
        self.replayed += until - first
        self.next_seq = until
        return until > first

    def _clear(self) -> None:
        with self.lock:
            self.index.clear(self.replica)
        self.clears += 1


class PreciseIndex:
    """``FeatherRouter``'s index from the engines' events.

    A replica holds, of a prompt, the leading blocks its cache holds (``cache``, fed by
    ``EventFeed``s) or that a request routed there and not finished has in its prompt (so
    a burst of a new prefix is not scattered before the first events arrive).  Among
    replicas holding as many blocks, one the prefix was routed to before ranks first, and
    a prefix no cache holds keeps that home (``routed``: a ``PrefixIndex`` over every
    ``chunk_blocks``-th block hash, up to ``max_idle_keys`` chunks kept after); new
    prefixes go to the replicas with the fewest prefixes routed there.  ``keys(tokens,
    namespace)`` are the engine's block hashes (``hasher``) in the namespace.  Depths are
    half-blocks: ``2 * blocks``, plus one for a replica the prefix was routed to before.

    Cost per request: the hasher, ``CacheIndex.depths`` by chunks, and O(chunks) on route
    and finish.
    """

    name = "precise"

    def __init__(self, hasher: BlockHasher, chunk_blocks: int = 1,
                 max_idle_keys: int | None = 1 << 20) -> None:
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be positive, got {chunk_blocks}")
        self.hasher = hasher
        self.chunk_blocks = chunk_blocks
        self.cache = CacheIndex()
        self.routed_chunks = PrefixIndex(max_idle_keys)

    def keys(self, tokens: Sequence[int], namespace: Namespace = SHARED
             ) -> Sequence[BlockHash]:
        hashes = self.hasher(tokens, namespace.boundary) if namespace.boundary else \
            self.hasher(tokens)
        return engine_keys(hashes, namespace.beyond_engine())

    def _chunks(self, keys: Sequence[BlockHash]) -> Sequence[BlockHash]:
        step = self.chunk_blocks
        return keys if step == 1 else keys[step - 1::step]

    def depths(self, keys: Sequence[BlockHash]) -> dict[Replica, int]:
        found = self.cache.depths(keys, self.chunk_blocks)
        chunks, before = self.routed_chunks.match(self._chunks(keys))
        if not found:
            return dict.fromkeys(before, 1)
        flying = chunks * self.chunk_blocks
        for replica, count in before.items():
            if count and found.get(replica, 0) < flying:
                found[replica] = flying
        return {r: 2 * blocks + (r in before) for r, blocks in found.items()}

    def fewest(self, replicas: Sequence[Replica]) -> list[Replica]:
        return self.routed_chunks.fewest_keys(replicas)

    def added(self, replica: Replica) -> None:
        self.cache.add_replica(replica)

    def routed(self, replica: Replica, keys: Sequence[BlockHash]) -> int:
        return self.routed_chunks.add(replica, self._chunks(keys))

    def finished(self, replica: Replica, keys: Sequence[BlockHash]) -> None:
        self.routed_chunks.release(replica, self._chunks(keys))

    def withdrawn(self, replica: Replica, keys: Sequence[BlockHash], known: int) -> None:
        self.routed_chunks.withdraw(replica, self._chunks(keys), known)

    def removed(self, replica: Replica) -> None:
        self.cache.drop(replica)
        self.routed_chunks.drop(replica)
