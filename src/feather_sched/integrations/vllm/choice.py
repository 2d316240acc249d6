"""Whether a vLLM engine chose Feather, and the few options its workers read: the first
question every piece of Feather that vLLM loads into its processes asks (plug-ins,
attention builders, the V1 runner's batch order), so that an engine that did not choose
Feather runs exactly as vLLM would.

Cheap and safe by design: it imports nothing of Feather's scheduler (an engine whose
scheduler class is Feather's, or a subclass of it, imported it already), reads only the
option asked for (never the whole configuration, whose files a worker's node may lack),
and any error means "not chosen".  vLLM's configuration objects arrive as arguments.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

from feather_sched.core import FeatherConfig

logger = logging.getLogger("vllm.feather_sched")

_SCHEDULER_MODULE = "feather_sched.integrations.vllm.scheduler"


def feather_mapping(vllm_config: Any) -> Any:
    """The ``"feather"`` entry of ``--additional-config`` (None without one)."""
    additional = vllm_config.additional_config
    return additional.get("feather") if isinstance(additional, dict) else None


def feather_scheduler(vllm_config: Any) -> bool:
    """Whether the engine of ``vllm_config`` runs Feather's scheduler (or a subclass of
    it), read from the configured class or its name: vLLM's own (``None``, ``vllm.…``)
    imports nothing, and no name goes through ``get_scheduler_cls`` (which logs a warning
    for any custom class); False on any error (vLLM's own behaviour)."""
    try:
        scheduler_cls = _scheduler_class(vllm_config.scheduler_config.scheduler_cls)
        # A Feather scheduler class, wherever it is defined, imported Feather's module.
        adapter = sys.modules.get(_SCHEDULER_MODULE)
        return scheduler_cls is not None and adapter is not None and \
            adapter.is_feather_scheduler(scheduler_cls)
    except Exception as error:  # never raise into vLLM's worker
        logger.debug("Feather not chosen: the scheduler class is unreadable (%r)", error)
        return False


def _scheduler_class(named: Any) -> Any:
    """The class ``scheduler_cls`` names, or None for vLLM's own (never imported): a
    name under Feather's package is imported, another only if its module already is."""
    if not isinstance(named, str):
        return named
    if not named or named.startswith("vllm."):
        return None
    module, _, name = named.rpartition(".")
    if not named.startswith("feather_sched.") and module not in sys.modules:
        return None
    return getattr(importlib.import_module(module), name)


def feather_chosen(vllm_config: Any) -> bool:
    """Whether the engine chose Feather at all: its scheduler, or Feather's options in
    ``--additional-config`` (e.g. shared-prefix attention under vLLM's own scheduler).  A
    ``FEATHER_*`` variable alone chooses nothing: it may be left over in the environment
    of a plain ``vllm serve``."""
    try:
        return feather_mapping(vllm_config) is not None or feather_scheduler(vllm_config)
    except Exception as error:  # never raise into vLLM's worker
        logger.debug("Feather not chosen: the configuration is unreadable (%r)", error)
        return False


def worker_option(vllm_config: Any, name: str) -> Any:
    """Feather's option ``name`` for this engine, checked alone (``FeatherConfig.option``:
    ``--additional-config``, then ``FEATHER_*``, then the default); raises
    ``FeatherConfigError`` (a ``ValueError``) for a bad value, which the caller reports
    (only an engine that chose Feather asks)."""
    return FeatherConfig.option(name, feather_mapping(vllm_config))
