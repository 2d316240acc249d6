"""Feather's three vLLM general plug-ins (entry points ``vllm.general_plugins``), written
to be good citizens: vLLM loads them in every process of an environment where this
package is installed, whether or not an engine chose Feather, before any configuration
exists, and does not catch what a plug-in's ``register()`` raises.  So each entry point:

* never raises: any error logs one warning naming what it did not find, and registers
  nothing (each registers all or nothing);
* registers nothing in a vLLM outside the releases this package supports
  (``compat.SUPPORTED``; one warning per process), nor where a configuration is current
  and did not choose Feather (``choice.feather_chosen``);
* imports no backend or model runner, parses no option, logs nothing above DEBUG: it
  names Feather's classes in ``backends``, resolved only under an engine's configuration
  (to vLLM's own class where Feather's does not import), behaving as vLLM's where the
  engine did not choose Feather.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType

from feather_sched.integrations.vllm import backends, compat

logger = logging.getLogger("vllm.feather_sched")

CPU_BACKENDS = {"CPU_ATTN": backends.path("SharedPrefixCPUBackend")}
"""vLLM's CPU backend Feather extends, and the dotted path of its subclass (``backends``:
vLLM's own class where Feather's does not import)."""

GPU_BACKENDS = {"FLASH_ATTN": backends.path("SharedPrefixFlashBackend"),
                "TRITON_ATTN": backends.path("SharedPrefixTritonBackend")}
"""vLLM's GPU backends Feather extends, and the dotted path of its subclass of each."""


def entry_point(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Make ``register`` a plug-in vLLM can call in any process: it runs only in a
    supported vLLM whose current configuration (if any) chose Feather, and any error it
    raises becomes one warning, with nothing registered."""
    def wrap(register: Callable[[], None]) -> Callable[[], None]:
        @functools.wraps(register)
        def guarded() -> None:
            try:
                if _supported_here() and _may_choose_feather():
                    register()
            except Exception as error:  # never raise into vLLM
                logger.warning("Feather's vLLM plug-in %s registered nothing: %s: %s",
                               name, type(error).__name__, error)
        return guarded
    return wrap


def _supported_here() -> bool:
    """Whether this vLLM is a release Feather supports (warned once per process if not)."""
    return compat.in_range("its plug-ins register nothing")


def _may_choose_feather() -> bool:
    """False only where a vLLM configuration is current and did not choose Feather (at
    plug-in load there is usually none: the decision then falls to Feather's classes, and
    nothing of Feather's core is imported here)."""
    config = compat.current_config()
    if config is None:
        return True
    from feather_sched.integrations.vllm.choice import feather_chosen

    return feather_chosen(config)


@entry_point("feather_batch_order")
def register_batch_order() -> None:
    """Where the V1 model runner exists (0.32, 0.33), wrap its batch-reorder hook when
    vLLM imports it (``batch_order``); under Model Runner V2 the running list's order is
    the batch's, so there is nothing to do."""
    if not compat.has_v1_runner():
        return
    import wrapt

    wrapt.register_post_import_hook(_install_batch_order, compat.V1_RUNNER)


def _install_batch_order(runner_module: ModuleType) -> None:
    """The hook, run inside vLLM's import of the V1 runner: it must not raise there."""
    try:
        from feather_sched.integrations.vllm import batch_order

        batch_order.install(runner_module)
    except Exception as error:  # never raise into vLLM's import
        logger.warning("Feather's batch order not installed: %s: %s",
                       type(error).__name__, error)


@entry_point("feather_attention")
def register_attention() -> None:
    """On a CPU platform, make vLLM's ``CPU_ATTN`` resolve to Feather's subclass."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        register_backends(CPU_BACKENDS)


@entry_point("feather_attention_gpu")
def register_attention_gpu() -> None:
    """On CUDA, make vLLM's ``FLASH_ATTN`` and ``TRITON_ATTN`` resolve to Feather's
    subclasses."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        register_backends(GPU_BACKENDS)


def register_backends(paths: dict[str, str]) -> list[str]:
    """Point each named member of vLLM's backend registry at its path, leaving alone (at
    DEBUG) a member another plug-in already overrides; the names registered.  Members are
    looked up before any is registered, so a missing one registers none."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    members = {name: AttentionBackendEnum[name] for name in paths}
    done = []
    for name, member in members.items():
        if member.is_overridden() and member.get_path() != paths[name]:
            logger.debug("Feather's %s not registered: another plug-in selects %s", name,
                         member.get_path())
            continue
        register_backend(member, paths[name])
        done.append(name)
    return done
