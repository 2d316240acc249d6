"""Isolation: the namespace of a request's prefix keys, so that requests whose KV must not
be shared are never grouped, ranked or ordered by each other's prefixes.

A prefix matched across an isolation boundary is a channel: Feather's order, and with it
a request's speed, would reveal another's prompt even where the engine never shares
their KV.  So a request's keys live in its **namespace**, and keys of two namespaces
never match (bar a 64-bit collision): its engine's **boundary** (what besides the tokens
the engine's prefix cache keys by, as the adapter reads it; empty for a plain request)
and, under ``isolate_tenants``, its **tenant** where it names one.

Keys come in two kinds: token keys Feather digests itself (``token_keys``: the namespace
seeds the digest), and an engine's own keys (``engine_keys``: vLLM's block hashes, which
hold vLLM's boundary already; the tenant, where isolated, is paired with each key).  Plain
requests pay nothing.  What each engine's boundary holds: docs/isolation.md.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import xxhash

from feather_sched.core.cht import ChunkKey, token_chunk_keys
from feather_sched.core.tenants import DEFAULT_TENANT

PRIMITIVES = (str, int, float, bool, bytes, type(None))
"""The types a namespace is made of (tuples of them too): their ``repr`` is the same in
every process, so the seed is; an object's may carry its address."""


def primitive(part: object) -> bool:
    """Whether ``part`` is one of ``PRIMITIVES`` exactly (no subclass: an enum's ``repr``
    is its own) or a tuple of such parts.  O(size of part)."""
    if type(part) is tuple:
        return all(primitive(item) for item in part)
    return type(part) in PRIMITIVES


@dataclass(frozen=True)
class Namespace:
    """Where a request's prefix keys live: its engine ``boundary`` (the parts of it the
    request has, e.g. ``("cache_salt", "s")``) and its ``tenant`` where tenants are
    isolated (else None); primitives only (``primitive``; TypeError otherwise)."""

    boundary: tuple[Hashable, ...] = ()
    tenant: Hashable | None = None

    def __post_init__(self) -> None:
        if not primitive((self.boundary, self.tenant)):
            raise TypeError(f"a namespace is made of str, int, float, bool, bytes, None and "
                            f"tuples of them, not {self!r}")

    @property
    def shared(self) -> bool:
        """The namespace of plain requests (no boundary, no isolated tenant)."""
        return not self.boundary and self.tenant is None

    @cached_property
    def seed(self) -> int:
        """A 64-bit digest of the namespace (0 for the shared one): the same in every
        process, as it digests the ``repr`` of primitives."""
        return 0 if self.shared else xxhash.xxh3_64_intdigest(repr(self).encode()) or 1

    def beyond_engine(self) -> Namespace:
        """What an engine's own keys do not hold of this namespace: its tenant."""
        return Namespace((), self.tenant)


SHARED = Namespace()


def token_keys(tokens: np.ndarray | Sequence[int], chunk_tokens: int,
               namespace: Namespace = SHARED) -> list[int]:
    """``cht.token_chunk_keys`` of ``tokens`` inside ``namespace`` (its seed starts the
    digest).  O(tokens)."""
    return token_chunk_keys(tokens, chunk_tokens, namespace.seed)


def engine_keys(keys: Sequence[ChunkKey], namespace: Namespace) -> list:
    """An engine's own keys inside ``namespace``: unchanged where it is shared, else each
    paired with its seed.  ``namespace`` is what the keys do not hold already
    (``Namespace.beyond_engine``).  O(keys)."""
    if namespace.shared:
        return list(keys)
    seed = namespace.seed
    return [(seed, key) for key in keys]


class Isolation:
    """The namespaces of one engine's requests: its boundary, and its tenant where
    ``isolate_tenants`` (Feather's option) says so."""

    def __init__(self, isolate_tenants: bool = False) -> None:
        self.isolate_tenants = isolate_tenants

    def namespace(self, boundary: Iterable[Hashable] = (),
                  tenant_of: Callable[[], Hashable] | None = None) -> Namespace:
        """A request's namespace: the ``boundary`` parts it has (None parts dropped) and,
        under ``isolate_tenants``, the tenant ``tenant_of()`` names (None and
        ``DEFAULT_TENANT`` name none; it is called only then)."""
        tenant = tenant_of() if self.isolate_tenants and tenant_of is not None else None
        return Namespace(tuple(part for part in boundary if part is not None),
                         None if tenant == DEFAULT_TENANT else tenant)
