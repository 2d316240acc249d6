"""``FeatherRouter``: keeps each prefix on the replicas caching it while load allows, and
load even.  It routes by an index of what each replica caches (``RouterIndex``):
``ApproximateIndex`` (here: a guess from the requests routed) or
``cache_index.PreciseIndex`` (the engines' own KV events).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol, cast

from feather_sched.core.cht import DEFAULT_CHUNK_TOKENS
from feather_sched.core.isolation import SHARED, Namespace, token_keys
from feather_sched.routing.prefix_index import (
    ChunkKey,
    PrefixIndex,
    Replica,
    SessionId,
)
from feather_sched.routing.router import Router


class RouterIndex(Protocol):
    """What ``FeatherRouter`` routes by: how a prompt is keyed, and which replicas hold how
    much of it.  Depths are in the index's own units (chunks, blocks)."""

    name: str

    def keys(self, tokens: Sequence[int], namespace: Namespace = SHARED
             ) -> Sequence[ChunkKey]:
        """A prompt's keys in its ``namespace`` (computed once per request)."""
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

    def keys(self, tokens: Sequence[int], namespace: Namespace = SHARED
             ) -> Sequence[ChunkKey]:
        return token_keys(tokens, self.chunk_tokens, namespace)

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

    The **band**: the replicas whose load (requests routed and not finished) exceeds
    neither the least loaded one's plus ``balance_abs`` nor its times ``balance_rel``.  A
    session's request goes to its last replica if in the band; else the in-band replica
    holding the longest prefix of the prompt (ties: the least loaded); where holders exist
    but none is in the band, the less loaded of two random replicas; a prefix nobody holds,
    the least loaded in-band replica holding the ``fewest``.  "Holding" is the ``index``'s
    (``ApproximateIndex`` by default, or ``cache_index.PreciseIndex``).  The ``max_sessions``
    most recent sessions are remembered.

    Cost per request: the index's (O(keys) on route and finish) plus O(replicas) for the
    loads.  The rule, its defaults and what they were measured against: docs/replicas.md.
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

    def keys(self, tokens: Sequence[int], namespace: Namespace = SHARED
             ) -> Sequence[ChunkKey]:
        return self.index.keys(tokens, namespace)

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
