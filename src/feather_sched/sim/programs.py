"""Agent programs in the simulator: a closed loop of turns, and what a finished turn's
KV blocks become.

``run_programs`` releases each program's next turn its tool time after the previous turn
ends (``workloads.agents``; ``TurnQueue``, shared with ``sim.program_replicas``), into one
``SimEngine``.  A ``Retention`` decides what a finished turn's blocks become, after
caching the turn's output blocks under the next turn's keys (as vLLM caches every full
block computed): ``LruRetention`` frees them to the LRU cache (vLLM 0.34);
``TtlRetention`` replays CacheTTL's rule (arXiv 2511.02230: pinned for a TTL fitted to
the tool times seen, no bound, program-level FCFS, ``ProgramFcfsPolicy``);
``SessionRetention`` is Feather's (``core.sessions``), with a continuing turn whose
prefix is warm entering Feather's queue in class 0, others in class 1 (``SessionView``).
Each rule in full: docs/sessions.md, "Baselines".
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from feather_sched.core.config import FeatherConfig
from feather_sched.core.contract import RuntimeContract
from feather_sched.core.isolation import Namespace
from feather_sched.core.runtime import FeatherRuntime
from feather_sched.core.sessions import Hold, RetentionConfig, Sessions
from feather_sched.results.records import RequestRecord
from feather_sched.sim.block_pool import BlockKeys
from feather_sched.sim.engine import SimEngine, SimRequest, SimResult, StepCostModel
from feather_sched.sim.fcfs import PriorityPolicy
from feather_sched.sim.policies import SimRequests, make_policy
from feather_sched.telemetry.steplog import BatchEntry
from feather_sched.workloads.agents import TOOL_CALLS, AgentTurn, AgentWorkload
from feather_sched.workloads.spec import RequestSpec


def reload_seconds(cost_model: StepCostModel, chunk_tokens: int) -> Callable[[int], float]:
    """What recomputing a prefix of ``tokens`` costs the engine alone: its prefill in
    chunks of ``chunk_tokens``, priced by the cost model (cached per token count)."""
    @cache
    def seconds(tokens: int) -> float:
        total, done = 0.0, 0
        while done < tokens:
            new = min(chunk_tokens, tokens - done)
            done += new
            total += cost_model.step([BatchEntry(0, 0, done, new)]).seconds
        return total
    return seconds


@dataclass
class Turns:
    """Each request id's turn, program start and next turn (the driver's book)."""

    turn: dict[str, AgentTurn] = field(default_factory=dict)
    next: dict[str, AgentTurn | None] = field(default_factory=dict)
    start_s: dict[int, float] = field(default_factory=dict)

    @classmethod
    def of(cls, agents: AgentWorkload) -> Turns:
        book = cls()
        for program in agents.programs:
            book.start_s[program.program] = program.start_s
            for turn, after in itertools.zip_longest(program.turns, program.turns[1:]):
                book.turn[turn.spec.request_id] = turn
                book.next[turn.spec.request_id] = after
        return book


class LruRetention:
    """vLLM's own: a finished turn's blocks, output included, go to the LRU cache."""

    def __init__(self, engine: SimEngine, turns: Turns) -> None:
        self.engine, self.turns = engine, turns
        self.keys = BlockKeys(engine.config.block_tokens)
        self.held_share_max = 0.0
        """The largest share of the pool held at any step (the bound's witness)."""

    def start(self) -> None:
        """The engine's run has started (its pool is fresh)."""

    def arrived(self, spec: RequestSpec) -> None:
        """The driver hands a turn to the engine at ``spec.arrival_s``."""

    def tick(self) -> None:
        pass

    def stalled(self) -> bool:
        return False

    def finished(self, request: SimRequest) -> bool:
        after = self.turns.next.get(request.request_id)
        if after is not None:
            self.engine.pool.cache_full_blocks(request.request_id, self.keys(after.spec.prompt),
                                               request.num_computed_tokens)
        return False

    def counts(self) -> dict[str, Any]:
        return {}


class _Holding(LruRetention):
    """Blocks held under ``hold:<request>`` ids in the pool; the rule decides which."""

    def __init__(self, engine: SimEngine, turns: Turns) -> None:
        super().__init__(engine, turns)
        self.held: dict[str, int] = {}
        """Holder id to its blocks."""

    def _pin(self, request: SimRequest) -> None:
        holder = f"hold:{request.request_id}"
        self.engine.pool.hold(request.request_id, holder)
        self.held[holder] = len(self.engine.pool.blocks_of(holder))
        self._witness()

    def _unpin(self, request_id: Hashable) -> None:
        holder = f"hold:{request_id}"
        if self.held.pop(holder, None) is not None:
            self.engine.pool.free(holder)

    def _witness(self) -> None:
        """The share of the pool's blocks some hold references (each block once)."""
        pool = self.engine.pool
        held = set().union(*(pool.blocks_of(holder) for holder in self.held))
        self.held_share_max = max(self.held_share_max, len(held) / pool.num_blocks)


class TtlRetention(_Holding):
    """CacheTTL's pins, as we replay its rule (the module's docstring)."""

    def __init__(self, engine: SimEngine, turns: Turns, reload_s: Callable[[int], float],
                 default_ttl_s: float = 10.0) -> None:
        super().__init__(engine, turns)
        self.reload_s, self.default_ttl_s = reload_s, default_ttl_s
        self.gaps: list[float] = []
        """Tool times seen so far, sorted."""
        self.pins: dict[str, tuple[float, str]] = {}
        """Pinned turn id to (expiry, its next turn's id)."""
        self.queue_s = 0.0
        """Mean TTFT of finished turns: the queueing delay an evicted turn meets again."""
        self._finished = 0
        self.expiries = self.released_next = self.stall_releases = 0

    def arrived(self, spec: RequestSpec) -> None:
        turn = self.turns.turn[spec.request_id]
        if turn.tool_s > 0:
            bisect.insort(self.gaps, turn.tool_s)

    def finished(self, request: SimRequest) -> bool:
        super().finished(request)
        ttft = request.record.ttft_s or 0.0
        self._finished += 1
        self.queue_s += (ttft - self.queue_s) / self._finished
        after = self.turns.next.get(request.request_id)
        if after is None or self.turns.turn[request.request_id].finish_reason != TOOL_CALLS:
            return False
        blocks = len(self.engine.pool.blocks_of(request.request_id))
        ttl = self.ttl_s(request.num_computed_tokens, blocks)
        if ttl <= 0:
            return False
        self.pins[request.request_id] = (self.engine.now + ttl, after.spec.request_id)
        self._pin(request)
        return True

    def ttl_s(self, tokens: int, blocks: int) -> float:
        """argmax over t in {0} and the tool times seen of ``F(t) * (reload + queue) -
        blocks / pool * E[min(gap, t)]``; the default TTL before any tool time is seen."""
        gaps = self.gaps
        if not gaps:
            return self.default_ttl_s
        gain = self.reload_s(tokens) + self.queue_s
        share = blocks / self.engine.config.num_blocks
        best, best_t, below = 0.0, 0.0, 0.0
        for index, gap in enumerate(gaps):
            below += gap  # E[min(g, t)] at t = gap: the gaps below, then t for the rest
            value = (index + 1) / len(gaps) * gain \
                - share * (below + gap * (len(gaps) - index - 1)) / len(gaps)
            if value > best:
                best, best_t = value, gap
        return best_t

    def tick(self) -> None:
        now, pool = self.engine.now, self.engine.pool
        for pinned, (expiry, after) in list(self.pins.items()):
            if expiry <= now or after in pool:
                self.expiries += expiry <= now and after not in pool
                self.released_next += after in pool
                del self.pins[pinned]
                self._unpin(pinned)

    def stalled(self) -> bool:
        if not self.pins:
            return False
        oldest = min(self.pins, key=lambda pinned: self.pins[pinned][0])
        del self.pins[oldest]
        self._unpin(oldest)
        self.stall_releases += 1
        return True

    def counts(self) -> dict[str, Any]:
        return {"expiries": self.expiries, "released_at_next_turn": self.released_next,
                "released_when_stalled": self.stall_releases,
                "max_held_share": self.held_share_max}


class SessionRetention(_Holding):
    """Feather's rule: ``core.sessions.Sessions`` decides, this pins and unpins."""

    def __init__(self, engine: SimEngine, turns: Turns, reload_s: Callable[[int], float],
                 config: RetentionConfig | None = None, yield_to_growth: bool = False) -> None:
        """``yield_to_growth``: holds not yet lapsed are also released (least valuable
        first) where a running request's growth lacks blocks, instead of preempting it
        (off by default: in the agents benchmark it cost JCT, docs/sessions.md)."""
        super().__init__(engine, turns)
        self.yield_to_growth = yield_to_growth
        self.sessions = Sessions(config or RetentionConfig(), engine.config.num_blocks,
                                 reload_s)
        self.warm: set[str] = set()
        """Continuing turns that arrived with their prefix resident: their session's
        blocks held, or at least half their prompt's blocks still cached."""
        self.continuing: set[str] = set()
        """Turns that continue a session."""

    def start(self) -> None:
        self.engine.pool.reclaim = self._reclaim

    def arrived(self, spec: RequestSpec) -> None:
        namespace = Namespace((), spec.tenant)
        keys = self.keys(spec.prompt)
        held = self.sessions.arrived(spec.request_id, namespace, keys, spec.arrival_s)
        session = self.sessions.session_of(spec.request_id)
        if session is not None and session.ended_s is not None:
            self.continuing.add(spec.request_id)
            if held or 2 * len(self.engine.pool.match(keys)) >= len(keys):
                self.warm.add(spec.request_id)

    def finished(self, request: SimRequest) -> bool:
        super().finished(request)
        self.warm.discard(request.request_id)
        self.continuing.discard(request.request_id)
        after = self.turns.next.get(request.request_id)
        turn = self.turns.turn[request.request_id]
        keys = self.keys(after.spec.prompt if after is not None else turn.spec.prompt)
        computed = request.num_computed_tokens
        keys = keys[:computed // self.engine.config.block_tokens]
        held = self.engine.pool.blocks_of(request.request_id)  # as vLLM's adapter names them
        hold, displaced = self.sessions.turn_ended(
            request.request_id, keys, len(held), computed, self.engine.now,
            turn.finish_reason, held=held)
        self._release(displaced)
        if hold is None:
            return False
        self._pin(request)
        return True

    def tick(self) -> None:
        sessions, pool = self.sessions, self.engine.pool
        for request_id in [r for r in self.warm if r in pool]:  # admitted: its hold goes
            self.warm.discard(request_id)
            hold = sessions.admitted(request_id)
            self._release([hold] if hold else [])

    def stalled(self) -> bool:
        gone = self.sessions.reclaim(1, self.engine.now)
        self._release(gone)
        return bool(gone)

    def _reclaim(self, blocks: int) -> None:
        """A running request's growth lacks ``blocks``: lapsed holds yield to it (all
        holds with ``yield_to_growth``)."""
        self._release(self.sessions.reclaim(blocks, self.engine.now,
                                            lapsed_only=not self.yield_to_growth))

    def _release(self, holds: list[Hold]) -> None:
        for hold in holds:
            self._unpin(hold.holder)

    def counts(self) -> dict[str, Any]:
        counts = vars(self.sessions.counts).copy()
        counts["max_held_share"] = self.held_share_max
        counts["bound_share"] = self.sessions.config.max_held_share
        return counts


class SessionView(SimRequests):
    """Feather's view of simulated requests with warm continuing turns in class 0."""

    def __init__(self, retention: SessionRetention, block_tokens: int,
                 chunk_tokens: int) -> None:
        super().__init__(block_tokens, chunk_tokens)
        self.retention = retention

    def priority(self, request: SimRequest) -> int:
        return 0 if request.request_id in self.retention.warm else 1


class ProgramFcfsPolicy(PriorityPolicy):
    """CacheTTL's program-level FCFS: waiting turns by their program's start, then their
    own arrival; the victim of preemption the latest such."""

    name = "ttl"

    def __init__(self, start_s: dict[int, float]) -> None:
        super().__init__()
        self.start_s = start_s

    def key(self, request: SimRequest) -> tuple[float, float, int]:
        return self.start_s.get(request.spec.group, math.inf), request.spec.arrival_s, \
            request.index

    def enter_waiting(self, request: SimRequest) -> None:
        heapq.heappush(self._heap, (self.key(request), request))

    def preemption_victim(self, running: list[SimRequest]) -> SimRequest:  # type: ignore[override]
        return max(running, key=self.key)


def feather_with_sessions(engine: SimEngine, retention: SessionRetention,
                          options: dict[str, Any], name: str
                          ) -> RuntimeContract[SimRequest]:
    """Feather's runtime over ``SessionView`` (the same construction as ``make_policy``)."""
    config = FeatherConfig.from_sources(options, environ={})
    view = SessionView(retention, engine.config.block_tokens, config.chunk_tokens)
    return FeatherRuntime(config, view, clock=engine.clock, name=name,
                          seats=engine.config.max_num_seqs,
                          kv_tokens=engine.config.num_blocks * engine.config.block_tokens,
                          chunk_tokens=view.chunk_tokens)


class TurnQueue:
    """Turns to come, by arrival: each program's first at its start, each next turn its
    tool time after its predecessor ends (``released``; a failed turn ends its program).
    O(log turns) per turn."""

    def __init__(self, agents: AgentWorkload, turns: Turns) -> None:
        self.turns = turns
        self._order = itertools.count()
        self._heap: list[tuple[float, int, RequestSpec]] = []
        for program in agents.programs:
            first = program.turns[0].spec
            heapq.heappush(self._heap, (first.arrival_s, next(self._order), first))

    def __bool__(self) -> bool:
        return bool(self._heap)

    def next_s(self) -> float:
        """When the next turn arrives (inf: none is due, though a running turn may
        release one)."""
        return self._heap[0][0] if self._heap else math.inf

    def pop(self) -> RequestSpec:
        """The next turn, its ``arrival_s`` the real one."""
        return heapq.heappop(self._heap)[2]

    def released(self, record: RequestRecord) -> None:
        """A turn ended (an engine's ``on_done``): its successor is due after its tool time."""
        after = self.turns.next.get(record.request_id)
        if record.success and after is not None:
            arrival = (record.finished_s or 0.0) + after.tool_s
            heapq.heappush(self._heap, (arrival, next(self._order),
                                        replace(after.spec, arrival_s=arrival)))

    def serve(self, engines: Sequence[SimEngine], arrive: Callable[[RequestSpec], None]
              ) -> None:
        """Step the earliest of ``engines`` while it acts before the next turn is due,
        else hand that turn to ``arrive`` (which adds it to an engine), until no engine
        has work and no turn is due.  O(engines) per step."""
        while True:
            engine = min(engines, key=SimEngine.next_event_s)
            event = engine.next_event_s()
            if event == math.inf and not self:
                return
            if event < self.next_s():
                engine.step()
            else:
                arrive(self.pop())


def serving(scheduler: str, engine: SimEngine, turns: Turns,
            config: RetentionConfig | None = None) -> tuple[Any, LruRetention]:
    """The policy and retention ``engine`` serves agent programs with under a scheduler
    name: ``ttl`` (CacheTTL's rule), ``<feather scheduler>+sessions`` (Feather with
    sessions under ``config``), else ``make_policy``'s scheduler over ``LruRetention``."""
    reload_s = reload_seconds(engine.cost_model, engine.config.max_num_batched_tokens)
    if scheduler == "ttl":
        return ProgramFcfsPolicy(turns.start_s), TtlRetention(engine, turns, reload_s)
    if scheduler.endswith("+sessions"):
        retention = SessionRetention(engine, turns, reload_s, config or RetentionConfig())
        options = {"gate": scheduler.removesuffix("+sessions").removeprefix("feather-")}
        return feather_with_sessions(engine, retention, options, scheduler), retention
    return make_policy(scheduler, {}, engine), LruRetention(engine, turns)


def run_programs(engine: SimEngine, policy: Any, agents: AgentWorkload,
                 retention: LruRetention) -> SimResult:
    """Serve ``agents`` closed loop (``TurnQueue``) on one engine.  Every turn ends
    exactly once (or this raises)."""
    queue = TurnQueue(agents, retention.turns)
    engine.retention = retention
    engine.start(policy, on_done=queue.released)
    retention.start()

    def arrive(spec: RequestSpec) -> None:
        retention.arrived(spec)
        engine.add(spec)

    queue.serve([engine], arrive)
    return engine.result()
