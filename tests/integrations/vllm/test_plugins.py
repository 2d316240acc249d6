"""Feather's vLLM plug-ins as vLLM loads them: in every process, before any configuration,
never raising, and changing nothing where the engine did not choose Feather."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import vllm
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from feather_sched.integrations.vllm import compat, plugins
from feather_sched.models import TINY_LLAMA
from tests.helpers.releases import prelude

ENTRY_POINTS = ("feather_batch_order", "feather_attention", "feather_attention_gpu")

# Loads the three entry points as vLLM does (importlib.metadata), in a fresh process, and
# reports what they imported and registered. vLLM's own loading is off (VLLM_PLUGINS) so
# that building the configuration does not load them first.
PROBE = textwrap.dedent("""
    import json, sys
    from importlib.metadata import entry_points
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, load_format="dummy",
                        max_model_len=512, scheduler_cls=sys.argv[2] or None,
                        additional_config={{}}).create_engine_config()
    before = set(sys.modules)
    loaded = [e for e in entry_points(group="vllm.general_plugins")
              if e.name in {names}]
    if sys.argv[3] == "current":
        with set_current_vllm_config(config):
            for entry in loaded:
                entry.load()()
    else:
        for entry in loaded:
            entry.load()()
    imported = sorted(m for m in set(sys.modules) - before
                      if m.startswith(("vllm.v1.attention.backends", "vllm.v1.worker",
                                       "feather_sched.integrations.vllm.")))
    from vllm.v1.attention.backends import registry
    from feather_sched.integrations.vllm import compat
    hooked = None  # no V1 runner (0.34): nothing to hook
    if compat.has_v1_runner():
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        hooked = hasattr(GPUModelRunner._may_reorder_batch, "_feather_batch_order")
    print(json.dumps({{
        "loaded": sorted(e.name for e in loaded),
        "imported": imported,
        "overrides": {{m.name: p for m, p in registry._ATTN_OVERRIDES.items()}},
        "hooked": hooked,
    }}))
""").format(names=set(ENTRY_POINTS))


def hooked(expected: bool) -> bool | None:
    """What the probe reports for the V1 runner's batch-order hook: ``expected`` where the
    release has that runner, None where it has none (0.34: nothing to hook)."""
    return expected if compat.has_v1_runner() else None


def probe(scheduler_cls: str, config: str) -> dict:
    env = {**os.environ, "VLLM_PLUGINS": "none-of-them", "VLLM_TARGET_DEVICE": "cpu"}
    result = subprocess.run([sys.executable, "-c", prelude() + PROBE, str(TINY_LLAMA),
                             scheduler_cls, config], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_where_vllms_scheduler_is_current_the_plugins_change_nothing():
    report = probe("", "current")
    assert report["loaded"] == sorted(ENTRY_POINTS)
    assert [m for m in report["imported"] if m.startswith("vllm.v1.attention.backends")] == []
    assert report["overrides"] == {}
    assert report["hooked"] is hooked(False)


def test_at_plugin_load_they_import_no_backend_and_name_feathers_classes_by_path():
    """As in vLLM's processes, where no configuration is current yet: the CPU backend is
    named by path and the V1 runner's hook waits for its import; no backend, runner or
    Feather scheduler module is imported by the plug-ins themselves."""
    report = probe("feather_sched.integrations.vllm.FeatherScheduler", "none")
    allowed = {"vllm.v1.attention.backends", "vllm.v1.attention.backends.registry",
               "feather_sched.integrations.vllm.plugins",
               "feather_sched.integrations.vllm.compat",
               "feather_sched.integrations.vllm.backends"}
    assert set(report["imported"]) <= allowed, report["imported"]
    assert report["overrides"] == plugins.CPU_BACKENDS
    assert report["hooked"] is hooked(True)


@pytest.fixture
def registry_restored():
    """The CPU backend's override as it was (an engine of this process may have set it)."""
    member = AttentionBackendEnum.CPU_ATTN
    before = member.get_path() if member.is_overridden() else None
    member.clear_override()
    yield member
    member.clear_override()
    if before is not None:
        register_backend(member, before)  # imported before a test removes it


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "vllm.feather_sched" and r.levelno >= logging.WARNING]


def test_a_missing_vllm_internal_is_one_warning_and_nothing_registered(
        registry_restored, monkeypatch, caplog):
    from vllm.v1.attention.backends import registry

    if compat.has_v1_runner():  # imported before the CUDA platform is faked below
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    monkeypatch.delattr(registry, "register_backend")
    plugins.register_attention()
    assert not registry_restored.is_overridden()
    assert warnings_of(caplog) == [
        "Feather's vLLM plug-in feather_attention registered nothing: ImportError: cannot "
        "import name 'register_backend' from 'vllm.v1.attention.backends.registry' "
        f"({registry.__file__})"]

    caplog.clear()
    monkeypatch.setattr(vllm.platforms.current_platform, "is_cuda", lambda: True)
    monkeypatch.delattr(registry, "AttentionBackendEnum")
    plugins.register_attention_gpu()
    assert warnings_of(caplog)[0].startswith(
        "Feather's vLLM plug-in feather_attention_gpu registered nothing: ImportError")

    if not compat.has_v1_runner():  # 0.34: nothing to hook, nothing said
        caplog.clear()
        plugins.register_batch_order()
        assert warnings_of(caplog) == []
        return
    caplog.clear()
    monkeypatch.delattr(GPUModelRunner, "_may_reorder_batch")  # imported: hooked at once
    plugins.register_batch_order()
    assert warnings_of(caplog) == ["Feather's batch order not installed: AttributeError: "
                                   "type object 'GPUModelRunner' has no attribute "
                                   "'_may_reorder_batch'"]


def test_a_vllm_outside_the_supported_range_gets_a_warning_and_no_registration(
        registry_restored, monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    compat.in_range.cache_clear()
    try:
        plugins.register_attention()
        plugins.register_attention_gpu()
    finally:
        compat.in_range.cache_clear()
    assert not registry_restored.is_overridden()
    assert warnings_of(caplog) == ["feather-sched supports vLLM >=0.32.0,<0.35, this is "
                                   "vLLM 0.35.0: its plug-ins register nothing"]  # once
    monkeypatch.undo()
    plugins.register_attention()  # this vLLM, again
    assert registry_restored.get_path() == plugins.CPU_BACKENDS["CPU_ATTN"]
