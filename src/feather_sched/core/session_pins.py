"""An engine's sessions: ``core.sessions``'s rule, the warm turns it names and what each
hold pins in the engine's KV pool, the pin itself behind one method an adapter supplies.

vLLM's adapter pins a hold's blocks with one more reference each, SGLang's with a tree
lock; everything else they do around the rule (recognition, admission, expiry, yielding
under pressure, release) is here once.  Cost: as ``Sessions``, plus O(holds) where holds
are released.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic, TypeVar

from feather_sched.core.sessions import Hold, ReloadCost, RetentionConfig, Sessions
from feather_sched.telemetry import prometheus as metrics

Pin = TypeVar("Pin")
"""What keeps one hold's KV in the engine (vLLM: its blocks; SGLang: a tree lock)."""
Waiting = TypeVar("Waiting")
"""An engine's waiting request."""


class PinnedSessions(Generic[Pin]):
    """The rule over a pool of ``pool_blocks`` blocks (``RetentionConfig`` with
    ``held_share``), priced by the engine's measured reload cost (``cost``), timed by
    ``clock``; metrics under ``name``.  Subclasses supply ``unpin``."""

    def __init__(self, held_share: float, pool_blocks: int, clock: Callable[[], float],
                 name: str) -> None:
        self.cost = ReloadCost()
        self.sessions = Sessions(RetentionConfig(max_held_share=held_share),
                                 max(pool_blocks, 1), self.cost.seconds)
        self.clock = clock
        self.warm: set[str] = set()
        """Waiting continuing turns whose prefix is warm (their session's hold stands, or
        at least half their prompt is cached): Feather's class 0."""
        self.pins: dict[str, Pin] = {}
        """Each hold's pin, by its holder (the request whose turn ended)."""
        self.sink = metrics.SessionSink(name) if metrics.enabled() else None

    def unpin(self, pin: Pin) -> None:
        """Let the engine evict what ``pin`` kept (still cached until it does)."""
        raise NotImplementedError

    # ---- requests ---------------------------------------------------------------------

    def recognise(self, request_id: str, namespace: Hashable, keys: Sequence[Hashable],
                  explicit: Hashable | None, mostly_cached: Callable[[], bool]) -> None:
        """A new request: the session it continues found (``Sessions.arrived``); it is
        warm where its session's hold stands or ``mostly_cached()`` (asked only then)."""
        held = self.sessions.arrived(request_id, namespace, keys, self.clock(), explicit)
        session = self.sessions.session_of(request_id)
        if session is not None and session.ended_s is not None and (held or mostly_cached()):
            self.warm.add(request_id)

    def admitted(self, request_id: str) -> None:
        """The engine admitted the request (its prefix taken): its session's hold ends."""
        self.warm.discard(request_id)
        hold = self.sessions.admitted(request_id)
        if hold is not None:
            self.release([hold])

    def join_overdue(self, waiting: Callable[[], Iterable[Waiting]], max_wait_s: float | None,
                     now: float, id_of: Callable[[Waiting], str],
                     class_of: Callable[[Waiting], Hashable],
                     arrival_of: Callable[[Waiting], float]) -> list[Waiting]:
        """The requests ``waiting()`` lists past ``max_wait_s`` in an engine class where
        warm turns wait, now warm themselves: the adapter re-enters them in Feather's queue
        (arrival kept), whose starvation guard ages them first, so warm turns overtake
        within ``max_wait_s`` only.  O(waiting) while warm turns wait; O(1), ``waiting``
        not called, otherwise."""
        warm = self.warm
        if not warm or max_wait_s is None:
            return []
        members = list(waiting())
        classes = {class_of(r) for r in members if id_of(r) in warm}
        late = [r for r in members if id_of(r) not in warm and class_of(r) in classes
                and now - arrival_of(r) > max_wait_s]
        warm.update(id_of(r) for r in late)
        return late

    def ending(self, request_id: str) -> bool:
        """The request's turn is ending: no longer warm; whether it has a session (else
        nothing more to do for it)."""
        self.warm.discard(request_id)
        return self.sessions.session_of(request_id) is not None

    def turn_ended(self, request_id: str, keys: Sequence[Hashable], blocks: int, tokens: int,
                   reason: str, held: Sequence[Hashable], pin: Callable[[], Pin]) -> None:
        """The turn of a request with a session ended (``Sessions.turn_ended``'s
        arguments): the holds it displaces go first, then, where the rule holds this turn,
        ``pin()`` keeps it."""
        hold, released = self.sessions.turn_ended(request_id, keys, blocks, tokens,
                                                  self.clock(), reason, held=held)
        self.release(released)  # first: the pool never pins more than the bound
        if hold is not None:
            self.pins[request_id] = pin()

    def left(self, request_id: str, keys: Sequence[Hashable]) -> None:
        """The engine dropped the request unrun (aborted while waiting; ``keys``: its
        prompt's): its session forgets it, and a hold its arrival found is released (a
        hold whose turn came never lapses, so nothing else would end it before
        pressure)."""
        if self.ending(request_id):
            _, released = self.sessions.turn_ended(request_id, keys, 0, 0, self.clock(),
                                                   "abort")
            self.release(released)

    # ---- pressure, metrics, the end ---------------------------------------------------

    def expire(self) -> None:
        """Holds past their TTL whose turn has not come end (each round or pass)."""
        now = self.clock()
        if any(hold.expires_s <= now for hold in self.sessions.holds):
            self.release(self.sessions.reclaim(sys.maxsize, now, lapsed_only=True))

    def yields(self, waited_s: float | None = None, max_wait_s: float | None = None) -> bool:
        """The engine lacks KV room for work that has waited ``waited_s`` (None: work that
        cannot wait): whether a hold gave some back (``Sessions.yield_for`` decides
        which, least valuable first, if any)."""
        gone = self.sessions.yield_for(waited_s, self.clock(), max_wait_s)
        self.release(gone)
        return bool(gone)

    def publish(self) -> None:
        """The holds and counts to the metrics (each step)."""
        if self.sink is not None:
            self.sessions.publish(self.sink)

    def release(self, holds: Iterable[Hold]) -> None:
        """The holds' pins go (``unpin``)."""
        for hold in holds:
            pin = self.pins.pop(str(hold.holder), None)
            if pin is not None:
                self.unpin(pin)

    def release_all(self) -> None:
        """Every hold ends (a cache flush or reset, Feather off, shutdown)."""
        self.release(self.sessions.reclaim(sys.maxsize, self.clock()))
        for holder in list(self.pins):  # none, unless the rule lost one: never leak
            self.unpin(self.pins.pop(holder))
