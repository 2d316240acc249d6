"""Urgent preemption's one protocol: the rule here, each engine's room arithmetic behind ``Room``.

A waiting request of a more urgent class that lacks a seat or KV room preempts less urgent
running requests.  Which ones is the core's rule, once (``FeatherRuntime.urgent_victims``:
the fewest in Feather's order that make room, each request at most
``max_urgent_preemptions`` times); whether a set of victims makes room is the engine's
arithmetic, which each engine answers through a ``Room``: vLLM's
(``integrations.vllm.urgent.Room``), SGLang's (``integrations.sglang.preemption.Room``)
and the simulator's over its block pool (``sim.engine.PoolRoom``).  Every engine then
preempts the whole set at once, with its own release mechanics, and admits the request.

An adapter that replays an engine's arithmetic lists the private members it reads in one
tuple and checks them once (``engine_members``): an engine release without one turns
urgent preemption off with a warning instead of failing inside the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

R_contra = TypeVar("R_contra", contravariant=True)


class Room(Protocol[R_contra]):
    """Whether preempting a set of running requests lets one waiting request in now."""

    def made_by(self, victims: Sequence[R_contra]) -> bool:
        """Whether the waiting request gets a seat and its KV room (blocks, tokens) in the
        engine's coming admission once ``victims``, running requests, are preempted; by
        the engine's own arithmetic, from a snapshot taken before any is preempted (so a
        block or prefix a request that stays still holds frees nothing).  ``()`` asks
        whether there is room already.  Pure: it preempts nothing and changes no state.
        Cost: O(the victims' blocks), as ``urgent_victims`` calls it up to twice per
        victim it names."""
        ...


def engine_members(engine: object, names: Iterable[str], where: str,
                   logger: logging.Logger) -> bool:
    """Whether ``engine`` (an engine object, or its class) has every member of ``names``,
    the engine-private members a module replaying its arithmetic uses; if not, one warning
    on ``logger`` naming the missing ones and ``where`` (the feature turned off)."""
    missing = [name for name in names if not hasattr(engine, name)]
    if missing:
        logger.warning("%s is off: this engine release has no %s", where, ", ".join(missing))
    return not missing
