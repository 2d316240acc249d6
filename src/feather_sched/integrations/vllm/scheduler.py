"""Feather inside vLLM's V1 engine (vLLM 0.32-0.34; their differences: ``compat``).

Load with ``--scheduler-cls feather_sched.integrations.vllm.FeatherScheduler`` (server) or
``LLM(..., scheduler_cls=FeatherScheduler)``; options: ``--additional-config
'{"feather": {...}}'`` or ``FEATHER_*``.  The scheduler subclass is thin (``_Hooks``): it
forwards vLLM's calls to one component, ``VllmFeather``, which translates vLLM's types
for the runtime (held as ``RuntimeContract``) through ``VllmRequests``,
``FeatherWaitingQueue``, ``KvHoldingQueue`` and ``UrgentRoom``; ``VllmMeter`` measures,
and is the FCFS baseline's component (``InstrumentedScheduler``).

Each ``schedule()`` is one pass, rewarded with the step of its own output; a request
leaves Feather exactly once; a fault in Feather's code never reaches ``schedule()``
(vLLM's own queue serves until the next pass).  The invariants in full: docs/vllm.md,
"Mechanism".
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol

from vllm.platforms import current_platform
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.request_queue import (
    PriorityRequestQueue,
    RequestQueue,
    SchedulingPolicy,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from feather_sched.core import (
    DEFAULT_TENANT,
    TENANT_ARG,
    Admission,
    Decision,
    EngineShape,
    FaultGuard,
    FeatherConfig,
    FeatherRuntime,
    Isolation,
    Namespace,
    RuntimeContract,
    block_chunk_keys,
    describe_batch,
    engine_keys,
    keys_per_chunk,
    parse_tenant,
    token_keys,
)
from feather_sched.integrations.vllm import compat
from feather_sched.integrations.vllm.choice import feather_mapping
from feather_sched.integrations.vllm.sessions import VllmSessions, retrying_allocation
from feather_sched.integrations.vllm.urgent import UrgentRoom
from feather_sched.telemetry.stats import StepMeter
from feather_sched.telemetry.steplog import BatchEntry

logger = logging.getLogger("vllm.feather_sched")
"""Under vLLM's logger, so Feather's lines appear in the engine's own log."""


def _core_logs_through_vllm() -> None:
    """Send the core's log lines (state file loaded, a write that failed) to vLLM's
    handlers too, unless the application configured the ``feather_sched`` logger itself
    (vLLM configures only its own logger, so INFO lines of the core were lost)."""
    core = logging.getLogger("feather_sched")
    if core.handlers:
        return
    for handler in logging.getLogger("vllm").handlers:
        core.addHandler(handler)
    core.setLevel(logging.INFO)


_core_logs_through_vllm()

MAX_STEPS_IN_FLIGHT = 64
"""Scheduler outputs awaiting their result; more means the engine dropped some."""


def feather_options(vllm_config: Any) -> FeatherConfig:
    """Feather's options from ``--additional-config '{"feather": {...}}'`` or FEATHER_*,
    its files this engine core's: its data-parallel rank is ``data_parallel_index`` (vLLM
    runs a dense model's ranks as independent engines of data_parallel_size 1 and keeps
    the count in ``elastic_ep_max_dp_size``)."""
    parallel = vllm_config.parallel_config
    return FeatherConfig.from_sources(
        feather_mapping(vllm_config), dp_rank=parallel.data_parallel_index,
        dp_ranks=max(parallel.data_parallel_size, parallel.elastic_ep_max_dp_size or 1))


class VllmRequests:
    """``RequestView`` of vLLM requests: chunk keys from the engine's own block hashes,
    the tenant from the request's ``SamplingParams.extra_args``."""

    def __init__(self, hash_block_size: int, chunk_tokens: int,
                 isolation: Isolation | None = None) -> None:
        self.hash_block_size = hash_block_size
        self.blocks_per_chunk = keys_per_chunk(hash_block_size, chunk_tokens)
        self.chunk_tokens = self.blocks_per_chunk * hash_block_size
        """Tokens a chunk key stands for: ``chunk_tokens`` in whole blocks (at least one)."""
        self.isolation = isolation or Isolation()
        self._bad_tenant_logged = False
        self.warm: set[str] | None = None
        """With agent sessions on, the warm continuing turns (``VllmSessions.warm``)."""

    request_id = attrgetter("request_id")
    """The request's id (an attrgetter: the runtime maps it over the running list)."""

    def chunk_keys(self, request: Request) -> list:
        """Keys in the request's namespace (``core.isolation``): every k-th prompt block
        hash (no re-hashing; vLLM's hashes hold its boundary, ``boundary``), or, without
        hashes (prefix caching off), token chunks digested in the whole namespace.  A
        prompt of embeddings has no keys without hashes (its token ids are placeholders)."""
        namespace = self.isolation.namespace(boundary(request),
                                             lambda: self.tenant(request))
        if request.block_hashes:
            return engine_keys(block_chunk_keys(self.prompt_hashes(request),
                                                self.blocks_per_chunk),
                               namespace.beyond_engine())
        if request.prompt_token_ids is None or request.prompt_embeds is not None:
            return []
        return token_keys(request.prompt_token_ids, self.chunk_tokens, namespace)

    def prompt_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens

    def arrival_s(self, request: Request) -> float | None:
        return request.arrival_time

    def priority(self, request: Request) -> int:
        """vLLM's priority; with sessions on, each vLLM class split in two: its warm
        continuing turns first (``2 * priority``), then its other requests.  Urgent
        preemption compares vLLM's own classes (``UrgentRoom.priority``): a warm turn
        preempts no running request of its vLLM class."""
        warm = self.warm
        if warm is None:
            return request.priority
        return 2 * request.priority + (request.request_id not in warm)

    def session_namespace(self, request: Request) -> Namespace:
        """Where the request's session lives: its tenant and its engine boundary
        (``cache_salt``, LoRA, multimodal items), isolated tenants or not."""
        return Namespace(boundary(request), self.tenant(request))

    def tenant(self, request: Request) -> str:
        """``extra_args["tenant"]`` (an OpenAI body's ``vllm_xargs``, which ``feather
        serve`` fills from the ``x-tenant-id`` header or ``user``), as ``parse_tenant``
        takes it; ``DEFAULT_TENANT`` where none is named, as for a pooling request (no
        sampling parameters).  A bad id can only come by the offline API (the HTTP fronts
        refuse it with a 400), and the scheduler cannot refuse a request: it is served as
        the default tenant, and the first such id is logged."""
        params = request.sampling_params
        named = params.extra_args.get(TENANT_ARG) if params and params.extra_args else None
        if named is None:
            return DEFAULT_TENANT
        try:
            return parse_tenant(named, f"request {request.request_id}: extra_args['tenant']")
        except ValueError as error:
            if not self._bad_tenant_logged:
                self._bad_tenant_logged = True
                logger.warning("%s; served as the default tenant (further bad tenant ids "
                               "are not logged)", error)
            return DEFAULT_TENANT

    def prompt_hashes(self, request: Request) -> list:
        """The block hashes of the prompt's full blocks."""
        return request.block_hashes[: request.num_prompt_tokens // self.hash_block_size]


def boundary(request: Request) -> tuple:
    """What vLLM's prefix cache keys a request by besides its tokens, as its first block's
    extra keys (``kv_cache_utils.generate_block_hash_extra_keys``): the LoRA adapter,
    every multimodal item (its hash and place), the ``cache_salt``; () for a plain
    request.  Prompt embeddings are left out: such a request has no token keys."""
    lora = request.lora_request
    parts: list = [("lora", lora.lora_name, lora.lora_path)] if lora else []
    parts += [("mm", feature.identifier, feature.mm_position.offset)
              for feature in request.mm_features]
    if request.cache_salt:
        parts.append(("cache_salt", request.cache_salt))
    return tuple(parts)


class FeatherWaitingQueue(RequestQueue):
    """vLLM's ``RequestQueue`` interface over a ``FeatherRuntime``.

    Every request vLLM puts in the queue is also kept in a dict of its own (O(1) per
    call), apart from Feather's tree, so the requests never depend on Feather's code:
    while Feather does not serve (``faults.serves``: a fault since the pass opened, or
    Feather off), vLLM's own ``PriorityRequestQueue`` over them (``fall_back``) serves:
    (priority, arrival) order, which is arrival order under the FCFS policy (every
    priority 0).  ``pop_request``
    returns the request of the last ``peek_request``, the one vLLM has just given KV.
    """

    def __init__(self, runtime: RuntimeContract[Request], scheduler: Scheduler) -> None:
        self.runtime = runtime
        self.scheduler = scheduler
        self.faults = runtime.faults
        self._members: dict[str, Request] = {}
        """Every request in the queue, by id, whatever Feather's state."""
        self._fallback: PriorityRequestQueue | None = None
        """vLLM's own queue over the members, built by ``fall_back``: it serves while
        ``faults.serves`` is False."""
        self._engine_policy = scheduler.policy
        """vLLM's policy as configured: its victim rule while Feather is out."""
        self._peeked: Request | None = None
        self._popped: Request | None = None

    @property
    def _engine_queue(self) -> PriorityRequestQueue:
        """vLLM's own queue, which serves while ``faults.serves`` is False (``fall_back``
        builds it before that)."""
        if self._fallback is None:
            raise RuntimeError("vLLM's own queue asked for while Feather serves")
        return self._fallback

    # ---- what vLLM's schedule() and request handling call -----------------------------

    def add_request(self, request: Request) -> None:
        self._members[request.request_id] = request
        if not self.faults.serves:
            self._engine_queue.add_request(request)
            return
        self.faults.attempt("enter_waiting", self._enter_waiting, request)

    def _enter_waiting(self, request: Request) -> None:
        """A request comes (back) to waiting: one popped and skipped is settled first (held,
        its admission's charge refunded), since vLLM's loop can end in
        ``kv_holding_waiting`` without asking this queue again."""
        if request is self._popped:
            self.settle()
        self.runtime.enter_waiting(request)

    def prepend_request(self, request: Request) -> None:
        """A preempted request, or one the admission loop skipped, comes back."""
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Requests leave (finished or aborted), wherever vLLM had them."""
        requests = list(requests)
        for request in requests:
            self._members.pop(request.request_id, None)
        if not self.faults.serves:
            self._engine_queue.remove_requests(requests)
            return
        self.faults.attempt("discard", self._discard, requests)

    def __bool__(self) -> bool:
        """The gate: True while a request waits and the answer for it is ADD.

        When vLLM has no seat left it asks this first and then stops on its own check:
        the gate is not asked then, since its answer could not shape the step.
        """
        if self.faults.serves:
            admits = self.faults.call("decide", self._admits)
            if admits is not None:
                return admits
        return bool(self._engine_queue)

    def peek_request(self) -> Request:
        if not self._members:
            raise IndexError("peek from an empty FeatherWaitingQueue")
        if self.faults.serves:
            self._peeked = self.faults.call("decide", self._candidate)
            if self._peeked is not None:
                return self._peeked
        self._peeked = self._engine_queue.peek_request()
        return self._peeked

    def pop_request(self) -> Request:
        request = self._last_peeked()
        self._peeked = None
        del self._members[request.request_id]
        if not self.faults.serves:
            fallback = self._engine_queue
            if fallback.peek_request() is request:
                fallback.pop_request()
            else:  # peeked from Feather's queue before the fall-back: O(waiting)
                fallback.remove_request(request)
            return request
        if self.faults.attempt("admit", self.runtime.admit, request):
            self._popped = request
        return request

    def _last_peeked(self) -> Request:
        """The request of the last ``peek_request`` while it waits, else a new peek."""
        peeked = self._peeked
        if peeked is not None and self._members.get(peeked.request_id) is peeked:
            return peeked
        return self.peek_request()

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[Request]:
        """The requests in vLLM's priority order (priority, arrival)."""
        return iter(sorted(self._members.values()))

    def members(self) -> list[Request]:
        """The waiting requests, unordered.  O(waiting)."""
        return list(self._members.values())

    # ---- Feather's side ---------------------------------------------------------------

    def begin_pass(self) -> None:
        """Before vLLM's pass: Feather resumes after a fault, rebuilt from vLLM's running
        list and this queue's members; a fault here keeps vLLM's order for this pass.

        ``running`` is put in Feather's order and vLLM's policy set to FCFS, whose victim
        is ``running[-1]``: vLLM 0.32 reads ``scheduler.policy`` after start-up only to
        choose a victim (its waiting queue is this one), so it preempts Feather's
        (``FeatherRuntime.preemption_victim``) and each next victim is again the end.
        Under vLLM's priority policy the classes are kept: Feather's order puts the least
        urgent last.  With ``order_running`` off ``running`` keeps vLLM's order and the
        policy is set to PRIORITY, whose victim, ``max(running, key=(priority,
        arrival_time))``, is Feather's: the latest arrival of the least urgent class.
        Under ``fairness: vtc`` vLLM's order and policy stay (``_victim_policy``)."""
        self._peeked = self._popped = None
        if self.faults.open_pass():
            self.faults.attempt("begin_pass", self._begin_pass)

    def _begin_pass(self) -> None:
        running, runtime = self.scheduler.running, self.runtime
        if not self.faults.dirty and len(runtime) != len(self._members):
            raise RuntimeError(f"Feather's queue holds {len(runtime)} requests, "
                               f"vLLM's waiting queue {len(self._members)}")
        ordered = runtime.begin_pass(running, self._members.values(),
                                     held=self.scheduler.kv_holding_waiting)
        self._fallback = None
        running[:] = ordered
        self.scheduler.policy = self._victim_policy()

    def _victim_policy(self) -> SchedulingPolicy:
        """The policy whose victim rule is Feather's (``begin_pass``): FCFS, the end of
        Feather's order; PRIORITY, the latest arrival of the least urgent class, with
        ``order_running`` off; vLLM's own under ``fairness: vtc``, which keeps vLLM's
        running order (the end is VTC's victim under FCFS; the classes stay under
        PRIORITY)."""
        config = self.runtime.config
        if config.is_vtc:
            return self._engine_policy
        return SchedulingPolicy.FCFS if config.order_running else SchedulingPolicy.PRIORITY

    def fall_back(self) -> None:
        """After a fault in Feather's code (``VllmFeather``'s ``on_fault``): vLLM's own
        order and victim rule serve until the next pass resumes Feather.  O(waiting log
        waiting) at the first fault after a pass Feather served, O(1) after that."""
        self.scheduler.policy = self._engine_policy
        if self._fallback is None:
            self._fallback = PriorityRequestQueue()
            for request in self._members.values():
                self._fallback.add_request(request)
        self._popped = None

    def settle(self) -> None:
        """Hold the last popped request if vLLM skipped it instead of running it.

        vLLM marks an admitted request ``RUNNING`` right after popping it; a skipped one
        keeps its waiting status and goes to a list of its own, handed back after the
        loop.  (Not ``running[-1]``: a request holding KV blocks, such as one preempted
        for an urgent request in this pass, may be admitted after it.)
        """
        popped, self._popped = self._popped, None
        if popped is None or not self.runtime.is_running(popped.request_id):
            return
        if popped.status is not RequestStatus.RUNNING:
            self.runtime.hold(popped.request_id)

    def _discard(self, requests: list[Request]) -> None:
        for request in requests:
            self.runtime.discard(request.request_id)

    def _admits(self) -> bool:
        scheduler = self.scheduler
        seats = scheduler.max_num_active_reqs - scheduler.num_waiting_for_streaming_input
        if len(scheduler.running) >= seats:
            self.settle()
            return bool(self._members)
        answer = self._answer()
        return answer is not None and answer.decision is Decision.ADD

    def _candidate(self) -> Request:
        answer = self._answer()
        if answer is None:
            raise RuntimeError(f"Feather's queue is empty, vLLM's holds {len(self._members)}")
        return self.runtime.request(answer.request_id)

    def _answer(self) -> Admission | None:
        self.settle()
        return self.runtime.decide()


class KvHoldingQueue(RequestQueue):
    """vLLM's own ``kv_holding_waiting`` queue (requests that hold KV blocks: finished
    remote KV loads, resumed streaming turns, skipped requests), which vLLM drains before
    the waiting queue, in its own order and ungated.  It stays vLLM's, with one change:
    while Feather's queue holds a request that a bound has made due (``FeatherQueue.due``)
    and the head of this queue would pass it (a later arrival of its class, or a less
    urgent one), this queue reads as empty, so vLLM turns to Feather's queue and the due
    request goes first.  So too while a less urgent head would take the room there is in
    this pass for an urgent request not yet admitted (``UrgentRoom.holds_back``).  Not
    while nothing runs: KV the held requests keep might be what the due request lacks,
    and this queue must then drain.  Its admissions count for the bound like any other
    (Feather sees them run).  Not while Feather is out of the pass (a fault, or off)
    either.
    """

    def __init__(self, inner: RequestQueue, waiting: FeatherWaitingQueue,
                 scheduler: Scheduler, urgent: UrgentRoom) -> None:
        self.inner = inner
        self.waiting = waiting
        self.scheduler = scheduler
        self.urgent = urgent

    def __bool__(self) -> bool:
        if not self.inner:
            return False
        scheduler = self.scheduler
        if not scheduler.running or scheduler.pause_state != PauseState.UNPAUSED or \
                not self.waiting.faults.serves:
            return True
        head = self.inner.peek_request()
        if self.urgent.holds_back(head):
            return False
        passes = self.waiting.faults.call("passes_due", self.waiting.runtime.passes_due,
                                          head, default=False)
        return not passes

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.inner)

    def add_request(self, request: Request) -> None:
        self.inner.add_request(request)

    def pop_request(self) -> Request:
        return self.inner.pop_request()

    def peek_request(self) -> Request:
        return self.inner.peek_request()

    def prepend_request(self, request: Request) -> None:
        self.inner.prepend_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self.inner.prepend_requests(requests)

    def remove_request(self, request: Request) -> None:
        self.inner.remove_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self.inner.remove_requests(requests)


class SchedulerComponent(Protocol):
    """What the scheduler's hooks (``_Hooks``) call on their component: ``VllmMeter`` for
    the FCFS baseline, ``VllmFeather`` for Feather."""

    def __init__(self, scheduler: Scheduler, config: FeatherConfig) -> None:
        """Built by the hooks, once, for their scheduler and its options."""

    def before_schedule(self, throttle_prefills: bool = False) -> None:
        """Before vLLM's pass (``throttle_prefills``: as vLLM's ``schedule`` is told)."""

    def after_schedule(self, output: Any) -> None:
        """vLLM's pass formed ``output``."""

    def step_done(self, output: Any) -> None:
        """The step of ``output`` ran; its result is about to update vLLM's requests."""

    @property
    def counts_service(self) -> bool:
        """Whether ``generated`` is wanted (Feather's fair share)."""

    def generated(self, request: Request, tokens: int) -> None:
        """vLLM appended ``tokens`` sampled tokens to ``request``."""

    def arrived(self, request: Request) -> None:
        """A new request reaches the scheduler."""

    def freed(self, request: Request) -> None:
        """vLLM frees ``request`` (finished or aborted)."""

    def before_reset(self) -> None:
        """vLLM is about to reset its prefix cache."""

    def close(self) -> None:
        """The scheduler shuts down."""


StepRecord = Callable[[Any, int, float, "list[BatchEntry] | None"], None]
"""Where a step ran goes: (its ``SchedulerOutput``, its size, its seconds, its batch)."""


class VllmMeter:
    """A vLLM scheduler's measurements: ``schedule()`` time, step times, the step log.

    The FCFS baseline (``InstrumentedScheduler``) runs it as its component; Feather's
    component holds one and tells it, per call, where preemptions and steps go, so both
    are measured alike.  A step is keyed by its ``SchedulerOutput`` (kept until its result
    arrives).  An exception in the measurements is contained (``faults``): counted,
    logged, never raised into vLLM.
    """

    def __init__(self, scheduler: Scheduler, config: FeatherConfig,
                 meter: StepMeter | None = None, faults: FaultGuard | None = None) -> None:
        self.scheduler = scheduler
        self.config = config
        self.view = requests_view(scheduler, config)
        self.meter = meter if meter is not None else StepMeter(
            type(scheduler).__name__, stats_file=config.stats_file, step_log=config.step_log,
            save_every_s=config.save_every_s)
        self.faults = faults if faults is not None else FaultGuard(
            type(scheduler).__name__, config.max_faults, self.meter)
        self._in_flight: OrderedDict[int, tuple[Any, float, list[BatchEntry] | None]] = \
            OrderedDict()
        self._started = 0.0

    @property
    def wants_batches(self) -> bool:
        """Whether each step's batch is described (for the step log)."""
        return self.config.step_log is not None

    def before_schedule(self, throttle_prefills: bool = False) -> None:
        """Before vLLM's pass: its ``schedule()`` time starts."""
        self._started = time.perf_counter()

    def after_schedule(self, output: Any) -> None:
        if self.faults.active and self.faults.attempt("meter", self.measure, output,
                                                      self.preempted, self.wants_batches):
            self.faults.served(decided=True)  # the baseline's whole pass

    def measure(self, output: Any, preempted: Callable[[Request], None],
                batches: bool) -> None:
        """The pass that formed ``output``: its time; each request it preempted handed to
        ``preempted``; its step kept (with its batch if ``batches``)."""
        now = time.perf_counter()
        self.meter.scheduled(now - self._started)
        requests = self.scheduler.requests
        for request_id in output.preempted_req_ids or ():
            request = requests.get(request_id)
            if request is not None:
                preempted(request)
        batch = self.batch(output) if batches else None
        self._in_flight[id(output)] = (output, now, batch)
        while len(self._in_flight) > MAX_STEPS_IN_FLIGHT:
            self._in_flight.popitem(last=False)

    def step_done(self, output: Any, record: StepRecord | None = None) -> None:
        """The step of ``output`` ran: ``record`` (else ``record_step``) takes it."""
        entry = self._in_flight.pop(id(output), None)
        if entry is None or not self.faults.active:
            return
        _, started, batch = entry
        self.faults.attempt("step", record or self.record_step, output,
                            len(output.num_scheduled_tokens), time.perf_counter() - started,
                            batch)

    def record_step(self, output: Any, size: int, seconds: float,
                    batch: list[BatchEntry] | None) -> None:
        if size:
            self.meter.step(size, seconds, batch)
        if not self.scheduler.has_unfinished_requests():
            self.meter.save()  # drained: a run's end is on file even if shutdown is cut short

    def preempted(self, request: Request, *, urgent: bool = False) -> None:
        """vLLM preempted ``request`` in this pass (counted once per preemption);
        ``urgent``: for a waiting request of a more urgent class."""
        self.meter.preempted(request.num_preemptions, priority=request.priority,
                             urgent=urgent)

    def arrived(self, request: Request) -> None:
        """Nothing to recognise without Feather."""

    def freed(self, request: Request) -> None:
        """Nothing to forget without Feather."""

    def before_reset(self) -> None:
        """Nothing held without Feather."""

    counts_service = False
    """Without Feather no service is counted."""

    def generated(self, request: Request, tokens: int) -> None:
        """Nothing to count without Feather's fair share."""

    def close(self) -> None:
        self.faults.attempt("close", self.meter.close)

    def batch(self, output: Any) -> list[BatchEntry]:
        """The step's batch as the step log describes it (``describe_batch``, in Feather's
        chunks), in the runner's decode order.

        Decodes first in scheduling order, then longer chunks by length (Model Runner
        V2's ``sort_batch_req_ids``; under the V1 runner Feather's plugin keeps each group
        contiguous as here, while rows sharing nothing stay where vLLM put them, which
        changes no group's run).  The context is ``num_computed_tokens``, which
        ``schedule()`` has already advanced.
        """
        requests, view = self.scheduler.requests, self.view
        scheduled = output.num_scheduled_tokens
        order = sorted(scheduled, key=lambda rid: (scheduled[rid] != 1, scheduled[rid]))
        return describe_batch(((rid, view.chunk_keys(requests[rid]),
                                requests[rid].num_computed_tokens, scheduled[rid])
                               for rid in order), view.chunk_tokens)


def prompt_tokens_computed(request: Request, scheduled: int, drafts: int) -> int:
    """Of the ``scheduled`` tokens a step has just scheduled for ``request`` (``drafts``
    of them speculative), those the step computes that are prompt, or output recomputed
    after a preemption: positions the request knows (``num_tokens``: not async
    scheduling's placeholders, not drafts) from where its computed tokens stood (past
    prefix-cache hits), but a decode's one input, the token sampled last, which its
    generated token pays for (the simulator's count).  Right after ``schedule()``, which
    has advanced ``num_computed_tokens`` by ``scheduled``.  O(1)."""
    start = request.num_computed_tokens - scheduled
    known = request.num_tokens
    computed = max(0, min(start + scheduled - drafts, known) - start)
    decoding = computed == 1 and start + 1 == known and request.num_output_tokens > 0
    return 0 if decoding else computed


def engine_shape(vllm_config: Any) -> EngineShape:
    """The engine's device and model in Feather's terms (the model gate's prior)."""
    parallel = vllm_config.parallel_config
    return EngineShape.of(vllm_config.model_config, current_platform.get_device_name,
                          tensor_parallel=parallel.tensor_parallel_size,
                          pipeline_parallel=parallel.pipeline_parallel_size)


def kv_cache_tokens(scheduler: Scheduler) -> int | None:
    """Tokens vLLM's KV cache holds: its blocks times their size (None if unsized)."""
    blocks = scheduler.cache_config.num_gpu_blocks
    return None if not blocks else blocks * scheduler.block_size


class VllmFeather:
    """Feather's component of a vLLM scheduler: the runtime behind vLLM's calls, measured
    by a ``VllmMeter`` as the baseline is.  Each call asks ``faults.serves`` whether
    Feather serves it (else vLLM's own order and victim rule, ``FeatherWaitingQueue``)."""

    def __init__(self, scheduler: Scheduler, config: FeatherConfig) -> None:
        self.scheduler = scheduler
        self.config = config
        view = requests_view(scheduler, config)
        runtime = FeatherRuntime(config, view, clock=scheduler.feather_clock,
                                 name=type(scheduler).__name__,
                                 seats=scheduler.max_num_active_reqs,
                                 kv_tokens=kv_cache_tokens(scheduler),
                                 engine=engine_shape(scheduler.vllm_config),
                                 chunk_tokens=view.chunk_tokens,
                                 on_fault=self._fall_back)
        self.runtime: RuntimeContract[Request] = runtime
        """Held as the contract: a member outside it is a type error (``make check``)."""
        self.faults = self.runtime.faults
        self.metering = VllmMeter(scheduler, config, self.runtime.meter, self.faults)
        self._computed: OrderedDict[int, list[tuple[str, int]]] = OrderedDict()
        """Under fair share, each step in flight's prompt tokens computed, per request."""
        self.queue = FeatherWaitingQueue(self.runtime, scheduler)
        self.urgent = UrgentRoom(scheduler, runtime)
        self.view = view
        self.sessions = self._sessions(view) if config.sessions else None
        compat.disable_cache_aware_admission(scheduler)
        scheduler.waiting = self.queue
        scheduler.kv_holding_waiting = KvHoldingQueue(scheduler.kv_holding_waiting,
                                                      self.queue, scheduler, self.urgent)
        note, acts = self.order_note()
        logger.info("Feather scheduler: %s; %s", config, note)
        if not acts:
            logger.warning("Feather's batch ordering cannot act: %s", note)
            self.runtime.engine_keeps_its_order()

    def _fall_back(self, where: str) -> None:
        """After a fault (the runtime's ``on_fault``): vLLM's own queue and victim rule."""
        self.queue.fall_back()

    def _sessions(self, view: VllmRequests) -> VllmSessions | None:
        """Agent sessions over this scheduler's block pool (``option sessions``); None,
        with a warning, where vLLM's cache cannot hold them: prefix caching off (nothing
        to hold), a KV connector (it may free or write blocks late) or hashes of another
        block size than the pool's."""
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        why = "prefix caching is off" if not manager.enable_caching else \
            "a KV connector is configured" if scheduler.connector is not None else \
            "the hash block size is not the KV block size" if \
            (getattr(scheduler, "hash_block_size", None) or scheduler.block_size) != \
            scheduler.block_size else None
        if why is not None:
            logger.warning("Feather's agent sessions are off: %s", why)
            return None
        sessions = VllmSessions(scheduler, self.config.session_held_share,
                                view.session_namespace, scheduler.feather_clock,
                                type(scheduler).__name__)
        view.warm = sessions.warm
        manager.allocate_slots = retrying_allocation(manager.allocate_slots,
                                                     self._lacks_blocks)
        return sessions

    def _lacks_blocks(self, request: Request) -> bool:
        """An allocation for ``request`` lacks blocks (inside vLLM's pass): whether a hold
        gave some back (``PinnedSessions.yields``: at once for a running request's
        growth, where vLLM would preempt; for a waiting one, after its wait)."""
        sessions = self.sessions
        if sessions is None or not self.faults.active:
            return False
        waited = None if request.status is RequestStatus.RUNNING else \
            self.scheduler.feather_clock() - request.arrival_time
        return bool(self.faults.call("sessions", sessions.yields, waited,
                                     self.config.max_wait_s, default=False))

    def arrived(self, request: Request) -> None:
        """A new request reaches vLLM's scheduler (before its queue sees it)."""
        if self.sessions is not None and self.faults.active:
            self.faults.attempt("sessions", self.sessions.arrived, request)

    def before_reset(self) -> None:
        """vLLM is about to reset its prefix cache: every hold ends first (vLLM refuses
        to reset while any block is referenced)."""
        if self.sessions is not None:
            self.faults.attempt("sessions", self.sessions.release_all)

    def _sessions_pass(self) -> None:
        """Before a pass: lapsed holds end; with Feather off, every hold, for good."""
        sessions = self.sessions
        if sessions is not None and self.faults.active:
            sessions.expire()
        elif sessions is not None:
            self.sessions = None
            self.view.warm = None
            sessions.release_all()

    def _overdue_join_warm(self) -> None:
        """Requests past ``max_wait_s`` while warm turns of their vLLM class wait join them
        (``PinnedSessions.join_overdue``), re-entered in class ``2 * priority``.  Each
        re-entry counts the request out and in again in Feather's request stats."""
        if self.sessions is None:
            return
        late = self.sessions.join_overdue(
            self.queue.members, self.config.max_wait_s, self.scheduler.feather_clock(),
            lambda r: r.request_id, lambda r: r.priority, lambda r: r.arrival_time)
        if late:
            self.queue.remove_requests(late)
            for request in late:
                self.queue.add_request(request)

    def before_schedule(self, throttle_prefills: bool = False) -> None:
        if self.sessions is not None:
            self.faults.attempt("sessions", self._sessions_pass)
        self.metering.before_schedule()
        self.urgent.forget()
        self.queue.begin_pass()
        if self.sessions is not None and self.faults.serves:
            self.faults.attempt("sessions", self._overdue_join_warm)
        if self.faults.serves and not self.faults.call(
                "urgent", compat.prefills_deferred, self.scheduler, throttle_prefills,
                default=True):
            self.faults.attempt("urgent", self.urgent.make)

    def after_schedule(self, output: Any) -> None:
        if not self.faults.active:
            return
        if self.faults.serves:
            self.faults.attempt("end_pass", self._end_pass, output)
        if self.sessions is not None:
            self.faults.attempt("sessions", self.sessions.after_pass, output)
        self.faults.attempt("meter", self._measure, output)
        if self.runtime.counts_service:
            self.faults.attempt("served", self._note_computed, output)

    def _measure(self, output: Any) -> None:
        self.metering.measure(output, self._preempted, self.runtime.wants_batches)

    def _preempted(self, request: Request) -> None:
        """vLLM preempted ``request`` in this pass (for an urgent request if it is one of
        ``urgent``'s victims): the runtime counts it, or the meter while Feather is out."""
        urgent = request.request_id in self.urgent.victims
        if self.faults.serves:
            self.runtime.preempted(request, urgent=urgent)
        else:
            self.metering.preempted(request, urgent=urgent)

    def _end_pass(self, output: Any) -> None:
        self.runtime.end_pass(id(output), self.scheduler.running)
        self.order_output(output)

    def order_output(self, output: Any) -> None:
        """List the step's requests in Feather's order, which the batch follows (Model
        Runner V2 directly, the V1 runner through the worker plugin). vLLM lists them in
        the order it scheduled them, so a request it resumed in this pass would follow
        the others: a preempted request whose KV is still cached resumes as a one-token
        "decode", away from its group. Nothing to do while no group runs two members
        (a batch that shares nothing gains nothing from its order). O(running)."""
        scheduled = output.num_scheduled_tokens
        if len(scheduled) < 2 or not self.runtime.batch_has_groups:
            return
        ordered = [r.request_id for r in self.runtime.batch_order(self.scheduler.running)
                   if r.request_id in scheduled]
        if len(ordered) == len(scheduled) and ordered != list(scheduled):
            output.num_scheduled_tokens = {rid: scheduled[rid] for rid in ordered}

    # ---- service under fair share (``FeatherRuntime.served``) ---------------------------
    # A step's computed prompt tokens are counted when its result arrives (before vLLM's
    # ``update_from_output``), its generated tokens as vLLM appends them (inside it, before
    # it frees a finished request), so both reach the runtime before ``discard``.

    def _note_computed(self, output: Any) -> None:
        requests, drafts = self.scheduler.requests, output.scheduled_spec_decode_tokens
        self._computed[id(output)] = [
            (rid, computed) for rid, scheduled in output.num_scheduled_tokens.items()
            if (computed := prompt_tokens_computed(requests[rid], scheduled,
                                                   len(drafts.get(rid, ()))))]
        while len(self._computed) > MAX_STEPS_IN_FLIGHT:
            self._computed.popitem(last=False)

    def step_done(self, output: Any) -> None:
        self.metering.step_done(output, self._end_step)
        computed = self._computed.pop(id(output), None)
        if computed and self.faults.active:
            self.faults.attempt("served", self._serve_computed, computed)

    def _serve_computed(self, computed: list[tuple[str, int]]) -> None:
        for request_id, tokens in computed:
            self.runtime.served(request_id, tokens, 0)

    def _end_step(self, output: Any, size: int, seconds: float,
                  batch: list[BatchEntry] | None) -> None:
        self.runtime.end_step(id(output), size, seconds, batch)
        if self.sessions is not None:
            self.sessions.cost.observe(output.total_num_scheduled_tokens, seconds)

    @property
    def counts_service(self) -> bool:
        return self.faults.active and self.runtime.counts_service

    def generated(self, request: Request, tokens: int) -> None:
        """vLLM appended ``tokens`` sampled tokens to ``request`` (accepted drafts and the
        bonus token; rejected drafts are not appended)."""
        self.faults.attempt("served", self.runtime.served, request.request_id, 0, tokens)

    def freed(self, request: Request) -> None:
        if self.sessions is not None and self.faults.active:
            self.faults.attempt("sessions", self.sessions.ended, request)
        if self.faults.serves:  # otherwise rebuilt before its next pass
            self.faults.attempt("discard", self.runtime.discard, request.request_id)

    def close(self) -> None:
        self.before_reset()
        self.metering.close()

    def order_note(self) -> tuple[str, bool]:
        """Which model runner the workers use and how batch ordering acts there; and
        whether it can act at all."""
        if not self.config.order_running:
            return "batch ordering off (order_running false)", True
        vllm_config = self.scheduler.vllm_config
        if compat.uses_v2_runner(self.scheduler):
            if vllm_config.parallel_config.prefill_context_parallel_size > 1:
                return ("Model Runner V2 with prefill context parallelism reorders each "
                        "rank's rows itself"), False
            return ("Model Runner V2: the running list's order by prefix group is the "
                    "batch's decode order"), True
        if not compat.has_v1_runner():
            return "V1 model runner, absent from this vLLM", False
        if not plugin_allowed(BATCH_ORDER_PLUGIN):
            return (f"V1 model runner, but the worker plugin {BATCH_ORDER_PLUGIN!r} is not "
                    "installed or not in VLLM_PLUGINS"), False
        return ("V1 model runner: the worker plugin "
                f"{BATCH_ORDER_PLUGIN!r} gathers each prefix group in the persistent "
                "batch"), True


if TYPE_CHECKING:  # the hooks are mixed into vLLM's scheduler classes below
    from vllm.v1.core.sched.scheduler import Scheduler as _EngineScheduler
else:
    _EngineScheduler = object


class _Hooks(_EngineScheduler):
    """The scheduler calls Feather needs, each handed to ``self.feather`` (vLLM appending
    a step's sampled tokens, ``_update_request_with_output``, only under fair share).

    ``component`` is the class of ``self.feather``; ``sync_variant`` the class to build
    instead when async scheduling is off (for the class that names it, not for subclasses,
    which would lose their own overrides: those must match the engine's mode).
    """

    component: type[SchedulerComponent] = VllmMeter
    sync_variant: type | None = None
    feather_clock: Callable[[], float] = staticmethod(time.time)
    """The clock Feather's waiting bounds read: vLLM's own (``Request.arrival_time`` is
    ``time.time()``); a test harness may give its own."""

    def __new__(cls, *args: Any, **kwargs: Any):
        vllm_config: Any = kwargs.get("vllm_config", args[0] if args else None)
        sync_variant = cls.__dict__.get("sync_variant")
        if sync_variant is not None and not vllm_config.scheduler_config.async_scheduling:
            return sync_variant(*args, **kwargs)
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        compat.in_range(f"{type(self).__name__} runs on it untested")
        is_async = bool(self.scheduler_config.async_scheduling)
        if is_async != isinstance(self, AsyncScheduler):
            raise ValueError(
                f"{type(self).__name__} does not match async scheduling "
                f"{'on' if is_async else 'off'}: use FeatherScheduler (or "
                "InstrumentedScheduler), which picks the variant the engine needs")
        self.feather: SchedulerComponent = self.component(self,
                                                          feather_options(self.vllm_config))

    def schedule(self, throttle_prefills: bool = False):
        self.feather.before_schedule(throttle_prefills)
        output = super().schedule(throttle_prefills)
        self.feather.after_schedule(output)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        self.feather.step_done(scheduler_output)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _update_request_with_output(self, request: Request, new_token_ids: list[int],
                                    *args: Any, **kwargs: Any) -> tuple[list[int], bool]:
        new_token_ids, stopped = super()._update_request_with_output(
            request, new_token_ids, *args, **kwargs)
        if new_token_ids and self.feather.counts_service:
            self.feather.generated(request, len(new_token_ids))
        return new_token_ids, stopped

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:  # not a streaming input's next chunk
            self.feather.arrived(request)
        super().add_request(request)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any):
        self.feather.freed(request)
        return super()._free_request(request, *args, **kwargs)

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self.feather.before_reset()
        return super().reset_prefix_cache(*args, **kwargs)

    def shutdown(self) -> None:
        self.feather.close()
        super().shutdown()


class InstrumentedSyncScheduler(_Hooks, Scheduler):
    """vLLM's synchronous scheduler with Feather's measurements only."""


class InstrumentedScheduler(_Hooks, AsyncScheduler):
    """vLLM's own scheduler with Feather's measurements only: feather bench's baseline."""

    sync_variant = InstrumentedSyncScheduler


class FeatherSyncScheduler(_Hooks, Scheduler):
    """Feather in vLLM with async scheduling off (always the case on CPU)."""

    component = VllmFeather


class FeatherScheduler(_Hooks, AsyncScheduler):
    """Feather in vLLM; builds ``FeatherSyncScheduler`` when async scheduling is off."""

    component = VllmFeather
    sync_variant = FeatherSyncScheduler


BATCH_ORDER_PLUGIN = "feather_batch_order"
"""This package's ``vllm.general_plugins`` entry point (``plugins.register_batch_order``)."""


def plugin_allowed(name: str) -> bool:
    """Whether vLLM will load general plugin ``name`` in its workers (as vLLM decides)."""
    from importlib.metadata import entry_points

    import vllm.envs as envs

    installed = {plugin.name for plugin in entry_points(group="vllm.general_plugins")}
    allowed = envs.VLLM_PLUGINS
    return name in installed and (allowed is None or name in allowed)


def requests_view(scheduler: Scheduler, config: FeatherConfig) -> VllmRequests:
    """How Feather reads this scheduler's requests (block hashes of its hash block size)."""
    hash_block_size = getattr(scheduler, "hash_block_size", None) or scheduler.block_size
    return VllmRequests(hash_block_size, config.chunk_tokens, config.isolation)


def is_feather_scheduler(scheduler_cls: type) -> bool:
    """Whether an engine's scheduler class runs Feather (either variant)."""
    return isinstance(scheduler_cls, type) and issubclass(scheduler_cls, _Hooks) and \
        issubclass(scheduler_cls.component, VllmFeather)

