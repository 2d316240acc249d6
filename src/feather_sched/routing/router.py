"""``Router``: what every router over engine replicas keeps and guarantees.

Each replica's load (requests routed to it and not finished), and that every request
routed is finished or returned (by ``remove_replica``, for the caller to resend) exactly
once.  Engine-agnostic (imports no engine and no Ray): a replica is any hashable name, a
request is an id and its cumulative chunk keys (``core.cht.token_chunk_keys`` over its
token ids, computed once per request at the router).  The rules live in subclasses:
``routing.feather.FeatherRouter`` and the baselines of ``routing.baselines``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import numpy as np

from feather_sched.core.cht import DEFAULT_CHUNK_TOKENS
from feather_sched.core.isolation import SHARED, Namespace, token_keys
from feather_sched.routing.prefix_index import ChunkKey, Replica, RequestId, SessionId


class RouterError(ValueError):
    """A call that does not fit the router's state; the router is left unchanged."""


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

    def keys(self, tokens: np.ndarray | Sequence[int], namespace: Namespace = SHARED
             ) -> Sequence[ChunkKey]:
        """The keys ``route`` takes for a prompt's token ids (int32 numpy is fastest) in
        the request's ``namespace`` (``core.isolation``: requests of two namespaces never
        route by each other's prefixes): its chunk keys here."""
        return token_keys(tokens, self.chunk_tokens, namespace)

    def route_tokens(self, request_id: RequestId, tokens: np.ndarray | Sequence[int],
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
