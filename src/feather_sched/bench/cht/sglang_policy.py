"""Time SGLang's own scheduling decision over a waiting queue (``lpm`` / ``dfs-weight``).

``feather cht-bench`` compares the cost of one scheduling decision across structures; this
module measures the real thing rather than a re-implementation: SGLang's
``RadixCache.create_simulated()`` as the engine's prefix cache and
``SchedulePolicy.calc_priority`` over real ``Req`` objects.  SGLang turns LPM off above
``WAITING_QUEUE_PREFIX_MATCH_MAX`` (128) waiting requests; the measurement lifts that cap
for its own duration so large queues still pay for prefix matching and sorting.

SGLang is imported lazily, so this module imports without it.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

POLICIES = ("lpm", "dfs-weight")
"""The cache-aware SGLang policies this module times."""

_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class PolicyTiming:
    """Cost of SGLang's cache insert and of one scheduling decision under ``policy``."""

    policy: str
    insert_us_per_request: float
    decision_ms: float


def sglang_installed() -> bool:
    """Whether SGLang is installed; an installed SGLang that does not import is an error
    its callers see, never a silent skip."""
    return importlib.util.find_spec("sglang") is not None


@contextmanager
def lifted_prefix_match_cap() -> Iterator[None]:
    """Lift SGLang's 128-request LPM fallback to FCFS; restore the old cap on exit."""
    policy_module = _import_sglang().schedule_policy
    saved = policy_module.WAITING_QUEUE_PREFIX_MATCH_MAX
    policy_module.WAITING_QUEUE_PREFIX_MATCH_MAX = sys.maxsize
    try:
        yield
    finally:
        policy_module.WAITING_QUEUE_PREFIX_MATCH_MAX = saved


@contextmanager
def published_server_args() -> Iterator[None]:
    """Ensure a process-wide SGLang config exists (CPU device) while inside.

    ``calc_priority`` reads it on its cache-agnostic paths (``get_disagg()``, and
    ``get_memory()`` when touching waiting prefixes).  A config already published by a
    running engine is left alone; otherwise a scoped dummy one is installed and removed.
    """
    get_context = _import_sglang().get_context
    if get_context().is_config_namespace_published("disagg"):
        yield
        return
    with get_context().override_server_args(device="cpu"):
        yield


def time_sglang_policy(
    policy: str,
    waiting_prompts: list[np.ndarray],
    running_prompts: list[np.ndarray],
    *,
    repeats: int = 3,
    observe: Callable[[list[int]], None] | None = None,
) -> PolicyTiming:
    """Time SGLang's RadixCache inserts and its ``calc_priority`` over a waiting queue.

    The running prompts are inserted into a simulated ``RadixCache`` first (what the
    engine has cached); ``insert_us_per_request`` is the mean insert time.  Then a queue
    of ``Req`` objects is built from ``waiting_prompts`` and ``calc_priority`` is timed
    ``repeats`` times, the queue put back in its original order before each call (it sorts
    in place); ``decision_ms`` is the median.  ``observe``, if given, receives after each
    call (outside the timed region) the waiting-prompt indices in decided order.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sg = _import_sglang()
    cache = sg.RadixCache.create_simulated()
    insert_us = _time_inserts(sg, cache, running_prompts)
    queue = _build_queue(sg, waiting_prompts)
    scheduler = sg.SchedulePolicy(policy, cache, False, False, False)
    with published_server_args(), lifted_prefix_match_cap():
        times_s = [_time_decision(scheduler, queue, observe) for _ in range(repeats)]
    return PolicyTiming(policy, insert_us, statistics.median(times_s) * 1e3)


def _import_sglang() -> SimpleNamespace:
    """SGLang's scheduler pieces this module uses, imported on first need."""
    prepare_sglang_import()
    from sglang.srt.managers import schedule_policy
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.runtime_context import get_context
    from sglang.srt.sampling.sampling_params import SamplingParams

    return SimpleNamespace(
        schedule_policy=schedule_policy,
        SchedulePolicy=schedule_policy.SchedulePolicy,
        Req=Req,
        InsertParams=InsertParams,
        RadixCache=RadixCache,
        RadixKey=RadixKey,
        get_context=get_context,
        SamplingParams=SamplingParams,
    )


def _token_array(prompt: np.ndarray) -> Any:
    """A prompt as SGLang holds token ids: ``array('q')`` (see TokenizerManager)."""
    from array import array

    return array("q", np.asarray(prompt, dtype=np.int64).tolist())


def _time_inserts(sg: SimpleNamespace, cache: Any, prompts: Sequence[np.ndarray]) -> float:
    """Insert ``prompts`` into ``cache``; mean microseconds per insert (NaN if none).

    Keys and KV-slot values are built beforehand, so only the tree insert is timed.
    """
    import torch

    params, start = [], 0
    for prompt in prompts:
        key = sg.RadixKey(token_ids=_token_array(prompt))
        slots = torch.arange(start, start + len(key), dtype=torch.int64)
        params.append(sg.InsertParams(key=key, value=slots))
        start += len(key)
    if not params:
        return float("nan")
    with _gc_paused():
        began = time.perf_counter()
        for param in params:
            cache.insert(param)
        elapsed = time.perf_counter() - began
    return elapsed / len(params) * 1e6


def _build_queue(sg: SimpleNamespace, prompts: Sequence[np.ndarray]) -> list[Any]:
    """Real ``Req`` objects for the waiting prompts; ``rid`` is the prompt's index."""
    return [
        sg.Req(
            str(index),
            "",
            _token_array(prompt),
            sg.SamplingParams(max_new_tokens=_MAX_NEW_TOKENS),
        )
        for index, prompt in enumerate(prompts)
    ]


def _time_decision(
    scheduler: Any, original: list[Any], observe: Callable[[list[int]], None] | None
) -> float:
    """Seconds one ``calc_priority`` call takes on a fresh copy of ``original``."""
    queue = list(original)
    with _gc_paused():
        began = time.perf_counter()
        scheduler.calc_priority(queue)
        elapsed = time.perf_counter() - began
    if observe is not None:
        observe([int(req.rid) for req in queue])
    return elapsed


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Keep the cyclic collector out of a timed region (as ``timeit`` does)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
