"""Routing requests over engine replicas by prefix: ``FeatherRouter`` and the shared core.

Engine-agnostic (imports no engine and no Ray): a replica is any hashable name, a request
is an id and its cumulative chunk keys (``cht.token_chunk_keys`` over its token ids,
computed once per request at the router).  Keys are cumulative, so a replica holding
key *i* of a prompt holds its whole prefix through chunk *i*, and the longest share of a
prompt any replica holds is a binary search over dict look-ups (``PrefixIndex``).

``Router`` keeps what every router needs and guarantees: each replica's load (requests
routed to it and not finished), and that every request routed is finished or returned
(by ``remove_replica``, for the caller to resend) exactly once.  The baselines (round
robin, power of two, Ray's and SGLang's prefix rules) live in ``feather_sched.routers``.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Hashable, Iterable, Sequence
from typing import cast

from feather_sched.cht import DEFAULT_CHUNK_TOKENS, token_chunk_keys

Replica = Hashable
RequestId = Hashable
ChunkKey = Hashable


class RouterError(ValueError):
    """A call that does not fit the router's state; the router is left unchanged."""


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


class Router:
    """Replicas, their loads, and each routed request until it finishes or is returned.

    Subclasses choose the replica (``_choose``) and may watch requests come and go
    (``_routed``, ``_finished``, ``_removed``).  Loads count requests routed and not
    finished; ``route`` and ``finished`` add O(keys) bookkeeping to the rule's own cost.
    """

    name = "router"

    def __init__(self, replicas: Iterable[Replica] = (), *, seed: int = 0,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.chunk_tokens = chunk_tokens
        self._rng = random.Random(seed)
        self._load: dict[Replica, int] = {}
        self._replicas: list[Replica] = []
        self._requests: dict[RequestId, tuple[Replica, Sequence[ChunkKey], object]] = {}
        """Each routed request: its replica, chunk keys and what ``_routed`` returned."""
        self._on_replica: dict[Replica, dict[RequestId, None]] = {}
        for replica in replicas:
            self.add_replica(replica)

    @property
    def replicas(self) -> list[Replica]:
        """Live replicas, in the order they were added."""
        return list(self._replicas)

    def load(self, replica: Replica) -> int:
        """Requests routed to ``replica`` and not finished."""
        return self._load[replica]

    def __len__(self) -> int:
        """Requests routed and neither finished nor returned."""
        return len(self._requests)

    def __contains__(self, request_id: RequestId) -> bool:
        """Whether ``request_id`` is routed and neither finished nor returned."""
        return request_id in self._requests

    def replica_of(self, request_id: RequestId) -> Replica:
        """The replica a routed request counts on."""
        try:
            return self._requests[request_id][0]
        except KeyError:
            raise RouterError(f"request {request_id!r} is not routed") from None

    def route(self, request_id: RequestId, chunk_keys: Sequence[ChunkKey]) -> Replica:
        """The replica to serve a new request; it counts there until ``finished``."""
        if request_id in self._requests:
            raise RouterError(f"request {request_id!r} is already routed")
        if not self._replicas:
            raise RouterError("no live replica to route to")
        replica = self._choose(chunk_keys)
        self._assign(request_id, chunk_keys, replica)
        return replica

    def move(self, request_id: RequestId, replica: Replica) -> None:
        """A routed request went to another live ``replica`` than the one ``route`` chose
        (a caller's fallback, e.g. the first choice was full): it counts there now."""
        if replica not in self._load:
            raise RouterError(f"replica {replica!r} is not live")
        if request_id not in self._requests:
            raise RouterError(f"request {request_id!r} is not routed")
        keys = self._requests[request_id][1]
        self.withdraw(request_id)
        self._assign(request_id, keys, replica)

    def route_tokens(self, request_id: RequestId, tokens: Sequence[int]) -> Replica:
        """``route`` with the chunk keys of a prompt's token ids (int32 numpy is fastest)."""
        return self.route(request_id, token_chunk_keys(tokens, self.chunk_tokens))

    def finished(self, request_id: RequestId) -> Replica:
        """A routed request ended (any way) after its replica took it; returns the
        replica.  Once per request (or ``withdraw``)."""
        replica, keys, _ = self._end(request_id)
        self._finished(replica, keys)
        return replica

    def withdraw(self, request_id: RequestId) -> Replica:
        """A routed request ended before its replica took it (refused, or cancelled
        before it was sent): as ``finished``, but the replica is not taken to have served
        its prefix.  Returns the replica.  Once per request (or ``finished``)."""
        replica, keys, memo = self._end(request_id)
        self._withdrawn(replica, keys, memo)
        return replica

    def _end(self, request_id: RequestId) -> tuple[Replica, Sequence[ChunkKey], object]:
        try:
            ended = self._requests.pop(request_id)
        except KeyError:
            raise RouterError(f"request {request_id!r} is not routed (finished, returned "
                              "or never routed)") from None
        del self._on_replica[ended[0]][request_id]
        self._load[ended[0]] -= 1
        return ended

    def add_replica(self, replica: Replica) -> None:
        if replica in self._load:
            raise RouterError(f"replica {replica!r} is already live")
        self._load[replica] = 0
        self._on_replica[replica] = {}
        self._replicas.append(replica)

    def remove_replica(self, replica: Replica) -> list[RequestId]:
        """A dead replica: never chosen again, its state dropped; returns the requests
        routed to it and not finished, in routing order, for the caller to resend."""
        if replica not in self._load:
            raise RouterError(f"replica {replica!r} is not live")
        del self._load[replica]
        self._replicas.remove(replica)
        orphans = list(self._on_replica.pop(replica))
        for request_id in orphans:
            del self._requests[request_id]
        self._removed(replica)
        return orphans

    def _assign(self, request_id: RequestId, keys: Sequence[ChunkKey],
                replica: Replica) -> None:
        self._on_replica[replica][request_id] = None
        self._load[replica] += 1
        self._requests[request_id] = (replica, keys, self._routed(replica, keys))

    # ---- for the rules ----------------------------------------------------------------

    def _choose(self, keys: Sequence[ChunkKey]) -> Replica:
        raise NotImplementedError

    def _routed(self, replica: Replica, keys: Sequence[ChunkKey]) -> object:
        """A request was routed to ``replica``; what it returns is handed back to
        ``_withdrawn`` if the request is withdrawn."""
        return None

    def _finished(self, replica: Replica, keys: Sequence[ChunkKey]) -> None:
        """A request routed to ``replica`` finished."""

    def _withdrawn(self, replica: Replica, keys: Sequence[ChunkKey], memo: object) -> None:
        """A request routed to ``replica`` ended or moved before it ran there."""

    def _removed(self, replica: Replica) -> None:
        """``replica`` died."""

    def _least_loaded(self, replicas: Iterable[Replica]) -> Replica:
        """The least loaded of ``replicas`` (ties: the first)."""
        return min(replicas, key=self._load.__getitem__)

    def _two_choices(self) -> Replica:
        """Power of two choices: the less loaded of two distinct random replicas."""
        replicas = self._replicas
        if len(replicas) == 1:
            return replicas[0]
        first, second = self._rng.sample(replicas, 2)
        return second if self._load[second] < self._load[first] else first


class FeatherRouter(Router):
    """Keeps each prefix group on as few replicas as load allows, and load even.

    A request goes to a replica that holds the longest share of its prefix, counting the
    requests each replica serves and has queued (and, up to ``max_idle_keys``, prefixes
    it served before and likely still caches): the least loaded of those holders that is
    within the imbalance bound, i.e. whose load exceeds neither the least loaded replica's
    load plus ``balance_abs`` nor that load times ``balance_rel`` (over the bound means
    past both, as SGLang's rule).  A holder past the bound is passed over, not the whole
    rule (Ray's and SGLang's routers drop prefix matching for every request while any two
    replicas are imbalanced, which scatters every group at once).  When every holder is
    past the bound the request goes to the less loaded of two random replicas, which then
    holds the group too: a group one replica cannot keep up with spreads to as many
    replicas as it needs, and its requests are balanced over them.  A prefix nobody holds
    (a new group) goes to the least loaded of the replicas within the bound that hold the
    fewest prefix keys, so groups spread evenly before load tells them apart (with Zipf
    popularity the hot groups come first and land on different replicas); a prompt too
    short for a chunk key, to the least loaded replica.

    Defaults: ``balance_abs=32`` is SGLang's, ``balance_rel=1.5`` is not.  With SGLang's
    1.1 the bound stays 32 requests over the least loaded replica up to 320 queued; where
    queues are long that passes holders over on queue-length noise and spreads each group
    over more replicas than its load needs, costing prefill and homogeneous batches.  With
    1.5 the bound grows with the queues past 64: in the simulator at 3x load with 64
    groups of 5K-token prefixes, Feather's pair reads 1.19x (H200) and 1.38x (H100) Ray's
    rule, against 0.95x and 1.27x with 1.1; 2 and 3 lose up to 15% with 10K-token
    prefixes (``benchmarks/replicas/balance.md``).  A bound in requests, not tokens,
    because requests are what the router sees.  Cost per request:
    O(keys) dict updates plus O(log keys) look-ups and O(replicas) for the loads
    (``benchmarks/replicas/router_overhead.py``).
    """

    name = "feather"

    def __init__(self, replicas: Iterable[Replica] = (), *, seed: int = 0,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, balance_abs: int = 32,
                 balance_rel: float = 1.5, max_idle_keys: int | None = 1 << 20) -> None:
        if balance_abs < 0 or balance_rel < 1:
            raise ValueError(f"need balance_abs >= 0 and balance_rel >= 1, got "
                             f"{balance_abs} and {balance_rel}")
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.index = PrefixIndex(max_idle_keys)
        """Requests each replica serves or has queued, by chunk key."""
        super().__init__(replicas, seed=seed, chunk_tokens=chunk_tokens)

    def _choose(self, keys: Sequence[ChunkKey]) -> Replica:
        if not keys:  # nothing to share (a prompt shorter than a chunk)
            return self._least_loaded(self._replicas)
        _, holders = self.index.match(keys)
        load = self._load
        floor = min(load.values())
        bound = max(floor + self.balance_abs, floor * self.balance_rel)
        if not holders:
            within = [r for r in self._replicas if load[r] <= bound]
            return self._least_loaded(self.index.fewest_keys(within))
        fit = [r for r in holders if load[r] <= bound]
        return self._least_loaded(fit) if fit else self._two_choices()

    def _routed(self, replica: Replica, keys: Sequence[ChunkKey]) -> int:
        return self.index.add(replica, keys)

    def _finished(self, replica: Replica, keys: Sequence[ChunkKey]) -> None:
        self.index.release(replica, keys)

    def _withdrawn(self, replica: Replica, keys: Sequence[ChunkKey], memo: object) -> None:
        self.index.withdraw(replica, keys, cast(int, memo))  # what _routed returned

    def _removed(self, replica: Replica) -> None:
        self.index.drop(replica)
