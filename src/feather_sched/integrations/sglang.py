"""Feather inside SGLang's scheduler (pinned: sglang 0.5.23).

SGLang has no scheduler-class flag and runs each scheduler in a process started with
multiprocessing 'spawn', so Feather reaches it through SGLang's own plugin hooks:
``register()`` puts four AROUND hooks into ``sglang.srt.plugins.hook_registry.HookRegistry``,
and ``load_plugins()``, which SGLang calls first thing in every scheduler process
(``run_scheduler_process``), applies them there.  ``register()`` runs in that process
because ``python -m feather_sched.integrations.sglang_launch`` calls it at module level and
'spawn' re-imports the parent's ``__main__`` module in each child (and grandchild, e.g.
under the data-parallel controller).  The same ``register`` can also serve as a general
plugin (entry point group ``sglang.srt.plugins``).

The hooks are inert unless ``FEATHER_SGLANG=1`` is set in the environment (the launcher
sets it for ``--schedule-policy feather``); then, in each scheduler:

* Order: ``FeatherSchedulePolicy`` (a ``SchedulePolicy`` on top of SGLang's ``fcfs``)
  orders the waiting queue by the Chunked Hash Tree: the tree's candidate first (the
  starved request, else the one missing the fewest chunks of the running set), then by
  missing chunks and arrival.  After each admission the new best candidate is moved to
  the next position of the list SGLang's admission loop is walking, so the order follows
  the tree as the running set grows.  Chunk keys are ``token_chunk_keys(req.origin_input_ids,
  chunk_tokens)``, computed once per request when it enters the waiting queue.
* Gate: ``FeatherPrefillAdder`` (returned by ``Scheduler.get_prefill_adder_class``) asks
  the ``FeatherQueue`` before each ``add_one_req``; on STOP it answers ``OTHER``, which
  ends SGLang's admission loop for this round; requests SGLang admits are popped from
  the tree.  A request SGLang skips (LoRA slots, pooling mode, storage prefetch) is parked
  out of the tree for the rest of the round so the next one can be judged.
* Feedback: each executed batch's size and its time from launch (``batch.launch_ts``) to
  result processing go to ``FeatherQueue.record_step``; ``new_step`` starts each
  scheduling round (each ``calc_priority``).
* Exits: finished requests leave the tree when their batch result is processed; at the
  start of every round the tree is reconciled with SGLang's waiting queue, running batch
  and chunked request, which catches aborts (waiting or running), retractions and
  priority preemptions (back to waiting: requeued) whatever path they took.

Options: ``FEATHER_*`` environment variables (see ``feather_sched.config``), or a JSON
object in ``FEATHER_SGLANG_OPTIONS`` (the launcher's ``--feather-options``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy

from feather_sched.cht import RequestState, token_chunk_keys
from feather_sched.config import FeatherConfig, FeatherConfigError
from feather_sched.queue import FeatherQueue
from feather_sched.stats import SchedulerStats

logger = logging.getLogger("sglang.feather_sched")

POLICY_NAME = "feather"
"""What ``--schedule-policy`` takes under the launcher."""
BASE_POLICY = "fcfs"
"""The SGLang policy the engine is configured with underneath Feather."""
ENV_ENABLE = "FEATHER_SGLANG"
ENV_OPTIONS = "FEATHER_SGLANG_OPTIONS"

WAITING = RequestState.WAITING
RUNNING = RequestState.RUNNING


def feather_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``FEATHER_SGLANG`` selects Feather in this process (and its children)."""
    return environ.get(ENV_ENABLE, "").strip().lower() in ("1", "true", "yes", "on")


def feather_options(environ: Mapping[str, str] = os.environ) -> FeatherConfig:
    """Feather's options: ``FEATHER_SGLANG_OPTIONS`` (JSON) over ``FEATHER_*`` variables."""
    raw = environ.get(ENV_OPTIONS)
    options = None
    if raw:
        try:
            options = json.loads(raw)
        except json.JSONDecodeError as error:
            raise FeatherConfigError(f"{ENV_OPTIONS}: not JSON: {error}") from None
        if not isinstance(options, dict):
            raise FeatherConfigError(f"{ENV_OPTIONS}: expected a JSON object")
    return FeatherConfig.from_sources(options, environ)


@dataclass
class _Tracked:
    keys: list
    arrival_s: float
    order: int


class FeatherSGLang:
    """One SGLang scheduler's ``FeatherQueue`` of ``Req`` objects, keyed by ``req.rid``.

    Every request SGLang still holds (waiting, running, or parked for the round) has an
    entry in ``_tracked``; after ``sync`` exactly those requests are in the tree.
    """

    def __init__(self, config: FeatherConfig | None = None, queue: FeatherQueue | None = None):
        self.config = config if config is not None else FeatherConfig()
        self.queue = queue if queue is not None else self.config.make_queue()
        self.stats = SchedulerStats(scheduler="FeatherSGLang")
        self._tracked: dict[str, _Tracked] = {}
        self._order = 0
        self._bound: list[Req] | None = None
        self._cursor = 0
        self.adder_class: type[FeatherPrefillAdder] = type(
            "BoundFeatherPrefillAdder", (FeatherPrefillAdder,), {"feather": self}
        )
        """``PrefillAdder`` subclass that consults this queue (what the scheduler builds)."""

    # ---- requests in and out ----------------------------------------------------------

    def chunk_keys(self, req: Req) -> list:
        return token_chunk_keys(req.origin_input_ids, self.config.chunk_tokens)

    def enter_waiting(self, req: Req) -> None:
        """A request (new, retracted, preempted or parked) is in SGLang's waiting queue."""
        rid = req.rid
        queue = self.queue
        if rid not in queue:
            tracked = self._tracked.get(rid)
            if tracked is None:
                self._order += 1
                tracked = _Tracked(self.chunk_keys(req), queue.clock(), self._order)
                self._tracked[rid] = tracked
            queue.add(rid, tracked.keys, req, tracked.arrival_s)
        elif queue.tree.state(rid) is RUNNING:
            queue.requeue(rid)

    def forget(self, rid: str) -> None:
        """Drop a request in any state (finished, aborted); a no-op if unknown."""
        if rid in self.queue:
            self.queue.remove(rid)
        self._tracked.pop(rid, None)

    def is_waiting(self, rid: str) -> bool:
        return rid in self.queue and self.queue.tree.state(rid) is WAITING

    def sync(self, waiting: Iterable[Req], running: Iterable[Req] | None) -> None:
        """Reconcile the tree with SGLang's queues at the start of a scheduling round.

        Every waiting request is (re)entered: new ones are added, retracted or preempted
        ones requeued, parked ones restored.  A tree request in neither ``waiting`` nor
        ``running`` has left SGLang (finished, aborted) and is forgotten.  With
        ``running`` None only the waiting side is reconciled.
        """
        waiting_ids = set()
        for req in waiting:
            waiting_ids.add(req.rid)
            self.enter_waiting(req)
        queue = self.queue
        gone = [rid for rid in queue if rid not in waiting_ids]
        if running is not None:
            running_ids = {req.rid for req in running if not req.finished()}
            gone += [
                rid for rid in queue.tree.running_ids()
                if rid not in running_ids and rid not in waiting_ids
            ]
        for rid in gone:
            self.forget(rid)
        for rid in [rid for rid in self._tracked if rid not in queue]:
            del self._tracked[rid]

    # ---- ordering ---------------------------------------------------------------------

    def order(self, waiting: list[Req]) -> None:
        """Sort ``waiting`` in place as the tree ranks it and remember it for this round."""
        self._bound, self._cursor = waiting, 0
        queue = self.queue
        if not len(queue):
            return
        first = queue.peek()
        tree, tracked = queue.tree, self._tracked

        def rank(req: Req) -> tuple[int, int, int]:
            rid = req.rid
            if rid == first:
                return (0, 0, 0)
            if rid not in queue or tree.state(rid) is not WAITING:
                return (2, 0, 0)
            return (1, tree.missing_chunks(rid), tracked[rid].order)

        waiting.sort(key=rank)

    def admitted(self, req: Req) -> None:
        """SGLang admitted ``req`` (the tree's candidate): pop it, bring up the next best."""
        queue = self.queue
        queue.pop()
        bound = self._bound
        if bound is None or not len(queue):
            return
        try:
            position = bound.index(req, self._cursor)
        except ValueError:
            return
        self._cursor = position + 1
        following = queue.payload(queue.peek())
        try:
            found = bound.index(following, position + 1)
        except ValueError:
            return
        if found != position + 1:
            bound.insert(position + 1, bound.pop(found))

    def skip_to(self, req: Req) -> None:
        """Park the candidates ahead of ``req`` that SGLang passed over in this round."""
        queue = self.queue
        while (candidate := queue.peek()) != req.rid:
            queue.remove(candidate)  # _tracked keeps it; sync restores it next round

    # ---- steps ------------------------------------------------------------------------

    def new_step(self) -> None:
        self.queue.new_step()

    def record_step(self, batch_size: int, seconds: float) -> None:
        self.queue.record_step(batch_size, seconds)
        if self.stats.record_step(batch_size, seconds):
            self.write_state()

    def write_state(self) -> None:
        self.config.persist(self.stats, self.queue)


class FeatherSchedulePolicy(SchedulePolicy):
    """SGLang's ``fcfs`` policy with the waiting queue ordered by the Chunked Hash Tree."""

    def __init__(
        self,
        feather: FeatherSGLang,
        tree_cache: Any,
        enable_hierarchical_cache: bool = False,
        enable_priority_scheduling: bool = False,
        schedule_low_priority_values_first: bool = False,
        chunked_req: Callable[[], Req | None] = lambda: None,
    ):
        super().__init__(
            BASE_POLICY,
            tree_cache,
            enable_hierarchical_cache,
            enable_priority_scheduling,
            schedule_low_priority_values_first,
        )
        self.feather = feather
        self.chunked_req = chunked_req
        """The scheduler's request between prefill chunks (running, in no batch)."""

    def calc_priority(
        self,
        waiting_queue: list[Req],
        running_batch: ScheduleBatch | None = None,
        processed_tokens: int = 0,
    ) -> None:
        started = time.perf_counter()
        super().calc_priority(waiting_queue, running_batch, processed_tokens)
        running = None
        if running_batch is not None:
            running = list(running_batch.reqs)
            chunked = self.chunked_req()
            if chunked is not None:
                running.append(chunked)
        feather = self.feather
        feather.sync(waiting_queue, running)
        feather.new_step()
        feather.order(waiting_queue)
        feather.stats.schedule_calls += 1
        feather.stats.schedule_s += time.perf_counter() - started


class FeatherPrefillAdder(PrefillAdder):
    """SGLang's ``PrefillAdder`` that stops admitting when the Feather gate says STOP."""

    feather: FeatherSGLang
    """Set on the per-scheduler subclass (``FeatherSGLang.adder_class``)."""

    def add_one_req(self, req: Req, has_chunked_req: bool, truncation_align_size: int | None):
        feather = self.feather
        if not feather.is_waiting(req.rid):
            return super().add_one_req(req, has_chunked_req, truncation_align_size)
        feather.skip_to(req)
        if not feather.queue.may_admit():
            return AddReqResult.OTHER
        result = super().add_one_req(req, has_chunked_req, truncation_align_size)
        if self.can_run_list and self.can_run_list[-1] is req:
            feather.admitted(req)
        return result


# ---- scheduler hooks (applied by SGLang's HookRegistry) ------------------------------

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"


def _hook_init_schedule_policy(original: Callable, scheduler: Any, *args: Any, **kwargs: Any):
    result = original(scheduler, *args, **kwargs)
    scheduler.feather = None
    if not feather_enabled():
        return result
    reason = _unsupported(scheduler)
    if reason:
        logger.warning("Feather is off in this scheduler: %s", reason)
        return result
    feather = FeatherSGLang(feather_options())
    scheduler.feather = feather
    scheduler.policy = FeatherSchedulePolicy(
        feather,
        scheduler.tree_cache,
        scheduler.enable_hierarchical_cache,
        scheduler.enable_priority_scheduling,
        scheduler.schedule_low_priority_values_first,
        chunked_req=lambda: scheduler.chunked_req,
    )
    logger.info("Feather scheduling policy: %s", feather.config)
    return result


def _hook_get_prefill_adder_class(original: Callable, scheduler: Any, *args: Any, **kwargs: Any):
    feather = getattr(scheduler, "feather", None)
    if feather is None:
        return original(scheduler, *args, **kwargs)
    return feather.adder_class


def _hook_add_request_to_queue(original: Callable, scheduler: Any, req: Any, *args: Any,
                               **kwargs: Any):
    result = original(scheduler, req, *args, **kwargs)
    feather = getattr(scheduler, "feather", None)
    if feather is not None:
        waiting = scheduler.waiting_queue
        if waiting and waiting[-1] is req:
            feather.enter_waiting(req)
    return result


def _hook_process_batch_result(original: Callable, scheduler: Any, batch: Any, *args: Any,
                               **kwargs: Any):
    feather = getattr(scheduler, "feather", None)
    if feather is None:
        return original(scheduler, batch, *args, **kwargs)
    launched = getattr(batch, "launch_ts", None)
    seconds = time.monotonic() - launched if launched is not None else None
    result = original(scheduler, batch, *args, **kwargs)
    for req in batch.reqs:
        if req.finished():
            feather.forget(req.rid)
    if seconds is not None and seconds > 0:
        feather.record_step(batch.batch_size(), seconds)
    return result


HOOKS: dict[str, Callable] = {
    f"{_SCHEDULER}.init_schedule_policy": _hook_init_schedule_policy,
    f"{_SCHEDULER}.get_prefill_adder_class": _hook_get_prefill_adder_class,
    f"{_SCHEDULER}._add_request_to_queue": _hook_add_request_to_queue,
    f"{_SCHEDULER}.process_batch_result": _hook_process_batch_result,
}
"""Hook target -> AROUND hook; each is inert on a scheduler without ``feather``."""

_registered = False


def register() -> None:
    """Register Feather's scheduler hooks with SGLang (idempotent; a general plugin).

    They take effect when SGLang's ``load_plugins()`` applies its ``HookRegistry``, as every
    scheduler process does first thing.
    """
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource(plugin_name="feather", dist_name="feather-sched")
    for target, hook in HOOKS.items():
        HookRegistry.register(target, hook, HookType.AROUND, source=source)
    _registered = True


def _unsupported(scheduler: Any) -> str | None:
    """Why Feather cannot drive this scheduler, or None."""
    from sglang.srt.runtime_context import get_disagg, get_parallel

    mode = getattr(get_disagg(), "disaggregation_mode", "null")
    if mode not in (None, "null"):
        return f"PD disaggregation ({mode}) schedules through its own queues"
    if getattr(scheduler, "dllm_config", None) is not None:
        return "diffusion LLM scheduling builds its own PrefillAdder"
    if getattr(get_parallel(), "pp_size", 1) > 1:
        return "pipeline parallelism schedules per micro-batch"
    return None
