"""Urgent preemption, once for every engine: the rule, and each engine's room as a ``Room``.

A waiting request of a more urgent class that lacks a seat or KV room preempts less urgent
running requests.  Which ones is the core's rule, once (``fewest_victims``, which
``FeatherRuntime.urgent_victims`` applies: the fewest in Feather's order that make room,
each request at most ``max_urgent_preemptions`` times); whether a set of victims makes
room is the engine's arithmetic, which each engine answers through a ``Room``: vLLM's
(``integrations.vllm.urgent.Room``), SGLang's (``integrations.sglang.preemption.Room``)
and the simulator's over its block pool (``sim.engine.PoolRoom``).  Every engine then
preempts the whole set at once, with its own release mechanics, and admits the request.
Engines that make room before their pass (vLLM, the simulator) run one protocol,
``make_room``, given only their types and mechanics (``Engine``).  ``engine_members``
checks once the engine-private members a replay reads: a release without one turns
urgent preemption off with a warning, not a failure inside the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from feather_sched.core.view import R
from feather_sched.gates.base import Decision

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


def fewest_victims(candidates: list[R], room: Room[R],
                   last: Callable[[Sequence[R]], R]) -> list[R]:
    """The running requests to preempt together among ``candidates`` (those that may give
    way; the list is consumed): the shortest run of ``last``'s picks, each the end of
    Feather's order of those left (``preemption_victim``), that makes ``room``, less each
    member, the latest first, that the others make room without.  So no more go than
    the request needs: one for a seat; for KV room, not a group's members whose prefix
    stays held.  [] when even all of them leave no room.  O(k n log n) for a run of k,
    and up to 2k calls of ``room.made_by``."""
    made_by = room.made_by
    victims: list[R] = []
    found = False
    while candidates and not found:
        victims.append(last(candidates))
        candidates.remove(victims[-1])
        found = made_by(victims)
    if not found:
        return []
    for victim in victims[-2::-1]:
        rest = [v for v in victims if v is not victim]
        if made_by(rest):
            victims = rest
    return victims


class Answer(Protocol):
    """What ``make_room`` reads of the runtime's decision (``core.queue.Admission``)."""

    @property
    def request_id(self) -> Hashable: ...

    @property
    def decision(self) -> Decision: ...


class Urgency(Protocol[R]):
    """The runtime's calls ``make_room`` makes (``core.contract.RuntimeContract``'s, or a
    simulated policy's: ``sim.engine.UrgentPreemption``)."""

    def __len__(self) -> int: ...

    def candidate(self) -> R | None: ...

    def decide(self) -> Answer | None: ...

    def urgent_victims(self, running: Sequence[R], request: R, room: Room[R]) -> list[R]: ...

    def promise(self, request: R) -> object: ...


class Engine(Protocol[R]):
    """What ``make_room`` asks of an engine: its request type read, its room arithmetic
    and its own preemption."""

    def priority(self, request: R) -> int:
        """The request's class, lower more urgent."""

    def request_id(self, request: R) -> Hashable: ...

    def room(self, request: R) -> Room[R] | None:
        """A snapshot of the engine's room for waiting ``request`` (taken now, before any
        victim goes); None where the engine would not try to admit it in this pass."""

    def preempt(self, victim: R) -> None:
        """Preempt running ``victim`` by the engine's own mechanics (out of its running
        list, back to waiting, the runtime told)."""


def _call(action: Callable[..., Any], *args: Any) -> Any:
    return action(*args)


def make_room(runtime: Urgency[R], running: Sequence[R], engine: Engine[R],
              call: Callable[..., Any] = _call) -> R | None:
    """Before an engine's pass, room for the runtime's candidate if it is of a more urgent
    class than one of ``running`` and lacks a seat or KV room (``Engine.room``): where
    it is the runtime's ADD, the ``urgent_victims`` are preempted (``Engine.preempt``)
    and the ADD promised, so the pass admits it.  Returns the candidate where there is
    room for it in this pass, found or made; else None.  ``call`` runs each of the
    runtime's calls (the simulator's times them: the policy's part alone is charged).
    Cost: O(running) while the candidate is not more urgent, plus ``urgent_victims``'s."""
    if not running or not len(runtime):
        return None
    candidate = call(runtime.candidate)
    if candidate is None or \
            engine.priority(candidate) >= max(map(engine.priority, running)):
        return None
    room = engine.room(candidate)
    if room is None:
        return None
    if room.made_by(()):
        return candidate
    answer = call(runtime.decide)
    if answer is None or answer.decision is not Decision.ADD or \
            answer.request_id != engine.request_id(candidate):
        return None
    victims = call(runtime.urgent_victims, list(running), candidate, room)
    if not victims:
        return None
    for victim in victims:
        engine.preempt(victim)
    call(runtime.promise, candidate)
    return candidate
