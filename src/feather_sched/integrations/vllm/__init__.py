"""Feather in vLLM 0.32-0.34: ``scheduler`` (the schedulers: ``FeatherScheduler``, its sync
variant and the instrumented baselines), ``plugins`` (the three entry points vLLM loads
in every process), ``compat`` (every difference between the releases), ``choice``
(whether an engine chose Feather), ``batch_order`` (the worker-side batch layout),
``attention`` and ``attention_gpu`` (the shared-prefix attention backends),
``attention_check`` (the self-check's subject on vLLM's CPU kernel), ``block_hash``
and ``kv_events`` (vLLM's block hashes and KV events, for the router), ``tenants`` (the
server middleware that names each request's tenant).

The public path ``feather_sched.integrations.vllm.FeatherScheduler`` (vLLM's
``--scheduler-cls``) resolves here lazily, so the plug-ins vLLM loads in every process
import no scheduler.
"""

from __future__ import annotations

from typing import Any

SCHEDULERS = ("FeatherScheduler", "FeatherSyncScheduler", "InstrumentedScheduler",
              "InstrumentedSyncScheduler")


def __getattr__(name: str) -> Any:
    if name in SCHEDULERS:
        from feather_sched.integrations.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
