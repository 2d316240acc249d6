"""The differences between vLLM releases, told by what exists.  Each release's own
scheduler runs these paths in ``test_releases_harness.py``; here, the rules themselves and the
installed release's answers."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from feather_sched.integrations.vllm import compat


def test_the_supported_range_is_the_one_the_package_declares():
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["vllm"] == [f"vllm{compat.SUPPORTED}"]


@pytest.mark.parametrize(("version", "inside"), [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.33.0", True), ("0.34.2", True),
    ("0.35.0", False), ("0.35.0rc1", False), ("0.31.9", False), ("not a version", False)])
def test_supported(version, inside):
    assert compat.supported(version) is inside


def test_the_installed_vllm_answers():
    import vllm

    assert compat.supported(vllm.__version__)
    ops = compat.cpu_ops()
    assert all(hasattr(ops, name) for name in ("cpu_attn_reshape_and_cache",
                                               "cpu_attn_get_scheduler_metadata",
                                               "cpu_attention_with_kv_cache"))
    assert compat.is_quantized_kv_cache("fp8") and not compat.is_quantized_kv_cache("auto")
    assert compat.has_v1_runner() == compat.has_module(compat.V1_RUNNER)
    assert not compat.has_module("vllm.no_such_module.anywhere")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = compat.make_arg_parser()(FlexibleArgumentParser())
    assert parser.parse_args(["--scheduler-cls", "x.Y"]).scheduler_cls == "x.Y"


def scheduler(running_prefills: list[bool], *, bound: bool = False, **cadence) -> SimpleNamespace:
    """The attributes of vLLM's scheduler that its prefill-deferral test reads."""
    return SimpleNamespace(prefill_capacity_bound=bound, **cadence,
                           running=[SimpleNamespace(is_prefill_chunk=p) for p in running_prefills])


def test_prefills_deferred_follows_vllms_test():
    decoding = [False, True]
    assert compat.prefills_deferred(scheduler(decoding), throttle_prefills=True)
    assert not compat.prefills_deferred(scheduler(decoding), throttle_prefills=False)
    assert not compat.prefills_deferred(scheduler(decoding, bound=True), True)
    assert not compat.prefills_deferred(scheduler([True]), True)  # no decode runs
    # vLLM's local cadence (0.33 on): inside the interval since the last prefill step.
    cadence = {"local_prefill_interval": 8, "last_prefill_step": 3}
    assert compat.prefills_deferred(scheduler(decoding, num_executed_steps=5, **cadence), False)
    assert not compat.prefills_deferred(scheduler(decoding, num_executed_steps=10, **cadence),
                                        False)
    assert not compat.prefills_deferred(
        scheduler(decoding, num_executed_steps=5, local_prefill_interval=1,
                  last_prefill_step=5), False)


def test_cache_aware_admission_is_turned_off_once(caplog):
    on = SimpleNamespace(cache_aware_window=16)
    compat.disable_cache_aware_admission(on)
    assert on.cache_aware_window == 0
    compat.disable_cache_aware_admission(SimpleNamespace())  # a release without it
    assert [r.getMessage() for r in caplog.records if r.name == "vllm.feather_sched"] == [
        "Feather orders the waiting queue itself: vLLM's cache-aware admission "
        "(cache_aware_admission_window 16) is off under FeatherScheduler"]


def test_runner_and_previous_step():
    assert compat.uses_v2_runner(SimpleNamespace())  # 0.34: no V1 runner to choose
    assert not compat.uses_v2_runner(SimpleNamespace(use_v2_model_runner=False))
    previous = SimpleNamespace(prev_step_scheduled_req_ids={"a", "b"})
    compat.forget_prev_step(previous, "a")
    assert previous.prev_step_scheduled_req_ids == {"b"}
    compat.forget_prev_step(SimpleNamespace(), "a")  # 0.34 keeps no such set


def test_outside_the_range_one_warning_per_consequence(monkeypatch, caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    compat.in_range.cache_clear()
    try:
        assert not compat.in_range("it does A") and not compat.in_range("it does A")
        assert not compat.in_range("it does B")
    finally:
        compat.in_range.cache_clear()
    assert [r.getMessage() for r in caplog.records if r.name == "vllm.feather_sched"] == [
        "feather-sched supports vLLM >=0.32.0,<0.35, this is vLLM 0.35.0: it does A",
        "feather-sched supports vLLM >=0.32.0,<0.35, this is vLLM 0.35.0: it does B"]
    monkeypatch.undo()
    assert compat.in_range("it does A")


def test_the_installed_version_is_read_without_importing_vllm():
    import vllm

    assert compat.installed_version().split("+")[0] == vllm.__version__.split("+")[0]
