"""A discrete-event model of vLLM V1's continuous batching, driving real scheduler objects.

Each step follows vLLM's ``Scheduler.schedule()``: running requests first (a decode token
or their next prefill chunk), preempting the policy's victim by recompute when KV blocks
run out; then, if nothing was preempted, admission while the token budget,
``max_num_seqs`` and the KV blocks allow.  Under Feather, urgent preemption runs before
the pass by the protocol of Feather's vLLM adapter (``core.urgent.make_room``, asking a
``PoolRoom``).  The batch is laid out like vLLM's persistent batch (lowest free slot,
holes condensed), each prefix group gathered at its first slot under Feather's layout.
Every policy drives the runtime contract; a cost model prices each step, and with
``charge_scheduler_time`` the policy's wall-clock time (plus its ``charged_s``) adds to
it (``overlap_scheduler``: the longer of the two, as vLLM's async scheduling).  The run
yields the same records as a real benchmark run.  In full: docs/simulator.md.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from feather_sched.core.cht import DEFAULT_CHUNK_TOKENS
from feather_sched.core.prefix import SharedPrefixes, describe_batch, group_of, keys_per_chunk
from feather_sched.core.urgent import Answer, Room, make_room
from feather_sched.costmodel.cost import StepCost
from feather_sched.gates.base import BatchLayout, Decision
from feather_sched.results.records import RequestRecord, RunResult, StepRecord
from feather_sched.routing.cache_index import KVEvent
from feather_sched.sim.block_pool import BlockKeys, BlockPool, blocks_for
from feather_sched.telemetry.steplog import BatchEntry
from feather_sched.workloads.spec import RequestSpec, Workload


class SimState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"


@dataclass(slots=True, eq=False)
class SimRequest:
    """A request inside the simulator: its spec, prompt block keys and progress.

    Preemption is by recompute (vLLM V1): ``num_computed_tokens`` drops to 0 while the
    output produced so far stays, so the request recomputes prompt + outputs and then
    samples its next token.
    """

    spec: RequestSpec
    keys: list[int]
    """Chained keys of the prompt's full KV blocks (``token_chunk_keys``)."""
    record: RequestRecord
    group: Hashable
    """Its prefix group (``prefix.group_of`` its block keys)."""
    index: int
    """Position in the workload (arrival order)."""
    prompt_len: int
    state: SimState = SimState.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    preemptions: int = 0
    scheduled_tokens: int = 0
    """Tokens scheduled in the current step."""
    step: int = -1
    """The last step this request was scheduled in."""
    slot: int = -1
    """Its slot in the persistent batch (-1: none)."""

    @classmethod
    def create(cls, spec: RequestSpec, index: int, config: EngineConfig) -> SimRequest:
        record = RequestRecord(spec.request_id, spec.prompt.size, spec.group, spec.arrival_s,
                               priority=spec.priority, tenant=spec.tenant,
                               computed_tokens=0)
        keys = BlockKeys(config.block_tokens)(spec.prompt)
        per_chunk = keys_per_chunk(config.block_tokens, config.group_tokens)
        group = group_of(keys, spec.request_id, per_chunk)
        return cls(spec, keys, record, group, index, spec.prompt.size)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus output so far: what must be computed before the next token."""
        return self.prompt_len + self.num_output_tokens


class Policy(Protocol):
    """A scheduler as the simulated engine drives it: the contract of ``runtime``.

    Optional, and read once per run (``SimEngine.start``): ``UrgentPreemption``'s calls,
    vLLM's urgent-preemption protocol (Feather has them; without them, as for the
    baselines, nothing is preempted for urgency); ``preempted(request, urgent=)``, told
    of each preemption (Feather's ``max_preemptions``); and, where ``counts_service`` is true,
    ``served(request_id, computed_tokens, generated_tokens)`` after each step for each
    request of its batch (fair share)."""

    @property
    def name(self) -> str: ...

    @property
    def layout(self) -> BatchLayout:
        """How the batch is laid out: ``FEATHER``, each group gathered at its first slot
        (the policy orders the running list, as Feather's worker plugin makes vLLM's V1
        runner do), or ``ENGINE``, vLLM's persistent batch as it stands."""

    def enter_waiting(self, request: SimRequest) -> None: ...

    def discard(self, request_id: Hashable) -> bool: ...

    def begin_pass(self, running: Sequence[SimRequest]) -> list[SimRequest]: ...

    def decide(self) -> Answer | None: ...

    def admit(self, request: SimRequest) -> None: ...

    def end_pass(self, step: Hashable, running: Sequence[SimRequest]) -> None: ...

    def end_step(self, step: Hashable, batch_size: int, seconds: float,
                 batch: Sequence[BatchEntry] | None = None) -> None: ...

    def preemption_victim(self, running: Sequence[SimRequest]) -> SimRequest: ...

    def __len__(self) -> int: ...


@runtime_checkable
class UrgentPreemption(Policy, Protocol):
    """The optional part of ``Policy`` with which the engine preempts for a waiting request
    of a more urgent class (``SimEngine._make_room``), as ``FeatherRuntime`` declares it
    (``core.contract``)."""

    def candidate(self) -> SimRequest | None:
        """The request ``decide()`` would judge next (the most urgent class waiting)."""

    def urgent_victims(self, running: Sequence[SimRequest], request: SimRequest,
                       room: Room[SimRequest]) -> list[SimRequest]:
        """The fewest running requests, in the policy's order, whose preemption makes
        ``room`` for waiting ``request`` ([] where none may go or none makes room)."""

    def promise(self, request: SimRequest) -> None:
        """Victims were preempted for ``request``'s ADD: it holds for this pass."""


@runtime_checkable
class ServiceCounting(Policy, Protocol):
    """The optional part of ``Policy`` told the service each step did (fair share)."""

    counts_service: bool

    def served(self, request_id: Hashable, computed_tokens: int,
               generated_tokens: int) -> None: ...


class PoolRoom(Room[SimRequest]):
    """The simulator's ``core.Room``: whether preempting a set of running requests lets
    ``request`` into this step's admission, by the engine's own arithmetic (``_schedule``)
    from a snapshot taken before the pass: a seat (``max_num_seqs``), token budget left
    after the running requests' tokens, and the blocks the running requests take first
    (``BlockPool.grow``) plus the request's after its prefix-cache hits
    (``BlockPool.allocate``), against the pool's free and evictable blocks and those the
    victims free (a block frees only with its last holder).  Cost: O(running) to build,
    O(victims' blocks) per set asked."""

    def __init__(self, pool: BlockPool, running: Sequence[SimRequest], request: SimRequest,
                 config: EngineConfig) -> None:
        self.pool, self.request, self.config = pool, request, config
        self.seats = config.max_num_seqs - len(running)
        self.free = pool.num_free
        self.needs = {r.request_id: self._next_step(r) for r in running}
        """Per running request, the (blocks, tokens) the running loop gives it first."""
        self.running_blocks = sum(blocks for blocks, _ in self.needs.values())
        self.running_tokens = sum(tokens for _, tokens in self.needs.values())
        block_tokens = config.block_tokens
        hits = pool.match(request.keys)[:(request.num_tokens - 1) // block_tokens]
        self.hits, self.cached = set(hits), len(hits) * block_tokens
        self.revived = sum(1 for block in hits if not pool.ref_count(block))
        """Hits now evictable: counted free, but the request takes them."""

    def made_by(self, victims: Sequence[SimRequest]) -> bool:
        """Whether ``request`` gets a seat, budget and its blocks once ``victims`` are
        preempted.  O(victims' blocks)."""
        if self.seats + len(victims) < 1:
            return False
        blocks = tokens = 0
        for victim in victims:
            victim_blocks, victim_tokens = self.needs[victim.request_id]
            blocks += victim_blocks
            tokens += victim_tokens
        budget = self.config.max_num_batched_tokens - self.running_tokens + tokens
        if budget <= 0:
            return False
        request, freed = self.request, self._freed(victims)
        new = min(request.num_tokens - self.cached, budget)
        own = blocks_for(self.cached + new, self.config.block_tokens) - len(self.hits)
        needed = own + self.revived + len(freed & self.hits) + self.running_blocks - blocks
        return needed <= self.free + len(freed)

    def _freed(self, victims: Sequence[SimRequest]) -> set[int]:
        """The blocks every holder of which is a victim: they return to the pool."""
        pool, held = self.pool, Counter[int]()
        for victim in victims:
            held.update(pool.blocks_of(victim.request_id))
        return {block for block, count in held.items() if pool.ref_count(block) <= count}

    def _next_step(self, running: SimRequest) -> tuple[int, int]:
        """The blocks and tokens the running loop gives a running request this step."""
        tokens = running.num_tokens - running.num_computed_tokens
        held = len(self.pool.blocks_of(running.request_id))
        blocks = blocks_for(running.num_computed_tokens + tokens, self.config.block_tokens)
        return max(blocks - held, 0), tokens


class SimUrgency:
    """The simulator as ``core.urgent.make_room``'s ``Engine``: its request type, its
    room (``PoolRoom``, a snapshot of the engine now) and its recompute preemption."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    @staticmethod
    def priority(request: SimRequest) -> int:
        return request.spec.priority

    @staticmethod
    def request_id(request: SimRequest) -> Hashable:
        return request.request_id

    def room(self, request: SimRequest) -> PoolRoom:
        engine = self.engine
        return PoolRoom(engine.pool, engine.running, request, engine.config)

    def preempt(self, victim: SimRequest) -> None:
        """Out of the running list, then ``SimEngine._preempt`` for urgency."""
        self.engine.running.remove(victim)
        self.engine._preempt(victim, urgent=True)


def condense(slots: list[SimRequest | None], holes: list[int]) -> None:
    """vLLM's input batch ``condense``: move the last occupied slot into the lowest hole
    (``holes``, a heap of the empty slots' indices) until no hole is left."""
    while holes:
        while slots and slots[-1] is None:
            slots.pop()
        hole = heapq.heappop(holes)
        if hole < len(slots):
            request = slots.pop()
            assert request is not None
            slots[hole] = request
            request.slot = hole
    while slots and slots[-1] is None:
        slots.pop()


def step_seconds(config: EngineConfig, model_s: float, uncharged_s: float) -> float:
    """A step's length: its model time and the scheduler time not yet charged
    (``uncharged_s``), the longer of the two where they overlap, else their sum."""
    if not config.charge_scheduler_time:
        return model_s
    if config.overlap_scheduler:
        return max(model_s, uncharged_s)
    return model_s + uncharged_s


def _charged_s(policy: Policy) -> float:
    """A policy's optional ``charged_s``: modelled scheduler seconds of the current step
    (e.g. SGLang's prefix matching, which the simulator does far cheaper), reset by the
    policy in ``new_step`` and read once per step."""
    return getattr(policy, "charged_s", 0.0)


class Retention(Protocol):
    """Keeps finished requests' blocks for what comes next (``sim.programs``)."""

    def tick(self) -> None:
        """Before each step: release what is due."""

    def finished(self, request: SimRequest) -> bool:
        """A request finished: True where its blocks were kept (else the engine frees
        them)."""

    def stalled(self) -> bool:
        """Nothing runs and nothing was admitted: release held blocks; True if any."""


class StepCostModel(Protocol):
    def step(self, batch: Sequence[BatchEntry]) -> StepCost: ...


@dataclass(frozen=True)
class EngineConfig:
    """vLLM's scheduler limits and the simulator's own switches."""

    block_tokens: int = 16
    num_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    charge_scheduler_time: bool = True
    overlap_scheduler: bool = False
    """The scheduler's time overlaps the step's model time (a step takes the longer of the
    two: vLLM's async scheduling, SGLang's overlap scheduler); False: they add up."""
    max_steps: int = 10**7
    group_tokens: int = DEFAULT_CHUNK_TOKENS
    """Tokens of the first chunk, whose key names a request's prefix group."""

    def __post_init__(self) -> None:
        for name in ("block_tokens", "num_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "max_steps", "group_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class CostTotals:
    """The cost model's prices summed over a run."""

    model_seconds: float = 0.0
    hbm_bytes: float = 0.0
    """All HBM traffic, weights included."""
    l2_bytes: float = 0.0
    """KV bytes the model says L2 served instead of HBM."""
    weight_bytes: float = 0.0
    output_tokens: int = 0

    def add(self, cost: StepCost, output_tokens: int) -> None:
        self.model_seconds += cost.seconds
        self.hbm_bytes += cost.hbm_bytes
        self.l2_bytes += cost.l2_bytes
        self.weight_bytes += cost.weight_bytes
        self.output_tokens += output_tokens

    @property
    def hbm_bytes_per_output_token(self) -> float | None:
        return self.hbm_bytes / self.output_tokens if self.output_tokens else None

    @property
    def l2_hit_rate(self) -> float | None:
        """Share of KV bytes read that L2 served (as ``StepCost.l2_hit_rate``, run-wide)."""
        kv_bytes = self.hbm_bytes - self.weight_bytes + self.l2_bytes
        return self.l2_bytes / kv_bytes if kv_bytes else None


@dataclass
class SimResult:
    """One simulated run: the benchmark records plus what only a model can report."""

    name: str
    records: list[RequestRecord]
    """In workload order."""
    steps: list[StepRecord]
    duration_s: float
    costs: CostTotals
    prefix_cache_hit_rate: float | None
    scheduler_cpu_s: float
    """Wall-clock seconds spent in policy calls (charged to the clock if configured)."""
    modelled_scheduler_s: float
    """Seconds the policies declared in ``charged_s`` (charged likewise)."""
    num_preemptions: int

    def run_result(self) -> RunResult:
        """The run as the benchmark report code takes it."""
        return RunResult(name=self.name, records=self.records, duration_s=self.duration_s,
                         steps=self.steps, prefix_cache_hit_rate=self.prefix_cache_hit_rate)


class SimEngine:
    """Runs a workload through a policy and a cost model on a simulated clock.

    ``now`` (the clock) and ``pool`` are what a policy may read: build the engine first,
    then its policy (``policies.make_policy(name, options, engine)``).
    """

    def __init__(self, cost_model: StepCostModel, config: EngineConfig) -> None:
        self.cost_model = cost_model
        self.config = config
        self.kv_events: Callable[[list[KVEvent]], None] | None = None
        """Where each step's KV cache events go, as vLLM publishes a batch per
        ``schedule()`` (set before ``start``; None: the pool emits none)."""
        self.retention: Retention | None = None
        """What happens to a finished request's blocks, and when held ones go back
        (``sim.programs``; set before ``start``; None: freed to the LRU cache, as vLLM)."""
        self._reset([], None)

    def clock(self) -> float:
        """The simulated time, for policies that need a clock."""
        return self.now

    # ---- driver -----------------------------------------------------------------------

    def run(
        self, workload: Workload, policy: Policy,
        on_done: Callable[[RequestRecord], None] | None = None,
    ) -> SimResult:
        """Simulate the whole workload; every request ends exactly once (or this raises).

        Each run starts a fresh pool and clock; the policy is used as given.
        """
        self.start(policy, workload.requests, on_done)
        while not self.done:
            self.step()
        return self.result()

    def start(
        self, policy: Policy, specs: Sequence[RequestSpec] = (),
        on_done: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        """Begin a run driven step by step (``run`` is ``start``, ``step`` until ``done``,
        ``result``): a fresh pool and clock, ``specs`` (in arrival order) to come, and
        ``on_done`` called once for each request as it ends."""
        self.policy = policy
        self._urgent = policy if isinstance(policy, UrgentPreemption) else None
        """The policy, where it preempts for urgency (``_make_room``)."""
        self._told: Callable[..., None] | None = getattr(policy, "preempted", None)
        """The policy's ``preempted(request, urgent=)``, where it counts preemptions
        (Feather: its ``max_preemptions`` bound), told before the victim waits again."""
        self._reset(specs, on_done)

    def add(self, spec: RequestSpec) -> None:
        """A request to come at its ``arrival_s``, no earlier than those already added."""
        pending = self._pending
        if pending and spec.arrival_s < pending[-1].arrival_s:
            raise ValueError(f"request {spec.request_id!r} arrives before one already added")
        pending.append(spec)
        self._total += 1

    @property
    def done(self) -> bool:
        """Every request added so far has ended."""
        return self._ended == self._total

    def next_event_s(self) -> float:
        """When this engine next acts: now while it holds requests, else at its next
        arrival (inf when it has none).  O(1)."""
        if self.running or len(self.policy):
            return self.now
        if self._pending:
            return max(self.now, self._pending[0].arrival_s)
        return math.inf

    def step(self) -> None:
        """One ``schedule()`` and its step; with nothing to run, jump to the next arrival."""
        if self._step >= self.config.max_steps:
            raise RuntimeError(
                f"simulation did not finish within {self.config.max_steps} steps")
        if self.retention is not None:
            self.retention.tick()
        self._arrive()
        batch, preempted = self._schedule()
        if self.kv_events is not None and (events := self.pool.take_events()):
            self.kv_events(events)
        if batch:
            self._execute(batch)
        elif not (preempted or self.running or self._unstalled()):
            self._wait_for_arrival()

    def _reset(
        self, specs: Sequence[RequestSpec], on_done: Callable[[RequestRecord], None] | None
    ) -> None:
        config = self.config
        self.pool = BlockPool(config.num_blocks, config.block_tokens,
                              emit_events=self.kv_events is not None)
        self.now = 0.0
        """The simulated clock, in seconds from the run's start."""
        self.running: list[SimRequest] = []
        """Running requests in the policy's order (preemption takes its victim)."""
        self.requests: list[SimRequest] = []
        self._by_id: dict[Hashable, SimRequest] = {}
        self.steps: list[StepRecord] = []
        self.costs = CostTotals()
        self.num_preemptions = 0
        self.scheduler_cpu_s = 0.0
        self.modelled_scheduler_s = 0.0
        self._pending = deque(specs)
        self._total = len(specs)
        self._on_done = on_done
        self._ended = 0
        self._step = 0
        self._uncharged_s = 0.0
        self._slots: list[SimRequest | None] = []
        self._holes: list[int] = []
        self._shared = SharedPrefixes()
        """Key counts over the persistent batch's occupants (for shared tokens)."""

    def _timed(self, call: Callable[..., Any], *args: Any) -> Any:
        """Call into the policy, adding its wall-clock time to the scheduler's account."""
        start = time.perf_counter()
        result = call(*args)
        elapsed = time.perf_counter() - start
        self.scheduler_cpu_s += elapsed
        self._uncharged_s += elapsed
        return result

    def _arrive(self) -> None:
        """Hand every request that has arrived by now to the policy (or reject it)."""
        pending = self._pending
        while pending and pending[0].arrival_s <= self.now:
            request = SimRequest.create(pending.popleft(), len(self.requests), self.config)
            self.requests.append(request)
            self._by_id[request.request_id] = request
            if not self._reject_if_unfit(request):
                self._timed(self.policy.enter_waiting, request)

    def _reject_if_unfit(self, request: SimRequest) -> bool:
        """Fail a request whose full sequence could never fit the pool, instead of hanging."""
        kv_tokens = request.prompt_len + max(request.spec.output_len - 1, 0)
        needed = blocks_for(kv_tokens, self.config.block_tokens)
        if needed <= self.config.num_blocks:
            return False
        request.record.error = (f"needs {needed} KV blocks for {kv_tokens} tokens; "
                                f"the pool has {self.config.num_blocks}")
        self._end(request, SimState.REJECTED, request.spec.arrival_s)
        return True

    def _wait_for_arrival(self) -> None:
        """Nothing runs and nothing was admitted: jump to the next arrival, or fail."""
        if not self._pending:
            raise RuntimeError(
                f"no progress at t={self.now:.6f}s: {len(self.policy)} waiting requests, "
                f"none running, and policy {self.policy.name!r} admits none"
            )
        if self.config.charge_scheduler_time:
            self.now += self._uncharged_s  # idle time absorbs scheduling that fits in it
        self._uncharged_s = 0.0
        self.now = max(self.now, self._pending[0].arrival_s)

    # ---- scheduling -------------------------------------------------------------------

    def _schedule(self) -> tuple[list[SimRequest], bool]:
        """One ``schedule()``: running requests first, then admissions; returns the batch."""
        self._step += 1
        self.running = self._timed(self.policy.begin_pass, self.running)
        self._make_room()
        budget = self.config.max_num_batched_tokens
        scheduled: list[SimRequest] = []
        preempted = self._schedule_running(scheduled, budget)
        if not preempted:
            self._admit(scheduled, budget - sum(r.scheduled_tokens for r in scheduled))
        self._timed(self.policy.end_pass, self._step, self.running)
        modelled = _charged_s(self.policy)
        self.modelled_scheduler_s += modelled
        self._uncharged_s += modelled
        return self._layout(scheduled), preempted

    def _schedule_running(self, scheduled: list[SimRequest], budget: int) -> bool:
        """Give each running request its tokens, preempting the policy's victim for blocks
        (one already scheduled this step gives its tokens back, as in vLLM)."""
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.pool.grow(request.request_id, request.num_computed_tokens + tokens):
                victim = self._timed(self.policy.preemption_victim, running)
                index = running.index(victim)
                del running[index]
                if index < i:
                    i -= 1
                    scheduled.remove(victim)
                    budget += victim.scheduled_tokens
                    victim.scheduled_tokens, victim.step = 0, -1  # off this step's batch
                self._preempt(victim)
                preempted = True
                if victim is request:
                    return True
            self._mark(request, tokens, scheduled)
            budget -= tokens
            i += 1
        return preempted

    def _preempt(self, request: SimRequest, urgent: bool = False) -> None:
        """vLLM's recompute preemption: drop the KV, keep the output, back to waiting (the
        policy told first where it counts preemptions; ``urgent``: for a more urgent
        request)."""
        told = self._told
        if told is not None:
            self._timed(lambda: told(request, urgent=urgent))
        self.pool.free(request.request_id)
        request.state = SimState.WAITING
        request.num_computed_tokens = 0
        request.preemptions += 1
        self.num_preemptions += 1
        self._timed(self.policy.enter_waiting, request)

    def _make_room(self) -> None:
        """Before the pass, urgent preemption as Feather's vLLM adapter runs it
        (``core.urgent.make_room``, with ``SimUrgency`` as its engine), each policy call
        timed; only for a policy with ``UrgentPreemption``'s calls."""
        if self._urgent is not None:
            make_room(self._urgent, self.running, SimUrgency(self), self._timed)

    def _admit(self, scheduled: list[SimRequest], budget: int) -> None:
        """Admit waiting requests while budget, seats and KV blocks last."""
        pool, block_tokens = self.pool, self.config.block_tokens
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            answer = self._timed(self.policy.decide)
            if answer is None or answer.decision is Decision.STOP:
                return
            request = self._by_id[answer.request_id]
            num_tokens = request.num_tokens
            # As vLLM: cached blocks are skipped, but the last token is always computed.
            hits = min(len(pool.match(request.keys)), (num_tokens - 1) // block_tokens)
            cached = hits * block_tokens
            tokens = min(num_tokens - cached, budget)
            if not pool.allocate(request.request_id, request.keys[:hits], cached + tokens,
                                 query_tokens=num_tokens):
                return
            self._timed(self.policy.admit, request)
            if request.record.cached_tokens is None:
                request.record.cached_tokens = cached
            request.state = SimState.RUNNING
            request.num_computed_tokens = cached
            self.running.append(request)
            self._mark(request, tokens, scheduled)
            budget -= tokens

    def _mark(self, request: SimRequest, tokens: int, scheduled: list[SimRequest]) -> None:
        """Schedule ``tokens`` of the request in this step.

        As vLLM's ``allocate_slots``, the full prompt blocks this step will compute are
        cached at once, so a request admitted later in the same step already hits them:
        the kernel writes each layer's KV before any request of the step attends to it.
        """
        request.scheduled_tokens = tokens
        request.step = self._step
        scheduled.append(request)
        target = request.num_computed_tokens + tokens
        if request.num_computed_tokens < len(request.keys) * self.config.block_tokens:
            self.pool.cache_full_blocks(request.request_id, request.keys, target)

    # ---- persistent batch -------------------------------------------------------------

    def _layout(self, scheduled: list[SimRequest]) -> list[SimRequest]:
        """Place the step's requests in the persistent batch; returns them in slot order.

        As vLLM's input batch: requests not scheduled now leave their slots, newcomers
        take the lowest holes (else the end), then ``condense`` fills remaining holes
        with the last occupied slots.  Under a policy that orders the running list, each
        prefix group then gathers at its first slot, in the scheduler's order, and other
        requests stay (Feather's V1 worker plugin,
        ``integrations.vllm.batch_order.order_by_schedule``).
        """
        slots, holes, shared = self._slots, self._holes, self._shared
        for index, request in enumerate(slots):
            if request is not None and request.step != self._step:
                request.slot = -1
                slots[index] = None
                heapq.heappush(holes, index)
                shared.remove(request.keys)
        for request in scheduled:
            if request.slot < 0:
                shared.add(request.keys)
                request.slot = heapq.heappop(holes) if holes else len(slots)
                if request.slot == len(slots):
                    slots.append(request)
                else:
                    slots[request.slot] = request
        condense(slots, holes)
        placed = [r for r in slots if r is not None]  # condensed: every slot is occupied
        if self.policy.layout is BatchLayout.FEATHER:
            place = {id(request): index for index, request in enumerate(scheduled)}
            anchor: dict[Hashable, int] = {}
            for index, request in enumerate(placed):
                anchor.setdefault(request.group, index)
            placed.sort(key=lambda request: (anchor[request.group], place[id(request)]))
            for index, request in enumerate(placed):
                request.slot = index
            slots[:] = placed
        return placed

    # ---- execution --------------------------------------------------------------------

    def _execute(self, batch: list[SimRequest]) -> None:
        """Price the step, advance the clock, then credit its tokens."""
        config = self.config
        entries = describe_batch(
            ((r.request_id, r.keys, r.num_computed_tokens + r.scheduled_tokens,
              r.scheduled_tokens) for r in batch), config.block_tokens,
            keys_per_chunk(config.block_tokens, config.group_tokens), shared=self._shared)
        cost = self.cost_model.step(entries)
        seconds = step_seconds(self.config, cost.seconds, self._uncharged_s)
        self._uncharged_s = 0.0
        self.now += seconds
        self.steps.append(StepRecord(batch_size=len(batch), groups=len({r.group for r in batch})))
        emitted = self._credit(batch)
        self.costs.add(cost, emitted)
        self._timed(self.policy.end_step, self._step, len(batch), seconds, entries)

    def _credit(self, batch: list[SimRequest]) -> int:
        """Apply the step's tokens at the step's end; returns output tokens emitted.  The
        service a step did is counted: on the records, and for a policy that counts it
        (``served``)."""
        emitted = 0
        finished = False
        policy = self.policy
        served = policy.served if isinstance(policy, ServiceCounting) and \
            policy.counts_service else None
        for request in batch:
            decoding = request.num_output_tokens > 0 and request.scheduled_tokens == 1 and \
                request.num_computed_tokens + 1 == request.num_tokens
            computed = 0 if decoding else request.scheduled_tokens  # prefill, recompute
            request.record.computed_tokens = (request.record.computed_tokens or 0) + computed
            request.num_computed_tokens += request.scheduled_tokens
            reached = request.num_computed_tokens >= request.num_tokens  # else mid-prefill
            generated = int(reached and request.num_output_tokens < request.spec.output_len)
            if generated:
                request.num_output_tokens += 1
                request.record.token_times_s.append(self.now)
                emitted += 1
            if served is not None:
                self._timed(served, request.request_id, computed, generated)
            if reached and request.num_output_tokens >= request.spec.output_len:
                self._finish(request)
                finished = True
        if finished:
            self.running = [r for r in self.running if r.state is SimState.RUNNING]
        return emitted

    def _unstalled(self) -> bool:
        """Nothing runs: held blocks go back where some are held and a request waits
        (True: the next step may admit it)."""
        return self.retention is not None and len(self.policy) > 0 and self.retention.stalled()

    def _finish(self, request: SimRequest) -> None:
        if self.retention is None or not self.retention.finished(request):
            self.pool.free(request.request_id)
        request.record.success = True
        self._end(request, SimState.FINISHED, self.now)
        self._timed(self.policy.discard, request.request_id)

    def _end(self, request: SimRequest, state: SimState, when: float) -> None:
        """The one place a request ends; ending twice is a simulator bug."""
        if request.state in (SimState.FINISHED, SimState.REJECTED):
            raise RuntimeError(f"request {request.request_id!r} ended twice")
        request.state = state
        request.record.finished_s = when
        request.record.preemptions = request.preemptions
        self._ended += 1
        if self._on_done is not None:
            self._on_done(request.record)

    # ---- result -----------------------------------------------------------------------

    def result(self) -> SimResult:
        """The run's records and totals; raises while a request has not ended."""
        unended = [r.request_id for r in self.requests
                   if r.state not in (SimState.FINISHED, SimState.REJECTED)]
        if unended or self._pending or self.running:
            raise RuntimeError(f"run ended with unfinished requests: {unended[:5]}")
        records = [r.record for r in self.requests]
        return SimResult(
            name=self.policy.name,
            records=records,
            steps=self.steps,
            duration_s=max((r.finished_s or 0.0 for r in records), default=0.0),
            costs=self.costs,
            prefix_cache_hit_rate=self.pool.hit_rate,
            scheduler_cpu_s=self.scheduler_cpu_s,
            modelled_scheduler_s=self.modelled_scheduler_s,
            num_preemptions=self.num_preemptions,
        )

