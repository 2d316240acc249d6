"""Whether an engine chose Feather, read from its configuration without importing or
logging anything on vLLM's behalf."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from feather_sched.integrations.vllm.choice import feather_chosen, feather_scheduler
from feather_sched.integrations.vllm.scheduler import FeatherScheduler


def config(scheduler_cls, additional=None) -> SimpleNamespace:
    def resolved_by_vllm():
        raise AssertionError("get_scheduler_cls logs a warning for a custom class")

    return SimpleNamespace(additional_config=additional, scheduler_config=SimpleNamespace(
        scheduler_cls=scheduler_cls, get_scheduler_cls=resolved_by_vllm))


@pytest.mark.parametrize(("scheduler_cls", "chosen"), [
    (None, False), ("vllm.v1.core.sched.scheduler.Scheduler", False),
    ("feather_sched.integrations.vllm.FeatherScheduler", True),
    ("feather_sched.integrations.vllm.scheduler.FeatherSyncScheduler", True),
    ("feather_sched.integrations.vllm.scheduler.InstrumentedScheduler", False),
    (FeatherScheduler, True), (object, False)])
def test_the_scheduler_is_read_from_the_class_or_its_name(scheduler_cls, chosen):
    assert feather_scheduler(config(scheduler_cls)) is chosen
    assert feather_chosen(config(scheduler_cls)) is chosen


def test_a_custom_scheduler_not_yet_imported_is_not_imported_to_decide():
    name = "tests.integrations.vllm.no_such_scheduler_module.Custom"
    assert feather_scheduler(config(name)) is False
    assert "tests.integrations.vllm.no_such_scheduler_module" not in sys.modules
    here = f"{__name__}.FeatherScheduler"  # a module already imported: read, not imported
    assert feather_scheduler(config(here)) is True


def test_feathers_options_choose_it_under_any_scheduler():
    assert feather_chosen(config(None, {"feather": {}}))
    assert not feather_chosen(config(None, {"other": {}}))
