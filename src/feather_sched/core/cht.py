"""Chunked Hash Tree: shared-prefix bookkeeping between waiting and running requests.

A prompt is cut into fixed chunks; chunk *i*'s key digests everything through chunk *i*,
so the chunks of a request that some running request also holds are always a *prefix* of
its key list: every per-request question is a binary search over dict look-ups.  Kept
incrementally: key -> running / waiting holders (``_running_refs``, ``_waiting_refs``);
each waiting request's *depth*, indexed by its first missing key (``_by_frontier``) and
its last present key (``_by_deepest``); a lazy min-heap of (priority, -rank, arrival
order): the most urgent class, then the deepest (under ``min_rank_chunks``: none), then
the oldest; with ``by_tenant``, one such heap per tenant (``best_of``); and one of
(priority, prompt tokens less the ranked shared chunks', arrival) (``fewest_uncached``).
Why depth, for ``best``: docs/architecture.md, "How the CHT works".  Costs: admitting a
request touches its own keys plus the waiting requests whose depth changes; one joining
a group that already runs, only its own keys.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence, Set
from dataclasses import dataclass
from enum import Enum

import numpy as np
import xxhash

ChunkKey = Hashable
RequestId = Hashable

DEFAULT_CHUNK_TOKENS = 128
"""Tokens a chunk: one vLLM CPU KV block, eight GPU blocks of 16 (the paper found chunk
size hardly matters; coarser chunks make every update cheaper)."""


class CHTError(ValueError):
    """An operation that does not fit the request's state; the tree is left unchanged."""


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"


def token_chunk_keys(
    tokens: np.ndarray | Sequence[int] | bytes, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    seed: int = 0,
) -> list[int]:
    """Cumulative 64-bit keys of every full chunk of ``chunk_tokens`` tokens.

    The tokens are viewed as one contiguous int32 buffer and hashed a whole chunk at a
    time with a streaming xxh3; the digest taken after chunk *i* covers chunks 0..i, so
    equal keys mean equal prefixes.  A trailing partial chunk gets no key (as an engine's
    KV block hashes cover only full blocks).  Pass a contiguous int32 numpy array for the
    fast path; ``bytes`` are taken as int32 tokens already packed.  An empty prompt is an
    error (a prompt shorter than one chunk is not: it shares nothing).  ``seed`` starts
    the digest: keys of different seeds are disjoint (``isolation.token_keys``: a
    namespace's keys; 0, the default, is the shared namespace's).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if isinstance(tokens, bytes | bytearray | memoryview):
        buffer = memoryview(tokens).cast("B")
    else:
        buffer = memoryview(np.ascontiguousarray(tokens, dtype=np.int32)).cast("B")
    if len(buffer) % 4:
        raise ValueError("a token buffer must hold whole int32 tokens")
    if not len(buffer):
        raise CHTError("empty prompt: a request needs at least one token")
    stride = chunk_tokens * 4
    full_chunks = len(buffer) // stride
    digest = xxhash.xxh3_64(seed=seed)
    keys = []
    for end in range(stride, (full_chunks + 1) * stride, stride):
        digest.update(buffer[end - stride : end])
        keys.append(digest.intdigest())
    return keys


def block_chunk_keys(block_hashes: Sequence[ChunkKey], blocks_per_chunk: int = 1) -> list:
    """Chunk keys taken from an engine's chained per-block hashes, without re-hashing.

    An engine such as vLLM chains each full KV block's hash with its parent's, so the hash
    of a chunk's last block already identifies the whole prefix through that chunk.
    """
    if blocks_per_chunk <= 0:
        raise ValueError(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
    return list(block_hashes[blocks_per_chunk - 1 :: blocks_per_chunk])


@dataclass(frozen=True)
class Candidate:
    """The waiting request the tree would admit next, and what admitting it would do."""

    request_id: RequestId
    missing_chunks: int
    shared_before: int | None
    """Chunks shared by all running requests now (None when nothing runs)."""
    shared_after: int
    """Chunks shared by all running requests once the candidate joins them."""
    sharing_waiters: int
    """Other waiting requests that also hold the prefix of ``shared_after`` chunks."""

    @property
    def chunk_loss(self) -> int:
        """How many chunks of running-set homogeneity admitting the candidate gives up."""
        return 0 if self.shared_before is None else self.shared_before - self.shared_after


class _Entry:
    __slots__ = ("depth", "keys", "order", "priority", "rank", "state", "tenant", "tokens")

    def __init__(self, keys: list, order: int, priority: int, tenant: Hashable,
                 tokens: int) -> None:
        self.keys = keys
        self.tokens = tokens
        self.order = order
        self.priority = priority
        self.tenant = tenant
        self.state = RequestState.WAITING
        self.depth = 0
        self.rank = -1
        """The rank of the request's live heap entry (-1: none since it entered waiting)."""

    def uncached(self, chunk_tokens: int) -> int:
        """Its prompt tokens less its ranked shared chunks' (``fewest_uncached``)."""
        return max(self.tokens - max(self.rank, 0) * chunk_tokens, 0)


class ChunkedHashTree:
    """Tracks which waiting request shares most with the running set, in microseconds."""

    def __init__(self, min_rank_chunks: int = 1, by_tenant: bool = False,
                 chunk_tokens: int = 1, uncached_order: bool = False) -> None:
        """``min_rank_chunks``: the shared depth from which a waiting request ranks above
        those sharing nothing (at least 1); ``by_tenant``: keep each tenant's best too
        (``best_of``), and ``uncached_order`` the fewest uncached (``fewest_uncached``),
        each at one more heap push per rank change; ``chunk_tokens``: a chunk's tokens."""
        if min_rank_chunks < 1:
            raise ValueError(f"min_rank_chunks must be at least 1, got {min_rank_chunks}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
        self.min_rank_chunks = min_rank_chunks
        self.chunk_tokens = chunk_tokens
        self._entries: dict[RequestId, _Entry] = {}
        self._running: dict[RequestId, None] = {}
        self._running_refs: dict[ChunkKey, int] = {}
        self._running_groups = 0
        """First chunk keys that two or more running requests hold."""
        self._waiting_refs: Counter[ChunkKey] = Counter()
        self._by_frontier: dict[ChunkKey, set[RequestId]] = {}
        self._by_deepest: dict[ChunkKey, set[RequestId]] = {}
        self._heap: list[tuple[int, int, int, RequestId]] = []
        self._uncached_heap: list[tuple[int, int, int, RequestId, int]] | None = \
            [] if uncached_order else None
        self._tenant_heaps: dict[Hashable, list[tuple[int, int, int, RequestId]]] | None = \
            {} if by_tenant else None
        self._tenant_waiting: Counter[Hashable] = Counter()
        self._touched: set[Hashable] = set()
        """Tenants whose best (``best_of``) may have changed since ``touched``."""
        self._arrivals = itertools.count()
        self._num_waiting = 0

    # ---- sizes and states -------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self._running)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def state(self, request_id: RequestId) -> RequestState:
        return self._entry(request_id).state

    def chunk_keys(self, request_id: RequestId) -> list:
        return self._entry(request_id).keys

    def priority(self, request_id: RequestId) -> int:
        """The request's priority class (lower is more urgent)."""
        return self._entry(request_id).priority

    def missing_chunks(self, request_id: RequestId) -> int:
        """Chunks of a waiting request that no running request holds."""
        entry = self._entry(request_id)
        return len(entry.keys) - entry.depth

    def waiting_ids(self) -> Iterator[RequestId]:
        """Waiting requests in arrival order."""
        return (rid for rid, e in self._entries.items() if e.state is RequestState.WAITING)

    def running_ids(self) -> Iterator[RequestId]:
        return iter(self._running)

    def has_running_group(self) -> bool:
        """Whether two running requests share their first chunk (a prefix group runs
        with more than one member).  O(1)."""
        return self._running_groups > 0

    def chunks_held(self) -> int:
        """Distinct chunks the running requests hold plus those the waiting ones hold (a
        chunk held in both states counts twice: an upper bound on what is in flight).
        O(1)."""
        return len(self._running_refs) + len(self._waiting_refs)

    def runs_exactly(self, request_ids: Set[RequestId]) -> bool:
        """Whether the running set is exactly ``request_ids``.  O(len(request_ids))."""
        return self._running.keys() == request_ids

    # ---- lifecycle --------------------------------------------------------------------

    def add(self, request_id: RequestId, keys: Sequence[ChunkKey], priority: int = 0,
            tenant: Hashable = None, tokens: int | None = None) -> None:
        """Register a new waiting request with its chunk keys (see ``token_chunk_keys``)
        in priority class ``priority`` (lower is more urgent), for ``tenant``, its prompt
        ``tokens`` (default: its chunks' worth)."""
        if request_id in self._entries:
            raise CHTError(f"request {request_id!r} is already in the tree")
        tokens = len(keys) * self.chunk_tokens if tokens is None else tokens
        entry = _Entry(list(keys), next(self._arrivals), priority, tenant, tokens)
        self._entries[request_id] = entry
        self._enter_waiting(request_id, entry)

    def admit(self, request_id: RequestId) -> None:
        """Move a waiting request into the running set."""
        entry = self._entry(request_id)
        if entry.state is not RequestState.WAITING:
            raise CHTError(f"cannot admit request {request_id!r}: it is {entry.state.value}")
        self._leave_waiting(request_id, entry)
        self._enter_running(request_id, entry)

    def requeue(self, request_id: RequestId) -> None:
        """Move a running request back to waiting (preemption); it keeps its arrival order."""
        entry = self._entry(request_id)
        if entry.state is not RequestState.RUNNING:
            raise CHTError(f"cannot requeue request {request_id!r}: it is {entry.state.value}")
        self._leave_running(request_id, entry)
        self._enter_waiting(request_id, entry)

    def finish(self, request_id: RequestId) -> None:
        """Forget a running request that completed."""
        entry = self._entry(request_id)
        if entry.state is not RequestState.RUNNING:
            raise CHTError(f"cannot finish request {request_id!r}: it is {entry.state.value}")
        self._leave_running(request_id, entry)
        del self._entries[request_id]

    def remove(self, request_id: RequestId) -> None:
        """Forget a request in any state (abort)."""
        entry = self._entry(request_id)
        if entry.state is RequestState.WAITING:
            self._leave_waiting(request_id, entry)
        else:
            self._leave_running(request_id, entry)
        del self._entries[request_id]

    # ---- queries ----------------------------------------------------------------------

    def rank_key(self, request_id: RequestId) -> tuple[int, int, int]:
        """A waiting request's place in the tree's order, the key ``best`` takes the
        minimum of: (priority class, minus its shared depth as ranked, arrival order).
        KeyError for an unknown request, CHTError for one not waiting.  O(1)."""
        entry = self._entry(request_id)
        if entry.state is not RequestState.WAITING:
            raise CHTError(f"request {request_id!r} is not waiting")
        return entry.priority, -max(entry.rank, 0), entry.order

    def best(self) -> RequestId | None:
        """The waiting request of the most urgent priority class with the most chunks
        shared with the running set (a depth under ``min_rank_chunks`` counting as none),
        ties to the oldest."""
        return self._top(self._heap)

    def fewest_uncached(self) -> RequestId | None:
        """The waiting request of the most urgent priority class with the fewest prompt
        tokens left to compute (its tokens less its chunks shared with the running set,
        as ``best`` ranks them), ties to the oldest.  O(log n) amortized; a tree made
        with ``uncached_order`` only."""
        if self._uncached_heap is None:
            raise CHTError("fewest_uncached needs a tree made with uncached_order")
        return self._top(self._uncached_heap, at=4)

    def best_of(self, tenant: Hashable) -> RequestId | None:
        """``best`` among the waiting requests of ``tenant`` (a tree made ``by_tenant``;
        None when none of its requests waits).  O(1) amortised."""
        assert self._tenant_heaps is not None, "best_of needs a tree made by_tenant"
        return self._top(self._tenant_heaps.get(tenant, []))

    def touched(self) -> set[Hashable]:
        """The tenants whose ``best_of`` may have changed since the last call (a tree made
        ``by_tenant``), and forget them.  O(1)."""
        touched, self._touched = self._touched, set()
        return touched

    def tenant(self, request_id: RequestId) -> Hashable:
        """The request's tenant (as ``add`` was given it)."""
        return self._entry(request_id).tenant

    def _top(self, heap: list, at: int = 1) -> RequestId | None:
        """The first live entry of a lazy heap, stale ones popped: its request waits at
        the rank the entry was pushed at (minus the rank is its item's ``at``-th)."""
        entries = self._entries
        while heap:
            item = heap[0]
            entry = entries.get(item[3])
            if entry is not None and entry.state is RequestState.WAITING and \
                    entry.rank == -item[at]:
                return item[3]
            heapq.heappop(heap)
        return None

    def candidate(self, request_id: RequestId | None = None) -> Candidate | None:
        """What admitting ``request_id`` (default: the best) would do to the running set."""
        if request_id is None:
            request_id = self.best()
            if request_id is None:
                return None
        entry = self._entry(request_id)
        if entry.state is not RequestState.WAITING:
            raise CHTError(f"request {request_id!r} is not waiting")
        before = self.shared_prefix_chunks()
        after = len(entry.keys) if before is None else min(before, self._all_running_depth(entry))
        return Candidate(
            request_id=request_id,
            missing_chunks=len(entry.keys) - entry.depth,
            shared_before=before,
            shared_after=after,
            sharing_waiters=self._waiters_sharing(entry, after) - 1,
        )

    def held_chunks(self, request_id: RequestId) -> int:
        """Leading chunks of a waiting request that another request, running or waiting,
        also holds (its group's shared prefix).  O(log keys); asked only by gates that
        are shown it, not on every ``candidate``."""
        entry = self._entry(request_id)
        if entry.state is not RequestState.WAITING:
            raise CHTError(f"request {request_id!r} is not waiting")
        running, waiting = self._running_refs, self._waiting_refs
        return bisect_left(entry.keys, True,
                           key=lambda k: running.get(k, 0) + waiting.get(k, 0) < 2)

    def group_waiters(self, request_id: RequestId) -> int:
        """Other waiting requests of the request's prefix group (those holding its first
        chunk).  O(1)."""
        keys = self._entry(request_id).keys
        return max(self._waiting_refs.get(keys[0], 0) - 1, 0) if keys else 0

    def group_runners(self, request_id: RequestId) -> int:
        """Running requests of the request's prefix group (those holding its first
        chunk), the request itself included if it runs; 0 for a request without a chunk
        (a group of its own).  O(1)."""
        keys = self._entry(request_id).keys
        return self._running_refs.get(keys[0], 0) if keys else 0

    def shared_prefix_chunks(self) -> int | None:
        """Chunks shared by every running request; None when nothing runs."""
        if not self._running:
            return None
        first = self._entries[next(iter(self._running))]
        return self._all_running_depth(first)

    # ---- internals --------------------------------------------------------------------

    def _entry(self, request_id: RequestId) -> _Entry:
        try:
            return self._entries[request_id]
        except KeyError:
            raise CHTError(f"unknown request {request_id!r}") from None
        except TypeError:
            raise CHTError(f"request id {request_id!r} is not hashable") from None

    def _live_depth(self, keys: list) -> int:
        """Leading keys held by some running request (liveness is prefix-closed)."""
        live = self._running_refs
        if not keys or keys[0] not in live:
            return 0
        if keys[-1] in live:
            return len(keys)
        return bisect_left(keys, True, key=lambda k: k not in live)

    def _all_running_depth(self, entry: _Entry) -> int:
        """Leading keys of ``entry`` that every running request holds."""
        refs = self._running_refs
        count = len(self._running)
        keys = entry.keys
        return bisect_left(keys, True, key=lambda k: refs.get(k, 0) != count)

    def _waiters_sharing(self, entry: _Entry, chunks: int) -> int:
        """Waiting requests (``entry`` included if waiting) holding its first ``chunks``."""
        if chunks == 0:
            return self._num_waiting
        return self._waiting_refs.get(entry.keys[chunks - 1], 0)

    def _enter_waiting(self, request_id: RequestId, entry: _Entry) -> None:
        entry.state = RequestState.WAITING
        entry.rank = -1
        self._waiting_refs.update(entry.keys)
        self._num_waiting += 1
        if self._tenant_heaps is not None:
            self._tenant_waiting[entry.tenant] += 1
        self._place(request_id, entry, self._live_depth(entry.keys))

    def _leave_waiting(self, request_id: RequestId, entry: _Entry) -> None:
        self._unplace(request_id, entry)
        refs = self._waiting_refs
        for key in entry.keys:
            left = refs[key] - 1
            if left:
                refs[key] = left
            else:
                del refs[key]
        self._num_waiting -= 1
        if self._tenant_heaps is not None:
            self._tenant_waiting[entry.tenant] -= 1
            self._touched.add(entry.tenant)

    def _place(self, request_id: RequestId, entry: _Entry, depth: int) -> None:
        """Index a waiting request at ``depth``; offer it to the heap if its rank moved."""
        entry.depth = depth
        keys = entry.keys
        if depth < len(keys):
            self._by_frontier.setdefault(keys[depth], set()).add(request_id)
        if depth:
            self._by_deepest.setdefault(keys[depth - 1], set()).add(request_id)
        rank = depth if depth >= self.min_rank_chunks else 0
        if rank == entry.rank:
            return
        entry.rank = rank
        item = (entry.priority, -rank, entry.order, request_id)
        heapq.heappush(self._heap, item)
        if self._uncached_heap is not None:
            heapq.heappush(self._uncached_heap, (entry.priority, entry.uncached(
                self.chunk_tokens), entry.order, request_id, -rank))
        if len(self._heap) > 4 * self._num_waiting + 64:
            self._compact_heap()
        if self._tenant_heaps is not None:
            self._touched.add(entry.tenant)
            heap = self._tenant_heaps.setdefault(entry.tenant, [])
            heapq.heappush(heap, item)
            if len(heap) > 4 * self._tenant_waiting[entry.tenant] + 64:
                self._compact_tenant_heap(entry.tenant)

    def _unplace(self, request_id: RequestId, entry: _Entry) -> None:
        keys = entry.keys
        depth = entry.depth
        if depth < len(keys):
            _discard(self._by_frontier, keys[depth], request_id)
        if depth:
            _discard(self._by_deepest, keys[depth - 1], request_id)

    def _enter_running(self, request_id: RequestId, entry: _Entry) -> None:
        entry.state = RequestState.RUNNING
        self._running[request_id] = None
        refs = self._running_refs
        born = []
        for key in entry.keys:
            count = refs.get(key, 0)
            refs[key] = count + 1
            if not count:
                born.append(key)
        if entry.keys and refs[entry.keys[0]] == 2:
            self._running_groups += 1
        self._reindex(self._by_frontier, born)

    def _leave_running(self, request_id: RequestId, entry: _Entry) -> None:
        del self._running[request_id]
        refs = self._running_refs
        if entry.keys and refs[entry.keys[0]] == 2:
            self._running_groups -= 1
        died = []
        for key in entry.keys:
            left = refs[key] - 1
            if left:
                refs[key] = left
            else:
                del refs[key]
                died.append(key)
        self._reindex(self._by_deepest, died)

    def _reindex(self, index: dict[ChunkKey, set[RequestId]], changed: list) -> None:
        """Recompute the depth of waiting requests indexed under keys whose liveness changed.

        After the change no waiting request can be indexed under a changed key again
        (a frontier is never live, a deepest key is never dead), so each moves once.
        """
        entries = self._entries
        for key in changed:
            moved = index.pop(key, None)
            if not moved:
                continue
            for request_id in moved:
                entry = entries[request_id]
                self._unplace_other(request_id, entry, index)
                self._place(request_id, entry, self._live_depth(entry.keys))

    def _unplace_other(
        self, request_id: RequestId, entry: _Entry, popped: dict[ChunkKey, set[RequestId]]
    ) -> None:
        """Drop a request from the index that was not just popped wholesale."""
        keys = entry.keys
        depth = entry.depth
        if popped is self._by_frontier:
            if depth:
                _discard(self._by_deepest, keys[depth - 1], request_id)
        elif depth < len(keys):
            _discard(self._by_frontier, keys[depth], request_id)

    def _compact_heap(self) -> None:
        """Both heaps rebuilt from the waiting entries, one item each (they grow
        together; an item per rank change, so a rank that came back leaves two).  O(n)."""
        waiting = [(rid, e) for rid, e in self._entries.items()
                   if e.state is RequestState.WAITING]
        self._heap = [(e.priority, -e.rank, e.order, rid) for rid, e in waiting]
        heapq.heapify(self._heap)
        if self._uncached_heap is not None:
            self._uncached_heap = [(e.priority, e.uncached(self.chunk_tokens), e.order, rid,
                                    -e.rank) for rid, e in waiting]
            heapq.heapify(self._uncached_heap)

    def _compact_tenant_heap(self, tenant: Hashable) -> None:
        """Drop a tenant heap's stale entries.  O(its length)."""
        assert self._tenant_heaps is not None
        self._tenant_heaps[tenant] = _live(self._tenant_heaps[tenant], self._entries)


def _live(heap: list, entries: dict[RequestId, _Entry]) -> list:
    """A lazy heap's live items (``ChunkedHashTree._top``'s test), as a heap.  O(n)."""
    live = [item for item in heap if (entry := entries.get(item[3])) is not None and
            entry.state is RequestState.WAITING and entry.rank == -item[1]]
    heapq.heapify(live)
    return live


def _discard(index: dict[ChunkKey, set[RequestId]], key: ChunkKey, request_id: RequestId) -> None:
    members = index.get(key)
    if members is not None:
        members.discard(request_id)
        if not members:
            del index[key]
