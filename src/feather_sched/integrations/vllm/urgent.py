"""Urgent preemption in vLLM (0.32-0.34): room for a waiting request of a more urgent class.

vLLM preempts only to give a RUNNING request KV blocks (vLLM issue #40004).  ``UrgentRoom``
acts before vLLM's pass (``VllmFeather.before_schedule``): where Feather's next ADD, of the
most urgent class waiting, lacks a seat or KV blocks, the core's ``make_room`` preempts
``FeatherRuntime.urgent_victims`` through vLLM's own ``_preempt_request`` and vLLM's pass
admits the request; ``KvHoldingQueue`` keeps ``kv_holding_waiting``'s less urgent requests
back until it is in.  ``Room`` replays vLLM's arithmetic with its pure queries (seats, free
blocks, what victims free, the watermark, the running requests' blocks first).  Cost:
nothing outside vLLM's priority policy; under it O(running) a pass while requests wait,
then O(victims' blocks) per set tried.  The vLLM-private members read are ``PRIVATE``,
checked once: a release without one leaves urgent preemption off, with one warning.  Why
before the pass, and every case left alone: docs/vllm.md#urgent-preemption.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from operator import attrgetter

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from feather_sched import core
from feather_sched.core import FeatherRuntime, engine_members
from feather_sched.integrations.vllm import compat

logger = logging.getLogger("vllm.feather_sched")
PRIVATE = ("_preempt_request", "_request_blocks_can_be_freed")
"""The members of vLLM's ``Scheduler`` this module reads that vLLM keeps private (its
own preemption, and whether a request's blocks free now)."""


class UrgentRoom:
    """Preempts less urgent running requests for Feather's next admission (module
    docstring); remembers for whom (``request``) and whom (``victims``) in this pass."""

    def __init__(self, scheduler: Scheduler, runtime: FeatherRuntime[Request]) -> None:
        self.scheduler = scheduler
        self.runtime = runtime
        self.under_priority = \
            SchedulingPolicy(scheduler.scheduler_config.policy) is SchedulingPolicy.PRIORITY \
            and engine_members(scheduler, PRIVATE, "Feather's urgent preemption", logger)
        """vLLM's priority policy, and every member of ``PRIVATE`` there: urgent
        preemption may act."""
        self.request: Request | None = None
        """The urgent request there is room for in this pass (made or found)."""
        self.victims: set[str] = set()
        """Requests preempted for urgency in this pass (reported in its output)."""

    def forget(self) -> None:
        """A new pass: no urgent request and no victims yet (whether or not ``make``
        runs in it)."""
        self.request, self.victims = None, set()

    def make(self) -> None:
        """Before vLLM's pass, after ``forget``: make room for Feather's next admission if
        it is more urgent than a running request and lacks a seat or KV blocks (the
        core's ``make_room``, with this as its ``Engine``). Call only while Feather
        serves the pass."""
        scheduler, runtime = self.scheduler, self.runtime
        if self.under_priority and runtime.config.max_urgent_preemptions and \
                scheduler.pause_state == PauseState.UNPAUSED:
            self.request = core.make_room(runtime, scheduler.running, self)

    def holds_back(self, request: Request) -> bool:
        """Whether ``request`` (the head of ``kv_holding_waiting``, which vLLM drains
        first, ungated) must wait for the urgent request there is room for in this pass,
        lest it take that room: it is of a less urgent class and that one is not admitted
        yet. For one pass at most."""
        urgent = self.request
        return urgent is not None and urgent.status is not RequestStatus.RUNNING and \
            request.priority > urgent.priority

    # ---- ``core.urgent.Engine``: vLLM's types, room arithmetic and preemption ----------

    priority = staticmethod(attrgetter("priority"))
    request_id = staticmethod(attrgetter("request_id"))

    def room(self, request: Request) -> Room | None:
        """vLLM's ``Room`` for ``request``, or None where vLLM would skip it."""
        return Room(self.scheduler, request) if self._schedulable(request) else None

    def _schedulable(self, request: Request) -> bool:
        """Whether vLLM's waiting loop would try to allocate for ``request`` rather than
        skip it: a plain waiting or preempted request holding no KV, without stale output
        in flight, with a LoRA slot if it needs one."""
        if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) or \
                request.num_computed_tokens or \
                (request.num_stale_output_tokens and not request.drop_stale_output):
            return False
        scheduler = self.scheduler
        lora = request.lora_request
        if scheduler.lora_config is None or lora is None:
            return True
        loaded = {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request}
        return lora.lora_int_id in loaded or len(loaded) < scheduler.lora_config.max_loras

    def preempt(self, victim: Request) -> None:
        """vLLM's own preemption of running ``victim``, outside its loop: out of
        ``running``, then ``_preempt_request`` (dropping the in-flight output only where
        a KV connector needs it delivered, as vLLM's loop does)."""
        scheduler = self.scheduler
        if victim.status is not RequestStatus.RUNNING:
            raise RuntimeError(f"urgent victim {victim.request_id} is {victim.status.name}")
        scheduler.running.remove(victim)
        scheduler._preempt_request(victim, time.monotonic(),
                                   drop_stale_output=scheduler.requires_kv_delivery)
        compat.forget_prev_step(scheduler, victim.request_id)
        self.victims.add(victim.request_id)


class Room(core.Room[Request]):
    """vLLM's ``core.Room``: whether preempting a set of running requests lets
    ``request`` into the coming pass (``made_by``), from a snapshot of vLLM's scheduler
    taken before it."""

    def __init__(self, scheduler: Scheduler, request: Request) -> None:
        self.scheduler = scheduler
        self.request = request
        manager = scheduler.kv_cache_manager
        self.seats = scheduler.max_num_active_reqs - scheduler.num_waiting_for_streaming_input \
            - len(scheduler.running)
        connector = scheduler.connector
        self.blocks_coming = connector is not None and connector.has_pending_block_frees()
        self.free = manager.block_pool.get_num_free_blocks()
        self.watermark = manager.watermark_blocks
        """Kept free from a waiting request while anything else is scheduled."""
        self.cap = self._chunk_cap()
        self.needs: dict[str, tuple[int, int]] = {
            r.request_id: self._next_step(r) for r in scheduler.running}
        """Per running request, the (blocks, tokens) vLLM's running loop gives it first."""
        self.running_blocks = sum(blocks for blocks, _ in self.needs.values())
        self.running_tokens = sum(tokens for _, tokens in self.needs.values())
        hits, self.hit_tokens, _ = manager.get_computed_blocks(request)
        self.hits = hits.blocks
        self.hit_ids = {block.block_id for group in self.hits for block in group}

    def made_by(self, victims: Sequence[Request]) -> bool:
        """Whether ``request`` gets a seat and its KV blocks once ``victims`` are
        preempted. O(victims' blocks)."""
        if self.seats + len(victims) < 1:
            return False
        if self.blocks_coming:
            return True
        freed = self._freed(victims)
        blocks = tokens = 0
        for victim in victims:
            victim_blocks, victim_tokens = self.needs[victim.request_id]
            blocks += victim_blocks
            tokens += victim_tokens
        needed = self._blocks_needed(self.running_tokens - tokens) + \
            len(freed & self.hit_ids) + self.running_blocks - blocks
        if len(victims) < len(self.needs):
            needed += self.watermark
        return needed <= self.free + len(freed)

    def _freed(self, victims: Iterable[Request]) -> set[int]:
        """The ids of the blocks that return to the pool when ``victims`` are preempted:
        those every holder of which is a victim (``ref_cnt``), of victims whose blocks
        vLLM frees now (``_request_blocks_can_be_freed``)."""
        scheduler = self.scheduler
        coordinator = scheduler.kv_cache_manager.coordinator
        held: Counter[int] = Counter()
        blocks = {}
        for victim in victims:
            if not scheduler._request_blocks_can_be_freed(victim):
                continue
            for group in coordinator.get_blocks(victim.request_id):
                for block in group:
                    if not block.is_null:
                        held[block.block_id] += 1
                        blocks[block.block_id] = block
        return {block_id for block_id, count in held.items()
                if blocks[block_id].ref_cnt <= count}

    def _blocks_needed(self, running_tokens: int) -> int:
        """The blocks ``allocate_slots`` takes for ``request`` after its prefix-cache hits
        (hits that are free now count: adopting one takes it off the free queue), for its
        first chunk when the running requests take ``running_tokens`` of the budget."""
        scheduler, request = self.scheduler, self.request
        tokens = request.num_tokens - self.hit_tokens
        if scheduler.scheduler_config.enable_chunked_prefill and \
                not scheduler.scheduler_reserve_full_isl:
            tokens = min(tokens, self.cap,
                         max(scheduler.max_num_scheduled_tokens - running_tokens, 1))
        return self._blocks_for(request, self.hit_tokens, tokens, self.hits)

    def _next_step(self, running: Request) -> tuple[int, int]:
        """The blocks and tokens vLLM's running loop gives a running request in this pass:
        its next tokens (``num_tokens_with_spec`` plus output placeholders, less
        computed, up to ``long_prefill_token_threshold``); none for a request whose last
        step is in flight (async scheduling: vLLM's own test in ``schedule()``)."""
        new = min(running.num_tokens_with_spec + running.num_output_placeholders -
                  running.num_computed_tokens, self.cap)
        last_in_flight = running.num_output_placeholders > 0 and \
            running.num_computed_tokens + 2 - running.num_output_placeholders >= \
            running.num_prompt_tokens + running.max_tokens
        if new <= 0 or last_in_flight:
            return 0, 0
        return self._blocks_for(running, running.num_computed_tokens, new, None), new

    def _chunk_cap(self) -> int:
        """The most tokens vLLM schedules for one request in a pass."""
        scheduler = self.scheduler
        threshold = scheduler.scheduler_config.long_prefill_token_threshold
        return threshold if threshold > 0 else scheduler.max_num_scheduled_tokens

    def _blocks_for(self, request: Request, computed: int, new: int,
                    hits: Sequence | None) -> int:
        """New blocks ``allocate_slots`` takes for ``new`` tokens after ``computed`` ones
        (``hits``: the prefix-cache blocks a waiting request adopts), as it asks the
        coordinator."""
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        return manager.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id,
            num_tokens=min(computed + new + scheduler.num_lookahead_tokens,
                           scheduler.max_model_len),
            new_computed_blocks=manager.empty_kv_cache_blocks.blocks if hits is None
            else hits, num_encoder_tokens=0, total_computed_tokens=computed,
            num_local_computed_tokens=computed, num_tokens_main_model=computed + new,
            prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1))
