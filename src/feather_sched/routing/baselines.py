"""The baseline routers FeatherRouter is measured against, and router names in one place.

Each has ``Router``'s interface (``route``, ``finished``, ``add_replica``,
``remove_replica``) and its load: requests routed and not finished.  ``round-robin``;
``power-of-two`` (Ray Serve's default); ``prefix-affinity`` (Ray Serve's
``PrefixCacheAffinityRouter`` rule); ``sglang-cache-aware`` (SGLang's router
``cache_aware`` policy); ``feather`` (``router.FeatherRouter``).  Both prefix rules
remember every prompt routed, per replica, without eviction, at chunk granularity.  Each
rule with its thresholds and source: docs/replicas.md, "Baselines and the simulator".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from feather_sched.routing.feather import FeatherRouter
from feather_sched.routing.prefix_index import ChunkKey, PrefixIndex, Replica, SessionId
from feather_sched.routing.router import Router


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self, replicas: Iterable[Replica] = (), **options: Any) -> None:
        super().__init__(replicas, **options)
        self._turn = 0

    def _choose(self, keys: Sequence[ChunkKey], session: SessionId | None) -> Replica:
        self._turn += 1
        return self._replicas[(self._turn - 1) % len(self._replicas)]


class PowerOfTwoRouter(Router):
    name = "power-of-two"

    def _choose(self, keys: Sequence[ChunkKey], session: SessionId | None) -> Replica:
        return self._two_choices()


class _HistoryRouter(Router):
    """A rule that reads which prompts went where (never forgotten, as the trees of Ray's
    and SGLang's routers without eviction)."""

    def __init__(self, replicas: Iterable[Replica] = (), **options: Any) -> None:
        self.history = PrefixIndex(max_idle_keys=None)
        super().__init__(replicas, **options)

    def _routed(self, replica: Replica, keys: Sequence[ChunkKey]) -> None:
        self.history.add(replica, keys)

    def _removed(self, replica: Replica) -> None:
        self.history.drop(replica)

    def _match(self, keys: Sequence[ChunkKey]) -> tuple[float, dict[Replica, int]]:
        """The share of the prompt's chunks some replica was sent, and those replicas."""
        depth, holders = self.history.match(keys)
        return (depth / len(keys) if keys else 0.0), holders

    def _spread(self) -> int:
        loads = self._load.values()
        return max(loads) - min(loads)


class PrefixAffinityRouter(_HistoryRouter):
    """Ray Serve's ``PrefixCacheAffinityRouter`` rule (see the module docstring)."""

    name = "prefix-affinity"

    def __init__(self, replicas: Iterable[Replica] = (), *, imbalanced_threshold: int = 10,
                 match_rate_threshold: float = 0.1, **options: Any) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        super().__init__(replicas, **options)

    def _choose(self, keys: Sequence[ChunkKey], session: SessionId | None) -> Replica:
        if self._spread() > self.imbalanced_threshold:
            return self._two_choices()
        rate, holders = self._match(keys)
        if rate >= self.match_rate_threshold:
            return self._least_loaded(holders)
        return self._least_loaded(self.history.fewest_keys(self._replicas))


class CacheAwareRouter(_HistoryRouter):
    """SGLang's router ``cache_aware`` policy (see the module docstring)."""

    name = "sglang-cache-aware"

    def __init__(self, replicas: Iterable[Replica] = (), *, cache_threshold: float = 0.5,
                 balance_abs: int = 32, balance_rel: float = 1.1, **options: Any) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        super().__init__(replicas, **options)

    def _choose(self, keys: Sequence[ChunkKey], session: SessionId | None) -> Replica:
        loads = self._load.values()
        if self._spread() > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            return self._least_loaded(self._replicas)
        rate, holders = self._match(keys)
        if rate > self.cache_threshold:
            return self._least_loaded(holders)
        return self._least_loaded(self.history.fewest_keys(self._replicas))


ROUTER_CLASSES: dict[str, type[Router]] = {cls.name: cls for cls in (
    RoundRobinRouter, PowerOfTwoRouter, PrefixAffinityRouter, CacheAwareRouter, FeatherRouter)}
"""Every router by name: the baselines and ``FeatherRouter`` (Ray's request routers by
name are ``integrations.ray.app.RAY_ROUTERS``)."""


def make_router(name: str, replicas: Iterable[Replica] = (), **options: Any) -> Router:
    """The router of a name (``ROUTER_CLASSES``) over ``replicas``; ValueError naming the choices.
    ``options`` go to its constructor (``seed``, ``chunk_tokens``, the rule's thresholds)."""
    try:
        cls = ROUTER_CLASSES[name.strip()]
    except KeyError:
        raise ValueError(f"unknown router {name!r}: use {', '.join(ROUTER_CLASSES)}") from None
    return cls(replicas, **options)
