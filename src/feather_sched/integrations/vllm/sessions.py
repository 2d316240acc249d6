"""Agent sessions in vLLM (0.32-0.34): ``core.sessions``'s rule over vLLM's requests and
its own ``BlockPool``; ``VllmSessions`` translates, the rule decides.

A new request's prompt block hashes go to ``Sessions.arrived`` (namespace: its tenant and
``cache_salt``/LoRA boundary); a warm continuing turn is named in ``warm``, class 0 of its
vLLM priority in ``VllmRequests.priority`` (others class 1).  When vLLM frees a request
(``Scheduler._free_request``, before its blocks) its prefix-cached blocks are held where
``Sessions.turn_ended`` says: one more reference each (``BlockPool.touch``), so vLLM's
free leaves them out of the free queue.  A hold ends with ``BlockPool.free_blocks`` of
those blocks, tail first: at its next turn's admission, at its TTL (checked each pass),
when an allocation for a running request's growth or a request waiting past
``max_wait_s`` lacks blocks (``allocate_slots`` retried), when a pass schedules nothing
while requests wait, on a prefix-cache reset, Feather turning off, shutdown.  Cost:
O(a request's blocks) at arrival and end, O(holds) a pass.  docs/sessions.md.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from vllm.v1.request import Request

from feather_sched.core.isolation import Namespace
from feather_sched.core.session_pins import PinnedSessions

logger = logging.getLogger("vllm.feather_sched")

SESSION_ARG = "session"
"""``SamplingParams.extra_args`` key that names a request's session explicitly."""


def pool_of(block: Any) -> Any:
    """The ``BlockPool`` a KV block names as its own (vLLM 0.34 by weak reference), or
    None where it names none."""
    owner = getattr(block, "pool", None)
    return owner() if isinstance(owner, weakref.ref) else owner


class VllmSessions(PinnedSessions[list[Any]]):
    """Feather's sessions in one vLLM scheduler (module docstring), a hold pinned by one
    more reference on each of its blocks.  ``namespace_of(request)`` is the request's
    session namespace, ``clock`` Feather's clock."""

    def __init__(self, scheduler: Any, held_share: float,
                 namespace_of: Callable[[Request], Namespace],
                 clock: Callable[[], float], name: str) -> None:
        self.scheduler = scheduler
        self.pool = scheduler.kv_cache_manager.block_pool
        super().__init__(held_share, self.pool.num_gpu_blocks - 1, clock, name)
        self.groups = list(range(len(scheduler.kv_cache_config.kv_cache_groups)))
        self.namespace_of = namespace_of

    def unpin(self, pin: list[Any]) -> None:
        self.pool.free_blocks(reversed(pin))  # tail first, as vLLM frees a request's

    # ---- requests ---------------------------------------------------------------------

    def arrived(self, request: Request) -> None:
        """A new request: its session recognised (``PinnedSessions.recognise``), warm or
        not."""
        keys = request.block_hashes[: request.num_prompt_tokens // self.scheduler.block_size]
        params = request.sampling_params
        explicit = params.extra_args.get(SESSION_ARG) if params and params.extra_args else None
        self.recognise(request.request_id, self.namespace_of(request), keys, explicit,
                       lambda: 2 * self.cached_blocks(keys) >= len(keys))

    def cached_blocks(self, keys: list) -> int:
        """How many of ``keys``' leading blocks vLLM's prefix cache holds now."""
        cached = 0
        for key in keys:
            if self.pool.get_cached_block(key, self.groups) is None:
                break
            cached += 1
        return cached

    def ended(self, request: Request) -> None:
        """vLLM is about to free finished (or aborted) ``request``: its prefix-cached
        blocks are held if the rule says so (touched now, so vLLM's free keeps them)."""
        request_id = request.request_id
        if not self.ending(request_id):
            return
        blocks = self.held_blocks(request_id)
        reason = request.get_finished_reason()
        tokens = min(request.num_computed_tokens, len(blocks) * self.scheduler.block_size)
        self.turn_ended(request_id, request.block_hashes, len(blocks), tokens,
                        "abort" if reason is None else str(reason),
                        [b.block_id for b in blocks], lambda: self._touched(blocks))

    def _touched(self, blocks: list[Any]) -> list[Any]:
        self.pool.touch(blocks)
        return blocks

    def held_blocks(self, request_id: str) -> list[Any]:
        """The request's blocks a hold keeps: those in vLLM's prefix cache (hashed), of
        this pool, each once, in the request's order."""
        seen: set[int] = set()
        blocks = []
        for group in self.scheduler.kv_cache_manager.get_blocks(request_id).blocks:
            for block in group:
                if block.block_hash is None or block.is_null or block.block_id in seen or \
                        pool_of(block) not in (None, self.pool):
                    continue
                seen.add(block.block_id)
                blocks.append(block)
        return blocks

    def after_pass(self, output: Any) -> None:
        """After vLLM's pass formed ``output``: the holds of the turns it admitted end; a
        pass that scheduled nothing while requests wait and none runs releases the least
        valuable hold (holds never stall the engine); the metrics published."""
        for new in output.scheduled_new_reqs:
            self.admitted(new.req_id)
        scheduler = self.scheduler
        if not output.num_scheduled_tokens and self.pins and len(scheduler.waiting) and \
                not scheduler.running:
            self.yields()
        self.publish()


def retrying_allocation(allocate: Callable[..., Any], yields: Callable[[Request], bool]
                        ) -> Callable[..., Any]:
    """``KVCacheManager.allocate_slots`` that, where ``request`` finds no blocks, asks
    ``yields(request)`` (a hold released for it?) and tries again while one is: vLLM
    then neither preempts a request nor stops admitting for blocks a hold kept.  vLLM's
    own call otherwise; a retry repeats vLLM's call unchanged (a failed one took no
    blocks: it returns before ``allocate_new_computed_blocks``)."""
    def allocate_slots(request: Request, *args: Any, **kwargs: Any) -> Any:
        blocks = allocate(request, *args, **kwargs)
        while blocks is None and yields(request):
            blocks = allocate(request, *args, **kwargs)
        return blocks
    allocate_slots.feather_wraps = allocate  # type: ignore[attr-defined]
    return allocate_slots
