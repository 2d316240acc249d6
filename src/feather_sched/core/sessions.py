"""Agent sessions: which request continues which finished turn, whether a finished turn's
KV blocks are held for its session's next turn, for how long, and the bound on all holds.

Engine-agnostic: an adapter hands in block keys (chained, as vLLM's block hashes and
``core.isolation.token_keys`` are), block counts and times, and gets back which holds to
keep and which to release; it pins and unpins the blocks itself.  **Recognition**: a
client-named session, else a prompt extending a recently finished turn's prompt and
output, within one namespace.  **Hold**: a turn that ends with its session expected to go
on is held for ``min(max_ttl_s, gap, breakeven)`` (ski rental: a session that never
returns costs others at most one reload).  **Bound**: held blocks never exceed
``max_held_share`` of the pool (distinct blocks), less valuable holds displaced first.
**Release** at the next turn's admission or when blocks are needed (``reclaim``), least
valuable first; at its TTL a hold lapses, worth 0.  The rule in full: docs/sessions.md.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from feather_sched.telemetry.prometheus import SessionSink

TOOL_CALLS = "tool_calls"
"""The OpenAI finish reason of a turn that called a tool: its session goes on."""
CUT_SHORT = frozenset({"abort", "error"})
"""Finish reasons of a turn that did not end as its model chose (an engine's abort or
error): its blocks are never held, whatever its session's history."""


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
    keys: tuple[Hashable, ...] = ()
    """Its blocks' keys (the rest of its ``blocks`` are unkeyed: counted as its own)."""

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
        self._key_holds: dict[Hashable, int] = {}
        """Holds counting each held key: a block shared by holds counts once."""
        self._unkeyed = 0
        self._ids = itertools.count()

    # ---- state ------------------------------------------------------------------------

    @property
    def bound_blocks(self) -> int:
        """The most blocks all holds together may count."""
        return int(self.config.max_held_share * self.pool_blocks)

    @property
    def held_blocks(self) -> int:
        """Distinct blocks the holds count: each held key once, plus unkeyed blocks."""
        return len(self._key_holds) + self._unkeyed

    @property
    def holds(self) -> list[Hold]:
        return list(self._holds.values())

    def publish(self, sink: SessionSink) -> None:
        """Hand the holds and counts to a metrics sink (an adapter calls it each step)."""
        sink.observe(len(self._holds), self.held_blocks, vars(self.counts))

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
                   tokens: int, now: float, finish_reason: str | None = None,
                   held: Sequence[Hashable] | None = None) -> tuple[Hold | None, list[Hold]]:
        """A request ended holding ``blocks`` blocks over ``tokens`` tokens; ``keys`` are
        its prompt-and-output full-block keys (what its next turn extends); ``held``, where
        given, names the ``blocks`` blocks as the engine's pool does (its block ids: a
        block two holds name counts once), else they are ``keys[:blocks]``.  Returns the
        hold to make (None: free the blocks as usual) and the holds to release first: those
        it displaces, and a hold of the same session that no turn took (its turn ended
        without admission, or two of its turns overlapped)."""
        session = self.session_of(request_id)
        self._of_request.pop(request_id, None)
        if session is None:
            return None, []
        standing = self._untaken(session)
        self._retail(session, keys[-1] if keys else None)
        session.ended_s, session.reason = now, finish_reason
        ttl = self.ttl_s(session, tokens, blocks)
        if ttl is None or not self._expected(session, finish_reason) or blocks < 1:
            return None, standing
        named = tuple(held) if held is not None else \
            tuple((session.namespace, key) for key in keys[:blocks])
        hold = Hold(request_id, session.id, blocks, tokens, now, now + ttl,
                    self.reload_s(tokens), named)
        displaced = self._room_for(hold, now)
        if displaced is None:
            self.counts.refused += 1
            return None, standing
        session.hold = hold
        self._holds[request_id] = hold
        self._account(hold, 1)
        self.counts.held += 1
        return hold, standing + displaced

    def _untaken(self, session: Session) -> list[Hold]:
        """The session's standing hold, dropped (counted displaced): a turn of the session
        ended, so no turn will take it."""
        hold = session.hold
        if hold is None:
            return []
        self._drop(hold)
        self.counts.displaced += 1
        return [hold]

    def _retail(self, session: Session, tail: Hashable | None) -> None:
        if session.tail is not None:
            self._by_tail.pop((session.namespace, session.tail), None)
        session.tail = tail
        if tail is not None:
            self._by_tail[(session.namespace, tail)] = session.id

    def _expected(self, session: Session, finish_reason: str | None) -> bool:
        """Whether the session is expected to go on: its turn called a tool, or it came
        back before after a turn that did not (a chat's user returns; an agent's final
        answer does not); never after a turn cut short (``CUT_SHORT``)."""
        if finish_reason in CUT_SHORT:
            return False
        return finish_reason == TOOL_CALLS or session.returns_untold > 0

    def ttl_s(self, session: Session, tokens: int, blocks: int) -> float | None:
        """The rule's TTL for holding ``blocks`` over ``tokens``; None (do not hold) where
        it is 0 (``max_ttl_s`` 0) or shorter than the median gap: such a hold would most
        likely lapse before its turn comes, keeping room from others for nothing (where a
        reload is cheap against the pool a hold takes, as on a small CPU engine)."""
        gaps = session.gaps if len(session.gaps) >= self.config.own_gaps else \
            self._namespace_gaps.get(session.namespace) or session.gaps
        gap, median = quantiles(gaps, self.config.gap_quantile, 0.5) if gaps else \
            (self.config.default_gap_s, self.config.default_gap_s)
        breakeven = self.reload_s(tokens) * self.pool_blocks / max(blocks, 1)
        ttl = min(self.config.max_ttl_s, breakeven, gap)
        return ttl if ttl > 0 and ttl >= median else None

    def _room_for(self, hold: Hold, now: float) -> list[Hold] | None:
        """Holds to displace, least valuable first, so that ``hold``'s blocks not yet
        held fit the bound (None: they do not fit even so, or only by displacing ones
        worth more).  O(holds' keys) where some are displaced."""
        if self._fits(hold):
            return []
        value, displaced = self._worth(hold, now), []
        for other in self._by_worth(now):
            if self._worth(other, now) >= value:
                break
            self._account(other, -1)
            displaced.append(other)
            if self._fits(hold):
                lapsed = sum(self._lapsed(gone, now) for gone in displaced)
                for gone in displaced:
                    self._drop(gone, accounted=False)
                self.counts.expired += lapsed
                self.counts.displaced += len(displaced) - lapsed
                return displaced
        for other in displaced:
            self._account(other, 1)
        return None

    def _fits(self, hold: Hold) -> bool:
        new = sum(key not in self._key_holds for key in hold.keys)
        return self.held_blocks + new + hold.blocks - len(hold.keys) <= self.bound_blocks

    def _worth(self, hold: Hold, now: float) -> float:
        """A hold's value; one whose next turn has arrived is worth its full value (its
        return is certain), whatever is left of its TTL."""
        session = self._sessions.get(hold.session)
        return hold.value(hold.since_s if session is not None and session.returned else now)

    def _by_worth(self, now: float) -> list[Hold]:
        return sorted(self._holds.values(), key=lambda h: (self._worth(h, now), h.since_s))

    def _account(self, hold: Hold, sign: int) -> None:
        """Count ``hold``'s blocks in (``sign`` 1) or out (-1) of ``held_blocks``."""
        counts = self._key_holds
        for key in hold.keys:
            left = counts.get(key, 0) + sign
            if left:
                counts[key] = left
            else:
                del counts[key]
        self._unkeyed += sign * (hold.blocks - len(hold.keys))

    def admitted(self, request_id: Hashable) -> Hold | None:
        """A request was admitted: its session's hold (if any) ends; the adapter unpins it
        after the request has taken its blocks."""
        session = self.session_of(request_id)
        if session is None or session.hold is None:
            return None
        hold = session.hold
        self._drop(hold)
        return hold

    def reclaim(self, blocks: int, now: float, lapsed_only: bool = False) -> list[Hold]:
        """Under pressure: release holds, least valuable (then oldest) first, until at
        least ``blocks`` blocks are released or none is left; ``lapsed_only``: only holds
        past their TTL whose next turn has not arrived (worth 0, so they go first)."""
        gone = []
        for hold in self._by_worth(now):
            if blocks <= 0 or (lapsed_only and not self._lapsed(hold, now)):
                break
            gone.append(hold)
            blocks -= hold.blocks
        lapsed = sum(self._lapsed(hold, now) for hold in gone)
        for hold in gone:
            self._drop(hold)
        self.counts.expired += lapsed
        self.counts.reclaimed += len(gone) - lapsed
        return gone

    def yield_for(self, waited_s: float | None, now: float,
                  max_wait_s: float | None = None) -> list[Hold]:
        """The engine lacks KV room for work that has waited ``waited_s`` (None: work that
        cannot wait, a running request's growth or a step that would stall): the hold to
        release (``reclaim`` of one block, least valuable first), or none.  It yields to
        such work at once, to a waiting request only once its wait reaches ``max_wait_s``:
        a hold keeps its room from newcomers, lapsed or not (docs/sessions.md: yielding
        to them cost the agents' JCT in the simulator)."""
        if waited_s is not None and (max_wait_s is None or waited_s < max_wait_s):
            return []
        return self.reclaim(1, now)

    def _lapsed(self, hold: Hold, now: float) -> bool:
        return hold.expires_s <= now and not self._sessions[hold.session].returned

    def _drop(self, hold: Hold, accounted: bool = True) -> None:
        del self._holds[hold.holder]
        if accounted:
            self._account(hold, -1)
        session = self._sessions.get(hold.session)
        if session is not None and session.hold is hold:
            session.hold, session.returned = None, False


PRIOR_S_PER_TOKEN = 1e-4
"""What recomputing a prompt token costs before the engine's steps have been measured."""


class ReloadCost:
    """What recomputing a prefix costs the engine: an average of the measured step seconds
    per scheduled token over steps of at least ``min_tokens`` tokens (prefill steps
    mostly), ``PRIOR_S_PER_TOKEN`` before any.  O(1)."""

    def __init__(self, min_tokens: int = 64, weight: float = 0.1) -> None:
        self.min_tokens, self.weight = min_tokens, weight
        self.per_token_s = PRIOR_S_PER_TOKEN
        self._measured = False

    def observe(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` tokens in ``seconds``."""
        if tokens < self.min_tokens or seconds <= 0:
            return
        rate = seconds / tokens
        self.per_token_s = rate if not self._measured else \
            self.per_token_s + self.weight * (rate - self.per_token_s)
        self._measured = True

    def seconds(self, tokens: int) -> float:
        return tokens * self.per_token_s


def quantiles(values: Sequence[float], *qs: float) -> tuple[float, ...]:
    """The ``qs`` quantiles of ``values`` (nearest rank: the smallest value at or above
    each), from one sort. O(n log n)."""
    ordered = sorted(values)
    return tuple(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
                 for q in qs)
