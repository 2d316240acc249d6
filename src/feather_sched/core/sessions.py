"""Agent sessions: which request continues which finished turn, whether a finished turn's
KV blocks are held for its session's next turn, for how long, and the bound on all holds.

Engine-agnostic: an adapter hands in block keys (chained, as vLLM's block hashes and
``core.isolation.token_keys`` are), block counts and times, and gets back which holds to
keep and which to release; it pins and unpins the blocks itself.  **Recognition**: a
client-named session, else a prompt extending a recently finished turn's prompt and
output, within one namespace.  **Hold**: a turn that ends with its session expected to go
on is held for ``min(max_ttl_s, gap, breakeven)`` (ski rental: a session that never
returns costs others at most one reload).  **Bound**: held blocks never exceed
``max_held_share`` of the pool, less valuable holds displaced first.  **Release** at
expiry, at the next turn's admission, or under pressure (``reclaim``), least valuable
first.  The rule in full: docs/sessions.md.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

TOOL_CALLS = "tool_calls"
"""The OpenAI finish reason of a turn that called a tool: its session goes on."""


@dataclass(frozen=True)
class RetentionConfig:
    """The retention rule's knobs (validated on construction)."""

    max_held_share: float = 0.5
    """At most this share of the KV pool's blocks is held for sessions."""
    max_ttl_s: float = 60.0
    gap_quantile: float = 0.9
    """The quantile of past gaps (turn end to next arrival) a hold covers."""
    default_gap_s: float = 10.0
    """The gap assumed for a session and namespace with none seen yet."""
    history: int = 32
    """Gaps kept per session and per namespace."""
    own_gaps: int = 8
    """Gaps a session must have shown before its own quantile replaces its namespace's."""
    max_sessions: int = 65536
    """Sessions remembered (least recently active forgotten first)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_held_share <= 1.0:
            raise ValueError(f"max_held_share must be in [0, 1], got {self.max_held_share}")
        if not 0.0 < self.gap_quantile <= 1.0:
            raise ValueError(f"gap_quantile must be in (0, 1], got {self.gap_quantile}")
        for name in ("max_ttl_s", "default_gap_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if min(self.history, self.max_sessions, self.own_gaps) < 1:
            raise ValueError("history, max_sessions and own_gaps must be positive")


@dataclass(frozen=True)
class Hold:
    """Blocks kept from eviction for a session's next turn: ``holder`` is the id under
    which the adapter pinned them (the turn that ended)."""

    holder: Hashable
    session: int
    blocks: int
    tokens: int
    since_s: float
    expires_s: float
    reload_s: float

    def value(self, now: float) -> float:
        """Reload seconds saved per held block, times the share of the TTL left."""
        ttl = self.expires_s - self.since_s
        left = 1.0 if ttl <= 0 else max(0.0, (self.expires_s - now) / ttl)
        return self.reload_s / max(self.blocks, 1) * left


@dataclass
class Session:
    """One agent program as the scheduler sees it: its namespace, the key its next turn
    must extend, its gaps, and its hold (if any)."""

    id: int
    namespace: Hashable
    tail: Hashable | None = None
    ended_s: float | None = None
    gaps: deque[float] = field(default_factory=deque)
    hold: Hold | None = None
    reason: str | None = None
    """How its last turn ended."""
    returns_untold: int = 0
    """Times it came back after a turn that did not end in a tool call."""
    returned: bool = False
    """Its next turn arrived while its hold stands: the hold lasts until it is admitted."""


@dataclass
class SessionCounts:
    """What retention did: holds made, refused for the bound, released and why, and next
    turns that found their hold (reloads avoided)."""

    held: int = 0
    refused: int = 0
    expired: int = 0
    reclaimed: int = 0
    displaced: int = 0
    continued: int = 0
    reloads_avoided: int = 0


class Sessions:
    """The session table and its holds for a pool of ``pool_blocks`` blocks;
    ``reload_s(tokens)`` prices recomputing a prefix.  Every call is O(request's keys)
    plus O(holds) where a hold is displaced or reclaimed."""

    def __init__(self, config: RetentionConfig, pool_blocks: int,
                 reload_s: Callable[[int], float]) -> None:
        if pool_blocks < 1:
            raise ValueError(f"pool_blocks must be positive, got {pool_blocks}")
        self.config, self.pool_blocks, self.reload_s = config, pool_blocks, reload_s
        self.counts = SessionCounts()
        self._sessions: OrderedDict[int, Session] = OrderedDict()
        self._by_tail: dict[tuple[Hashable, Hashable], int] = {}
        self._by_key: dict[tuple[Hashable, Hashable], int] = {}
        self._of_request: dict[Hashable, int] = {}
        self._namespace_gaps: dict[Hashable, deque[float]] = {}
        self._holds: dict[Hashable, Hold] = {}
        self._ids = itertools.count()

    # ---- state ------------------------------------------------------------------------

    @property
    def bound_blocks(self) -> int:
        """The most blocks all holds together may count."""
        return int(self.config.max_held_share * self.pool_blocks)

    @property
    def held_blocks(self) -> int:
        return sum(hold.blocks for hold in self._holds.values())

    @property
    def holds(self) -> list[Hold]:
        return list(self._holds.values())

    def session_of(self, request_id: Hashable) -> Session | None:
        index = self._of_request.get(request_id)
        return None if index is None else self._sessions.get(index)

    # ---- recognition ------------------------------------------------------------------

    def arrived(self, request_id: Hashable, namespace: Hashable, keys: Sequence[Hashable],
                now: float, explicit: Hashable | None = None) -> bool:
        """A request arrived: the session it continues (if any) records its gap.  Returns
        whether that session's blocks are held for it (a warm continuing turn)."""
        session = self._recognize(namespace, keys, explicit)
        if session is None:
            session = self._new(namespace, explicit)
        elif session.ended_s is not None:
            self._record_gap(session, max(0.0, now - session.ended_s))
            self.counts.continued += 1
            session.returns_untold += session.reason != TOOL_CALLS
        self._of_request[request_id] = session.id
        self._sessions.move_to_end(session.id)
        if session.hold is not None:
            self.counts.reloads_avoided += 1
            session.returned = True
            return True
        return False

    def _recognize(self, namespace: Hashable, keys: Sequence[Hashable],
                   explicit: Hashable | None) -> Session | None:
        """The explicit key's session, else the one whose tail is the longest leading key
        of ``keys`` (the prefix match), in ``namespace`` only."""
        if explicit is not None:
            index = self._by_key.get((namespace, explicit))
            return None if index is None else self._sessions.get(index)
        by_tail = self._by_tail
        for key in reversed(keys):
            index = by_tail.get((namespace, key))
            if index is not None and index in self._sessions:
                return self._sessions[index]
        return None

    def _new(self, namespace: Hashable, explicit: Hashable | None) -> Session:
        session = Session(next(self._ids), namespace)
        self._sessions[session.id] = session
        if explicit is not None:
            self._by_key[(namespace, explicit)] = session.id
        excess = len(self._sessions) - self.config.max_sessions
        if excess > 0:  # least recently active first; a held session is never forgotten
            idle = [s for s in self._sessions.values() if s.hold is None][:excess]
            for old in idle:
                self._forget(old)
        return session

    def _forget(self, session: Session) -> None:
        del self._sessions[session.id]
        if session.tail is not None:
            self._by_tail.pop((session.namespace, session.tail), None)

    def _record_gap(self, session: Session, gap: float) -> None:
        limit = self.config.history
        for gaps in (session.gaps, self._namespace_gaps.setdefault(session.namespace, deque())):
            gaps.append(gap)
            while len(gaps) > limit:
                gaps.popleft()

    # ---- holds ------------------------------------------------------------------------

    def turn_ended(self, request_id: Hashable, keys: Sequence[Hashable], blocks: int,
                   tokens: int, now: float, finish_reason: str | None = None
                   ) -> tuple[Hold | None, list[Hold]]:
        """A request ended holding ``blocks`` blocks over ``tokens`` tokens; ``keys`` are
        its prompt-and-output full-block keys (what its next turn extends).  Returns the
        hold to make (None: free the blocks as usual) and the holds it displaces (the
        adapter releases them first)."""
        session = self.session_of(request_id)
        self._of_request.pop(request_id, None)
        if session is None:
            return None, []
        self._retail(session, keys[-1] if keys else None)
        session.ended_s, session.reason = now, finish_reason
        ttl = self.ttl_s(session, tokens, blocks)
        if ttl is None or not self._expected(session, finish_reason) or blocks < 1:
            return None, []
        hold = Hold(request_id, session.id, blocks, tokens, now, now + ttl,
                    self.reload_s(tokens))
        displaced = self._room_for(hold, now)
        if displaced is None:
            self.counts.refused += 1
            return None, []
        session.hold = hold
        self._holds[request_id] = hold
        self.counts.held += 1
        return hold, displaced

    def _retail(self, session: Session, tail: Hashable | None) -> None:
        if session.tail is not None:
            self._by_tail.pop((session.namespace, session.tail), None)
        session.tail = tail
        if tail is not None:
            self._by_tail[(session.namespace, tail)] = session.id

    def _expected(self, session: Session, finish_reason: str | None) -> bool:
        """Whether the session is expected to go on: its turn called a tool, or it came
        back before after a turn that did not (a chat's user returns; an agent's final
        answer does not)."""
        return finish_reason == TOOL_CALLS or session.returns_untold > 0

    def ttl_s(self, session: Session, tokens: int, blocks: int) -> float | None:
        """The rule's TTL for holding ``blocks`` over ``tokens`` (None: do not hold, as
        where ``max_ttl_s`` is 0)."""
        gaps = session.gaps if len(session.gaps) >= self.config.own_gaps else \
            self._namespace_gaps.get(session.namespace) or session.gaps
        gap = quantile(gaps, self.config.gap_quantile) if gaps else self.config.default_gap_s
        breakeven = self.reload_s(tokens) * self.pool_blocks / max(blocks, 1)
        ttl = min(self.config.max_ttl_s, breakeven, gap)
        return ttl if ttl > 0 else None

    def _room_for(self, hold: Hold, now: float) -> list[Hold] | None:
        """Holds to displace, least valuable first, so that ``hold`` fits the bound (None:
        it does not fit even so, or only by displacing ones worth more)."""
        excess = self.held_blocks + hold.blocks - self.bound_blocks
        if excess <= 0:
            return []
        value = hold.value(now)
        displaced = []
        for other in sorted(self._holds.values(), key=lambda h: (h.value(now), h.since_s)):
            if excess <= 0 or other.value(now) >= value:
                break
            displaced.append(other)
            excess -= other.blocks
        if excess > 0:
            return None
        for other in displaced:
            self._drop(other)
        self.counts.displaced += len(displaced)
        return displaced

    def admitted(self, request_id: Hashable) -> Hold | None:
        """A request was admitted: its session's hold (if any) ends; the adapter unpins it
        after the request has taken its blocks."""
        session = self.session_of(request_id)
        if session is None or session.hold is None:
            return None
        hold = session.hold
        self._drop(hold)
        return hold

    def expire(self, now: float) -> list[Hold]:
        """Holds whose TTL has run out and whose next turn has not arrived, released."""
        gone = [hold for hold in self._holds.values() if hold.expires_s <= now
                and not self._sessions[hold.session].returned]
        for hold in gone:
            self._drop(hold)
        self.counts.expired += len(gone)
        return gone

    def reclaim(self, blocks: int, now: float) -> list[Hold]:
        """Under pressure: release holds, least valuable (then oldest) first, until at
        least ``blocks`` blocks are released or none is left."""
        gone = []
        for hold in sorted(self._holds.values(), key=lambda h: (h.value(now), h.since_s)):
            if blocks <= 0:
                break
            gone.append(hold)
            blocks -= hold.blocks
        for hold in gone:
            self._drop(hold)
        self.counts.reclaimed += len(gone)
        return gone

    def _drop(self, hold: Hold) -> None:
        del self._holds[hold.holder]
        session = self._sessions.get(hold.session)
        if session is not None and session.hold is hold:
            session.hold, session.returned = None, False


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank, the smallest value at or above it)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
