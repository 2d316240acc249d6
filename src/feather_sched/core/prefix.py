"""Prefix groups: which requests share a prompt prefix, and how much of it a batch shares.

The one notion of a group for all that describes or orders a batch.  Keys are
cumulative (chunk *i*'s key stands for the whole prompt through chunk *i*, as
``cht.token_chunk_keys`` and an engine's chained block hashes are), so:

* a request's **group** is the key of its first chunk (``DEFAULT_CHUNK_TOKENS`` tokens
  unless Feather's ``chunk_tokens`` says otherwise): requests of a group share at least
  their first chunk; a request with no full chunk is a group of its own;
* the tokens a request **shares** in a batch are its leading keys that some other request
  of the batch also holds, times the tokens a key covers.

``SharedPrefixes`` keeps reference counts of keys over a changing set of requests, so a
batch that changes by a few requests a step costs a few updates, not a recount.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

from feather_sched.core.cht import DEFAULT_CHUNK_TOKENS
from feather_sched.telemetry.steplog import BatchEntry

ChunkKey = Hashable
T = TypeVar("T")


def group_of(keys: Sequence[ChunkKey], request_id: Hashable, keys_per_chunk: int = 1
             ) -> Hashable:
    """A request's prefix group: the key of its first chunk, else ``("solo", request_id)``.

    ``keys_per_chunk`` > 1 reads block-level keys (e.g. 16-token KV blocks) at chunk
    granularity: the first chunk's key is then the key of its last block.
    """
    return keys[keys_per_chunk - 1] if len(keys) >= keys_per_chunk else ("solo", request_id)


def keys_per_chunk(key_tokens: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """How many keys of ``key_tokens`` tokens make a chunk (at least one)."""
    return max(1, chunk_tokens // key_tokens)


class SharedPrefixes:
    """Reference counts of cumulative keys over a set of requests (a batch).

    ``add``/``remove`` cost O(keys of the request); ``shared_keys`` is a binary search,
    O(log keys), because a key held by two requests implies every earlier key is too.
    """

    def __init__(self, key_lists: Iterable[Sequence[ChunkKey]] = ()) -> None:
        self._refs: Counter = Counter()
        for keys in key_lists:
            self.add(keys)

    def add(self, keys: Sequence[ChunkKey]) -> None:
        self._refs.update(keys)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        """Remove a request added before (its keys, exactly as given to ``add``)."""
        refs = self._refs
        for key in keys:
            count = refs[key] - 1
            if count > 0:
                refs[key] = count
            elif count == 0:
                del refs[key]
            else:
                raise KeyError(f"key {key!r} was not added")

    def shared_keys(self, keys: Sequence[ChunkKey]) -> int:
        """Leading keys of a member that at least one other member also holds."""
        refs = self._refs
        if not keys or refs.get(keys[0], 0) < 2:
            return 0
        if refs.get(keys[-1], 0) >= 2:
            return len(keys)
        return bisect_left(keys, True, key=lambda key: refs.get(key, 0) < 2)


def shared_tokens(key_lists: Sequence[Sequence[ChunkKey]], tokens_per_key: int) -> list[int]:
    """For each request of a batch, the prompt tokens some other request also holds."""
    shared = SharedPrefixes(key_lists)
    return [shared.shared_keys(keys) * tokens_per_key for keys in key_lists]


def describe_batch(rows: Iterable[tuple[Hashable, Sequence[ChunkKey], int, int]],
                   tokens_per_key: int, keys_per_chunk: int = 1,
                   shared: SharedPrefixes | None = None) -> list[BatchEntry]:
    """A step's batch as the step log and the cost model read it, one ``BatchEntry`` per
    row of ``rows``: (request id, its cumulative keys, context tokens, new tokens), in
    the batch's order.  Its group is ``group_of``; its shared tokens are its leading keys
    another row also holds, times ``tokens_per_key``, at most its context.  ``shared``:
    the batch's keys already counted (kept incrementally, as the simulator does); by
    default they are counted here.  Engines describe their batches in Feather's chunks
    (``FeatherRuntime.describe_batch``), so step logs of every engine have one
    granularity.  O(keys of the batch); O(rows log keys) given ``shared``."""
    rows = list(rows)
    if shared is None:
        shared = SharedPrefixes(keys for _, keys, _, _ in rows)
    return [BatchEntry(group=group_of(keys, request_id, keys_per_chunk),
                       shared_tokens=min(shared.shared_keys(keys) * tokens_per_key, context),
                       context_tokens=context, new_tokens=new)
            for request_id, keys, context, new in rows]


def order_by_group(requests: Sequence[T], groups: Sequence[Hashable],
                   ages: Sequence[tuple]) -> list[T]:
    """The running order Feather keeps, which is also its preemption order (the end
    first): each group contiguous, groups by their oldest member's age (FCFS between
    groups), members by theirs. ``groups[i]`` and ``ages[i]`` are ``requests[i]``'s.

    With ages that sort by priority class first and groups that tell classes apart,
    the end is the newest member of the youngest group of the least urgent class:
    preempting a group's members from the newest frees its prefix when the last goes,
    and a request is never preempted for a group made only of requests younger than
    it.  Equal ages keep their order in ``requests`` (so do groups whose oldest ages
    tie).  O(n log n): ``gather_groups`` over the requests sorted by age, the sort in C.
    """
    by_age = sorted(range(len(requests)), key=ages.__getitem__)
    return gather_groups(list(map(requests.__getitem__, by_age)),
                         list(map(groups.__getitem__, by_age)))


def gather_groups(requests: Sequence[T], groups: Sequence[Hashable]) -> list[T]:
    """``requests`` with each group's members moved up to where its first member stands,
    in their order: every group contiguous, nothing else moved. ``groups[i]`` is
    ``requests[i]``'s. O(n log n), every loop in C (a stable sort by the position of
    each request's group's first member)."""
    if len(requests) != len(groups):
        raise ValueError(f"{len(requests)} requests but {len(groups)} groups")
    first = dict(zip(reversed(groups), range(len(groups) - 1, -1, -1), strict=True))
    rank = list(map(first.__getitem__, groups))
    return list(map(requests.__getitem__, sorted(range(len(rank)), key=rank.__getitem__)))
