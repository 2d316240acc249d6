"""The attention backends Feather's plug-ins name in vLLM's registry, resolved so that
vLLM's backend resolution cannot fail because of Feather.

vLLM loads the plug-ins in every process before any configuration exists, so its registry
names these classes in every engine, whether or not it chose Feather, and resolves one by
``importlib`` at engine start.  Each name here is resolved on first access (PEP 562): to
Feather's subclass where its module imports, else, with one warning, to vLLM's own class,
so an import error anywhere in Feather (its core, numpy, a vLLM name a point release
moved) leaves the engine on vLLM's backend instead of failing it.  This module imports
nothing but the standard library.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger("vllm.feather_sched")

SUBCLASSES = {
    "SharedPrefixCPUBackend": ("feather_sched.integrations.vllm.attention",
                               "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"),
    "SharedPrefixFlashBackend": ("feather_sched.integrations.vllm.attention_gpu",
                                 "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"),
    "SharedPrefixTritonBackend": ("feather_sched.integrations.vllm.attention_gpu",
                                  "vllm.v1.attention.backends.triton_attn."
                                  "TritonAttentionBackend"),
}
"""Each name vLLM may resolve here: Feather's module that defines it, and vLLM's class it
extends (the fallback)."""

_resolved: dict[str, type] = {}


def path(name: str) -> str:
    """The dotted path the registry holds for backend class ``name``."""
    return f"{__name__}.{name}"


def __getattr__(name: str) -> type:
    if name not in SUBCLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _resolved:
        _resolved[name] = resolve(name)
    return _resolved[name]


def resolve(name: str) -> type:
    """Feather's class ``name``, or vLLM's (one warning) where Feather's does not import."""
    module, engines = SUBCLASSES[name]
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as error:  # never fail vLLM's resolution
        logger.warning("Feather's %s did not import (%s: %s): vLLM's %s serves instead",
                       name, type(error).__name__, error, engines.rsplit(".", 1)[1])
    owner, cls = engines.rsplit(".", 1)
    return getattr(importlib.import_module(owner), cls)
