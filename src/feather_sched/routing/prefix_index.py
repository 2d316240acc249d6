"""``PrefixIndex``: which replicas hold each cumulative chunk key, with a count per replica.

Keys are cumulative, so a replica holding key *i* of a prompt holds its whole prefix
through chunk *i*, and the longest share of a prompt any replica holds is a binary search
over dict look-ups.  Shared by the approximate index (``routing.feather``) and the
precise one (``routing.cache_index``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable, Sequence

Replica = Hashable
RequestId = Hashable
ChunkKey = Hashable
SessionId = Hashable


class PrefixIndex:
    """Which replicas hold each chunk key, with a count per replica.

    ``add`` counts a request's keys on a replica and ``release`` uncounts them; a key
    whose counts all reach zero is kept (its replica has served that prefix and likely
    still caches it) in a first-in-first-out list of at most ``max_idle_keys`` keys,
    released deepest key first so that what is kept stays prefix-closed.  With
    ``max_idle_keys=None`` nothing is forgotten (a history of everything routed, as Ray's
    and SGLang's trees without eviction).  ``add``/``release`` cost O(keys);
    ``match`` O(log keys); ``drop`` O(keys in the index).
    """

    def __init__(self, max_idle_keys: int | None = None) -> None:
        if max_idle_keys is not None and max_idle_keys < 0:
            raise ValueError(f"max_idle_keys must be >= 0, got {max_idle_keys}")
        self.max_idle_keys = max_idle_keys
        self._owners: dict[ChunkKey, dict[Replica, int]] = {}
        self._idle: dict[ChunkKey, None] = {}
        self.sizes: dict[Replica, int] = {}
        """Keys each replica has an entry for (its tree size, for smallest-tree rules)."""

    def __len__(self) -> int:
        return len(self._owners)

    def match(self, keys: Sequence[ChunkKey]) -> tuple[int, dict[Replica, int]]:
        """The longest run of leading ``keys`` some replica holds, and the holders of the
        deepest one with their counts (empty when nothing matches).  Do not mutate."""
        owners = self._owners
        if not keys or keys[0] not in owners:
            return 0, {}
        depth = len(keys) if keys[-1] in owners else bisect_left(
            keys, True, key=lambda k: k not in owners)
        return depth, owners[keys[depth - 1]]

    def fewest_keys(self, replicas: Sequence[Replica]) -> list[Replica]:
        """Those of ``replicas`` with entries for the fewest keys (the smallest trees), in
        their order.  O(replicas)."""
        sizes = self.sizes
        fewest = min(sizes.get(r, 0) for r in replicas)
        return [r for r in replicas if sizes.get(r, 0) == fewest]

    def add(self, replica: Replica, keys: Sequence[ChunkKey]) -> int:
        """Count a request's keys on ``replica``; returns how many leading keys it had an
        entry for already (what ``withdraw`` must keep)."""
        owners, idle, sizes = self._owners, self._idle, self.sizes
        known, leading = 0, True
        for key in keys:
            holders = owners.get(key)
            if holders is None:
                owners[key] = {replica: 1}
                sizes[replica] = sizes.get(replica, 0) + 1
                leading = False
                continue
            count = holders.get(replica)
            if count is None:
                sizes[replica] = sizes.get(replica, 0) + 1
                count = 0
                leading = False
            elif leading:
                known += 1
            if not count:  # the key may have been idle everywhere
                idle.pop(key, None)
            holders[replica] = count + 1
        return known

    def release(self, replica: Replica, keys: Sequence[ChunkKey]) -> None:
        """Uncount keys ``add`` counted on ``replica``; keys left at zero everywhere idle."""
        owners, idle = self._owners, self._idle
        for key in reversed(keys):
            holders = owners[key]
            left = holders[replica] - 1
            holders[replica] = left
            if not left and not any(holders.values()):
                idle[key] = None
        self._evict()

    def withdraw(self, replica: Replica, keys: Sequence[ChunkKey], known: int) -> None:
        """Uncount keys ``add`` counted on ``replica`` (and returned ``known`` for) for a
        request that never ran there: a key that ``add`` gave the replica its entry for
        and that no other request counts is forgotten for it, not kept idle (it does not
        cache what it never served); the ``known`` leading keys are released as usual."""
        owners, idle, sizes = self._owners, self._idle, self.sizes
        for key in reversed(keys[known:]):  # deepest first, as release
            holders = owners[key]
            left = holders[replica] - 1
            if left:
                holders[replica] = left
                continue
            del holders[replica]
            sizes[replica] -= 1
            if not holders:
                del owners[key]
                idle.pop(key, None)
            elif not any(holders.values()):
                idle[key] = None
        self.release(replica, keys[:known])

    def drop(self, replica: Replica) -> None:
        """Forget a replica everywhere (a dead one).  Keys it alone counted turn idle,
        deepest first (keys enter the index shallowest first), as ``release`` leaves them."""
        self.sizes.pop(replica, None)
        idle, newly_idle = self._idle, []
        for key in list(self._owners):
            holders = self._owners[key]
            if holders.pop(replica, None) is None:
                continue
            if not holders:
                del self._owners[key]
                idle.pop(key, None)
            elif key not in idle and not any(holders.values()):
                newly_idle.append(key)
        idle.update(dict.fromkeys(reversed(newly_idle)))
        self._evict()

    def _evict(self) -> None:
        limit, idle, sizes = self.max_idle_keys, self._idle, self.sizes
        if limit is None:
            return
        while len(idle) > limit:
            key = next(iter(idle))
            del idle[key]
            for replica in self._owners.pop(key):
                sizes[replica] -= 1
