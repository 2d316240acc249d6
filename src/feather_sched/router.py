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
``FeatherRouter`` routes by an index of what each replica caches: ``ApproximateIndex``
(here: a guess from the requests routed) or ``cache_index.PreciseIndex`` (the engines'
own KV events).
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol, cast

from feather_sched.cht import DEFAULT_CHUNK_TOKENS, token_chunk_keys

Replica = Hashable
RequestId = Hashable
ChunkKey = Hashable
SessionId = Hashable


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

    def route(self, request_id: RequestId, chunk_keys: Sequence[ChunkKey],
              session: SessionId | None = None) -> Replica:
        """The replica to serve a new request (of ``session``, if it names one: rules that
        keep sessions together read it); it counts there until ``finished``."""
        if request_id in self._requests:
            raise RouterError(f"request {request_id!r} is already routed")
        if not self._replicas:
            raise RouterError("no live replica to route to")
        replica = self._choose(chunk_keys, session)
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

    def keys(self, tokens: Sequence[int]) -> Sequence[ChunkKey]:
        """The keys ``route`` takes for a prompt's token ids (int32 numpy is fastest): its
        chunk keys here."""
        return token_chunk_keys(tokens, self.chunk_tokens)

    def route_tokens(self, request_id: RequestId, tokens: Sequence[int],
                     session: SessionId | None = None) -> Replica:
        """``route`` with the keys of a prompt's token ids."""
        return self.route(request_id, self.keys(tokens), session)

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
        self._added(replica)

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

    def _choose(self, keys: Sequence[ChunkKey], session: SessionId | None) -> Replica:
        raise NotImplementedError

    def _routed(self, replica: Replica, keys: Sequence[ChunkKey]) -> object:
        """A request was routed to ``replica``; what it returns is handed back to
        ``_withdrawn`` if the request is withdrawn."""
        return None

    def _finished(self, replica: Replica, keys: Sequence[ChunkKey]) -> None:
        """A request routed to ``replica`` finished."""

    def _withdrawn(self, replica: Replica, keys: Sequence[ChunkKey], memo: object) -> None:
        """A request routed to ``replica`` ended or moved before it ran there."""

    def _added(self, replica: Replica) -> None:
        """``replica`` joined."""

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


class RouterIndex(Protocol):
    """What ``FeatherRouter`` routes by: how a prompt is keyed, and which replicas hold how
    much of it.  Depths are in the index's own units (chunks, blocks)."""

    name: str

    def keys(self, tokens: Sequence[int]) -> Sequence[ChunkKey]:
        """A prompt's keys (computed once per request)."""
        ...

    def depths(self, keys: Sequence[ChunkKey]) -> dict[Replica, int]:
        """How much of a prompt replicas hold: leading keys, by replica (none: nobody)."""
        ...

    def fewest(self, replicas: Sequence[Replica]) -> list[Replica]:
        """Those of ``replicas`` holding the least (where a new prefix should go)."""
        ...

    def added(self, replica: Replica) -> None: ...

    def routed(self, replica: Replica, keys: Sequence[ChunkKey]) -> int:
        """A request was routed to ``replica``; returns what ``withdrawn`` gets back."""
        ...

    def finished(self, replica: Replica, keys: Sequence[ChunkKey]) -> None: ...

    def withdrawn(self, replica: Replica, keys: Sequence[ChunkKey], known: int) -> None: ...

    def removed(self, replica: Replica) -> None: ...


class ApproximateIndex:
    """What each replica caches, guessed from the requests routed to it: ``PrefixIndex``
    over chunk keys (requests served or queued, and up to ``max_idle_keys`` prefixes served
    before).  ``depths`` reports the holders of the deepest key matched only."""

    name = "approximate"

    def __init__(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 max_idle_keys: int | None = 1 << 20) -> None:
        self.chunk_tokens = chunk_tokens
        self.prefixes = PrefixIndex(max_idle_keys)

    def keys(self, tokens: Sequence[int]) -> Sequence[ChunkKey]:
        return token_chunk_keys(tokens, self.chunk_tokens)

    def depths(self, keys: Sequence[ChunkKey]) -> dict[Replica, int]:
        depth, holders = self.prefixes.match(keys)
        return dict.fromkeys(holders, depth)

    def fewest(self, replicas: Sequence[Replica]) -> list[Replica]:
        return self.prefixes.fewest_keys(replicas)

    def added(self, replica: Replica) -> None:
        pass

    def routed(self, replica: Replica, keys: Sequence[ChunkKey]) -> int:
        return self.prefixes.add(replica, keys)

    def finished(self, replica: Replica, keys: Sequence[ChunkKey]) -> None:
        self.prefixes.release(replica, keys)

    def withdrawn(self, replica: Replica, keys: Sequence[ChunkKey], known: int) -> None:
        self.prefixes.withdraw(replica, keys, known)

    def removed(self, replica: Replica) -> None:
        self.prefixes.drop(replica)


class FeatherRouter(Router):
    """Keeps each prefix on the replicas caching it while load allows, and load even.

    The rule.  The **band** is the replicas whose load (requests routed and not finished)
    exceeds neither the least loaded replica's load plus ``balance_abs`` nor that load
    times ``balance_rel`` (past the band means past both, as SGLang's bound).  In order:

    1. a request of a session (``route(..., session=)``) goes to the replica its session
       last went to, if that replica is in the band;
    2. among the replicas in the band, the one holding the longest prefix of the prompt
       wins (ties: the least loaded);
    3. when replicas hold some of it but none is in the band, load wins: the less loaded
       of two random replicas, which then holds it too (a prefix one replica cannot keep
       up with spreads to as many replicas as it needs, and is balanced over them);
    4. a prefix nobody holds goes to the least loaded of the replicas in the band holding
       the least (``fewest``), so new prefixes spread before load tells replicas apart; a
       prompt too short for a key, to the least loaded replica.

    What "holding" means is the ``index``'s: ``ApproximateIndex`` (the default: requests
    routed there, served or queued, and prefixes served before; only the holders of the
    deepest key count in step 2) or ``cache_index.PreciseIndex`` (the blocks the engine
    reports it caches, plus requests routed there and not finished; every replica's own
    depth counts).

    Band defaults: ``balance_abs=32`` is SGLang's, ``balance_rel=1.5`` is not.  With
    SGLang's 1.1 the band stays 32 requests over the least loaded replica up to 320 queued;
    where queues are long that passes holders over on queue-length noise and spreads each
    prefix over more replicas than its load needs, costing prefill and homogeneous
    batches.  With 1.5 the band grows with the queues past 64: in the simulator at 3x load
    with 64 groups of 5K-token prefixes, Feather's pair reads 1.19x (H200) and 1.38x
    (H100) Ray's rule, against 0.95x and 1.27x with 1.1; 2 and 3 lose up to 15% with
    10K-token prefixes (``benchmarks/replicas/balance.md``).  A band in requests, not
    tokens, because requests are what the router sees.  Sessions: the ``max_sessions``
    most recent are remembered.  Cost per request: the index's (``keys``, ``depths``,
    O(keys) on route and finish) plus O(replicas) for the loads
    (``benchmarks/replicas/router_overhead.py``).
    """

    name = "feather"

    def __init__(self, replicas: Iterable[Replica] = (), *, seed: int = 0,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, balance_abs: int = 32,
                 balance_rel: float = 1.5, max_idle_keys: int | None = 1 << 20,
                 index: RouterIndex | None = None, max_sessions: int = 1 << 16) -> None:
        if balance_abs < 0 or balance_rel < 1:
            raise ValueError(f"need balance_abs >= 0 and balance_rel >= 1, got "
                             f"{balance_abs} and {balance_rel}")
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.index: RouterIndex = index if index is not None else ApproximateIndex(
            chunk_tokens, max_idle_keys)
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[SessionId, Replica] = OrderedDict()
        """Where each recent session went last, least recent first."""
        super().__init__(replicas, seed=seed, chunk_tokens=chunk_tokens)

    def keys(self, tokens: Sequence[int]) -> Sequence[ChunkKey]:
        return self.index.keys(tokens)

    def _choose(self, keys: Sequence[ChunkKey], session: SessionId | None) -> Replica:
        replica = self._rule(keys, session)
        if session is not None:
            sessions = self._sessions
            sessions[session] = replica
            sessions.move_to_end(session)
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
        return replica

    def _rule(self, keys: Sequence[ChunkKey], session: SessionId | None) -> Replica:
        load = self._load
        floor = min(load.values())
        bound = max(floor + self.balance_abs, floor * self.balance_rel)
        if session is not None:
            home = self._sessions.get(session)
            if home is not None and load.get(home, bound + 1) <= bound:
                return home
        if not keys:  # nothing to share (a prompt shorter than a chunk)
            return self._least_loaded(self._replicas)
        depths = self.index.depths(keys)
        fit = {r: depth for r, depth in depths.items() if load[r] <= bound}
        if fit:
            deepest = max(fit.values())
            return self._least_loaded(r for r, depth in fit.items() if depth == deepest)
        if depths:
            return self._two_choices()
        within = [r for r in self._replicas if load[r] <= bound]
        return self._least_loaded(self.index.fewest(within))

    def _routed(self, replica: Replica, keys: Sequence[ChunkKey]) -> int:
        return self.index.routed(replica, keys)

    def _finished(self, replica: Replica, keys: Sequence[ChunkKey]) -> None:
        self.index.finished(replica, keys)

    def _withdrawn(self, replica: Replica, keys: Sequence[ChunkKey], memo: object) -> None:
        self.index.withdrawn(replica, keys, cast(int, memo))  # what _routed returned

    def _added(self, replica: Replica) -> None:
        self.index.added(replica)

    def _removed(self, replica: Replica) -> None:
        self.index.removed(replica)
