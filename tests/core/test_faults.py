"""``FaultGuard``'s pass state: ``serves``, the one answer to "does Feather serve this
call", opened with each pass, left at a fault, never reopened once Feather is off."""

from __future__ import annotations

from feather_sched.core.faults import FaultGuard
from feather_sched.telemetry.stats import StepMeter


def guard(limit: int = 3) -> tuple[FaultGuard, list[str]]:
    fell_back: list[str] = []
    return FaultGuard("test", limit, StepMeter("test"), on_fault=fell_back.append), fell_back


def test_a_fault_leaves_the_pass_to_the_engine_and_the_next_pass_is_feathers(
        contained_faults) -> None:
    faults, fell_back = guard()
    assert faults.serves  # between passes before the first: Feather's picture is whole
    assert faults.open_pass() and faults.serves
    assert faults.call("decide", lambda: {}["missing"], default="engine's") == "engine's"
    assert not faults.serves and faults.dirty and fell_back == ["decide"]
    assert faults.attempt("admit", lambda: None)  # calls are still contained, and run
    assert not faults.serves  # until the next pass opens
    assert faults.open_pass() and faults.serves and faults.active


def test_a_fault_in_the_rebuild_leaves_that_pass_too(contained_faults) -> None:
    faults, fell_back = guard()
    faults.fault("decide", RuntimeError("decide"))
    assert faults.open_pass()  # the adapter rebuilds inside the pass it opened
    assert not faults.attempt("begin_pass", _raise)
    assert not faults.serves and fell_back == ["decide", "begin_pass"]


def test_once_feather_is_off_no_pass_opens(contained_faults) -> None:
    faults, fell_back = guard(limit=2)
    for _ in range(2):
        faults.open_pass()
        faults.fault("decide", RuntimeError("decide"))
    assert not faults.active and not faults.serves
    assert not faults.open_pass() and not faults.serves
    assert fell_back == ["decide", "decide"]


def _raise() -> None:
    raise RuntimeError("rebuild")
