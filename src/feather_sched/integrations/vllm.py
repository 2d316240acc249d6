"""Feather inside vLLM's V1 engine (pinned: vLLM 0.32.0).

Load with ``--scheduler-cls feather_sched.integrations.vllm.FeatherScheduler`` (server) or
``LLM(..., scheduler_cls=FeatherScheduler)``.  The subclass is thin: vLLM's own
``schedule()`` runs unchanged over a waiting queue that is a ``FeatherQueue``.
vLLM runs ``AsyncScheduler`` when async scheduling is on (its GPU default) and the plain
``Scheduler`` when it is off (always on CPU); ``FeatherScheduler`` builds whichever
variant the engine's mode needs (``FeatherSyncScheduler`` is the synchronous one), and the
logic lives in mixins, so both variants share every line.

* Order: ``peek_request``/``pop_request`` return the Chunked Hash Tree's best candidate;
  chunk keys are the engine's own ``request.block_hashes`` (every k-th chained block
  hash; no re-hashing), or token chunks when prefix caching is off.
* Gate: the admission loop stops when the queue is falsy, so ``__bool__`` answers the
  gate's ADD/STOP while ``__len__`` stays the true count (what vLLM reports).
* Feedback: the time from handing a step to the workers until its output returns, and
  the step's batch size, become the gate's reward.
* Exits: a preempted or skipped request comes back through ``prepend_request(s)`` and is
  requeued in the tree; finished, aborted and stopped requests leave through
  ``remove_requests`` or vLLM's ``_free_request``, whichever comes first, exactly once.

Options: ``--additional-config '{"feather": {"gate": "bandit", ...}}'`` or ``FEATHER_*``
environment variables (see ``feather_sched.config``).
"""

from __future__ import annotations

import csv
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from feather_sched.cht import RequestState, block_chunk_keys, token_chunk_keys
from feather_sched.config import FeatherConfig
from feather_sched.queue import FeatherQueue
from feather_sched.stats import SchedulerStats

logger = logging.getLogger("vllm.feather_sched")
"""Under vLLM's logger, so Feather's lines appear in the engine's own log."""



class FeatherWaitingQueue(RequestQueue):
    """vLLM's ``RequestQueue`` interface over a ``FeatherQueue`` of vLLM requests."""

    def __init__(self, queue: FeatherQueue, config: FeatherConfig, hash_block_size: int):
        self.queue = queue
        self.config = config
        self.hash_block_size = hash_block_size
        self.blocks_per_chunk = config.blocks_per_chunk(hash_block_size)

    def chunk_keys(self, request: Request) -> list:
        """The prompt's chunk keys, from the engine's block hashes when it has them."""
        prompt_blocks = request.num_prompt_tokens // self.hash_block_size
        if request.block_hashes:
            return block_chunk_keys(request.block_hashes[:prompt_blocks], self.blocks_per_chunk)
        if request.prompt_token_ids is None:
            return []
        return token_chunk_keys(request.prompt_token_ids, self.config.chunk_tokens)

    # ---- what vLLM's schedule() and request handling call -----------------------------

    def add_request(self, request: Request) -> None:
        self._enter_waiting(request)

    def pop_request(self) -> Request:
        return self.queue.payload(self.queue.pop())

    def peek_request(self) -> Request:
        return self.queue.payload(self.queue.peek())

    def prepend_request(self, request: Request) -> None:
        """A preempted request, or one the admission loop skipped, comes back."""
        self._enter_waiting(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self._enter_waiting(request)

    def remove_request(self, request: Request) -> None:
        self.forget(request.request_id)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.forget(request.request_id)

    def __bool__(self) -> bool:
        return self.queue.may_admit()

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[Request]:
        return (self.queue.payload(request_id) for request_id in self.queue)

    # ---- lifecycle --------------------------------------------------------------------

    def forget(self, request_id: str) -> None:
        """Drop a request from the tree if it is still there (any exit path, once)."""
        if request_id in self.queue:
            self.queue.remove(request_id)

    def _enter_waiting(self, request: Request) -> None:
        request_id = request.request_id
        if request_id not in self.queue:
            arrival = getattr(request, "arrival_time", None)
            self.queue.add(request_id, self.chunk_keys(request), request, arrival)
        elif self.queue.tree.state(request_id) is RequestState.RUNNING:
            self.queue.requeue(request_id)


def feather_options(vllm_config: Any) -> FeatherConfig:
    """Feather's options from ``--additional-config '{"feather": {...}}'`` or FEATHER_*."""
    additional = vllm_config.additional_config
    options = additional.get("feather") if isinstance(additional, dict) else None
    return FeatherConfig.from_sources(options)


class _Instrumented:
    """Step accounting on top of a vLLM scheduler, which it leaves unchanged.

    It measures the wall time of ``schedule()`` and of each step (from handing it to the
    workers until its output returns) and writes them to the ``stats_file`` option.
    ``feather bench`` runs the FCFS baseline with it, so both sides are measured alike.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.feather_config = feather_options(self.vllm_config)
        self._check_scheduling_mode()
        self.stats = SchedulerStats(scheduler=type(self).__name__)
        self._step_started: dict[int, tuple[float, list]] = {}
        log = self.feather_config.step_log
        self._step_log = StepLog(log, self.block_size) if log else None

    def schedule(self, *args: Any, **kwargs: Any):
        started = time.perf_counter()
        output = super().schedule(*args, **kwargs)
        now = time.perf_counter()
        self.stats.schedule_calls += 1
        self.stats.schedule_s += now - started
        if output.num_scheduled_tokens:
            batch = self._step_log.batch(self, output) if self._step_log else []
            self._step_started[id(output)] = (now, batch)
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        started = self._step_started.pop(id(scheduler_output), None)
        if started is not None:
            seconds = time.perf_counter() - started[0]
            self._on_step(len(scheduler_output.num_scheduled_tokens), seconds)
            if self._step_log:
                self._step_log.write(started[1], seconds)
        return super().update_from_output(scheduler_output, model_runner_output)

    def shutdown(self) -> None:
        self._write_state()
        if self._step_log:
            self._step_log.handle.close()
        super().shutdown()

    def _on_step(self, batch_size: int, seconds: float) -> None:
        if self.stats.record_step(batch_size, seconds):
            self._write_state()

    def _write_state(self) -> None:
        self.feather_config.persist(self.stats)

    def _check_scheduling_mode(self) -> None:
        """Async scheduling needs the AsyncScheduler base, sync mode the plain one."""
        is_async = bool(self.scheduler_config.async_scheduling)
        if is_async != isinstance(self, AsyncScheduler):
            raise ValueError(
                f"{type(self).__name__} does not match async scheduling "
                f"{'on' if is_async else 'off'}: use FeatherScheduler (InstrumentedScheduler) "
                "with async scheduling, FeatherSyncScheduler (InstrumentedSyncScheduler) "
                "without")


class StepLog:
    """Each step's batch composition and measured time, as ``feather calibrate`` reads them.

    Rows follow ``feather_sched.sim.calibrate``: one per scheduled request, in batch
    order (vLLM's running order; by prefix group when Feather orders the batch, as its
    worker plugin does). A request's group is its first KV block hash; its shared tokens
    are its leading prompt blocks that another request of the step also holds.
    """

    COLUMNS = ("step", "position", "group", "shared_tokens", "context_tokens", "new_tokens",
               "seconds")

    def __init__(self, path: str, block_size: int) -> None:
        self.block_size = block_size
        self.step = self._next_step(path)
        self.handle = open(path, "a", newline="")  # noqa: SIM115 - kept for the engine's life
        self.writer = csv.writer(self.handle)
        if self.handle.tell() == 0:
            self.writer.writerow(self.COLUMNS)

    @staticmethod
    def _next_step(path: str) -> int:
        """Continue the step numbers of a log that earlier engines appended to."""
        try:
            with open(path, newline="") as handle:
                steps = [int(row["step"]) for row in csv.DictReader(handle)]
        except FileNotFoundError:
            return 0
        return max(steps, default=-1) + 1

    def batch(self, scheduler: Any, output: Any) -> list[tuple]:
        requests = [r for r in scheduler.running if r.request_id in output.num_scheduled_tokens]
        if isinstance(scheduler, _Feather) and scheduler.feather_config.order_running:
            requests.sort(key=self._group)
        holders = Counter(h for r in requests for h in set(self._prompt_hashes(r)))
        return [(self._group(r), self._shared_tokens(r, holders), r.num_computed_tokens +
                 output.num_scheduled_tokens[r.request_id],
                 output.num_scheduled_tokens[r.request_id]) for r in requests]

    def write(self, batch: list[tuple], seconds: float) -> None:
        for position, (group, shared, context, new) in enumerate(batch):
            self.writer.writerow((self.step, position, group, min(shared, context), context,
                                  new, f"{seconds:.9f}"))
        self.step += 1
        self.handle.flush()

    def _prompt_hashes(self, request: Request) -> list:
        return request.block_hashes[: request.num_prompt_tokens // self.block_size]

    def _group(self, request: Request) -> str:
        hashes = request.block_hashes
        return hashes[0].hex()[:16] if hashes else request.request_id

    def _shared_tokens(self, request: Request, holders: Counter) -> int:
        shared = 0
        for block_hash in self._prompt_hashes(request):
            if holders[block_hash] < 2:
                break
            shared += 1
        return shared * self.block_size


class _Feather:
    """Feather's ordering and ADD/STOP gate at admission (mixed into a vLLM scheduler)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        hash_block_size = kwargs.get("hash_block_size") or self.block_size
        queue = self.feather_config.make_queue(clock=time.time)
        self.feather = FeatherWaitingQueue(queue, self.feather_config, hash_block_size)
        self.waiting = self.feather
        logger.info("Feather scheduler: %s", self.feather_config)

    def schedule(self, *args: Any, **kwargs: Any):
        self.feather.queue.new_step()
        return super().schedule(*args, **kwargs)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any):
        self.feather.forget(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    def _on_step(self, batch_size: int, seconds: float) -> None:
        self.feather.queue.record_step(batch_size, seconds)
        super()._on_step(batch_size, seconds)

    def _write_state(self) -> None:
        self.feather_config.persist(self.stats, self.feather.queue)


def _for_mode(cls: type, sync_cls: type, args: tuple, kwargs: dict) -> Any:
    """An instance of ``cls``, or of its synchronous twin when async scheduling is off."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    if not vllm_config.scheduler_config.async_scheduling:
        return sync_cls(*args, **kwargs)
    return object.__new__(cls)


class InstrumentedSyncScheduler(_Instrumented, Scheduler):
    """vLLM's synchronous scheduler with step accounting only."""


class InstrumentedScheduler(_Instrumented, AsyncScheduler):
    """vLLM's own scheduler with step accounting only: the FCFS baseline of feather bench."""

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is InstrumentedScheduler:
            return _for_mode(cls, InstrumentedSyncScheduler, args, kwargs)
        return object.__new__(cls)


class FeatherSyncScheduler(_Feather, _Instrumented, Scheduler):
    """Feather in vLLM with async scheduling off (always the case on CPU)."""


class FeatherScheduler(_Feather, _Instrumented, AsyncScheduler):
    """Feather in vLLM; builds ``FeatherSyncScheduler`` when async scheduling is off."""

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is FeatherScheduler:
            return _for_mode(cls, FeatherSyncScheduler, args, kwargs)
        return object.__new__(cls)


def is_feather_scheduler(scheduler_cls: type) -> bool:
    """Whether an engine's scheduler class runs Feather (either base)."""
    return isinstance(scheduler_cls, type) and issubclass(scheduler_cls, _Feather)
