"""Timing as the engine runs, with a fake GPU: each path captured once and its replays
timed by events; the host cost of eager calls measured on its own; and the verdict both
ways from those figures (faster in graphs and worth its launches; or not)."""

from __future__ import annotations

import pytest
import torch

from feather_sched.attention import selfcheck
from feather_sched.attention.selfcheck import Cell, Shapes
from feather_sched.attention.timing import GraphTimer


class FakeDevice:
    """A GPU clock: a replay advances it by the captured call's device cost; an eager
    call costs its host time on the host clock."""

    def __init__(self) -> None:
        self.device_now = self.host_now = 0.0
        self.captured, self.replays, self.eager = [], 0, 0

    def graph(self) -> FakeGraph:
        return FakeGraph(self)

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def capture(self, graph: FakeGraph, run) -> None:
        self.captured.append(run)
        graph.run = run


class FakeGraph:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.run = device, None

    def replay(self) -> None:
        self.device.replays += 1
        self.device.device_now += self.run.device_s  # no host cost: launched at capture


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.at = device, None

    def record(self) -> None:
        self.at = self.device.device_now

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1e3 * (end.at - self.at)


def timer(device: FakeDevice) -> GraphTimer:
    return GraphTimer(lambda: None, graph=device.graph, event=device.event,
                      capture=device.capture, clock=lambda: device.host_now)


def call(device: FakeDevice, device_s: float, host_s: float):
    def run() -> None:
        device.eager += 1
        device.host_now += host_s

    run.device_s = device_s
    return run


def test_a_call_is_captured_once_and_its_replays_timed_by_events() -> None:
    device = FakeDevice()
    run = call(device, device_s=2e-4, host_s=5e-3)
    assert timer(device).seconds(run, reps=5) == pytest.approx(2e-4)  # no host time in it
    assert device.captured == [run] and device.replays == 6  # one untimed, five timed
    assert device.eager == 1  # the warm-up (compiles) before capture
    assert timer(device).host_seconds(run, reps=3) == pytest.approx(5e-3)


SHAPES = Shapes(device="fake GPU", q_heads=4, kv_heads=2, head_dim=16, dtype="float32",
                block_size=16, layout="Triton", max_rows=64, max_context=16384)


class Trial:
    def __init__(self, subject: Subject, cell: Cell) -> None:
        self.cell = cell
        out = torch.ones(cell.rows, 4, 16)
        device = subject.device
        saved = 0 if cell.idle else subject.saved_s
        idle = subject.idle_s if cell.idle else 0
        self.engine = returning(call(device, 1e-3, 20e-6), out, "engine")
        self.shared = returning(call(device, 1e-3 - saved + idle, 20e-6 + subject.launch_s),
                                out, "shared")

    def reference(self) -> None:
        return None


def returning(run, out: torch.Tensor, name: str):
    def wrapped() -> torch.Tensor:
        run()
        return out

    wrapped.device_s, wrapped.__name__ = run.device_s, name
    return wrapped


class Subject:
    """A GPU subject on the fake device: graph replays for speed, eager host cost aside."""

    shapes, idle_cost = SHAPES, True

    def __init__(self, saved_s: float, launch_s: float, idle_s: float = 0.0) -> None:
        self.device = FakeDevice()
        self.saved_s, self.launch_s, self.idle_s = saved_s, launch_s, idle_s
        graph_timer = timer(self.device)
        self.seconds, self.host_seconds = graph_timer.seconds, graph_timer.host_seconds

    def trial(self, cell: Cell, seed: int) -> Trial:
        return Trial(self, cell)


def test_on_where_replays_are_faster_and_the_saving_pays_for_the_launches() -> None:
    verdict = selfcheck.check(Subject(saved_s=5e-4, launch_s=100e-6), reps=3)
    assert verdict.on and verdict.min_shared_tokens == 512, verdict.line()
    timed = [c for c in verdict.cells if c.speedup and not c.cell.idle]
    assert all(c.speedup == pytest.approx(2.0) for c in timed)
    assert "eager launches +100 us on the host" in verdict.line()


def test_off_where_the_eager_launches_cost_more_than_the_replays_save() -> None:
    """2x in graphs, but a step run eagerly pays 600 us of launches for 500 us saved."""
    verdict = selfcheck.check(Subject(saved_s=5e-4, launch_s=600e-6), reps=3)
    assert not verdict.on and "not faster" in verdict.line()
    assert all(c.speedup == pytest.approx(2.0) for c in verdict.cells
               if c.speedup and not c.cell.idle)


def test_the_idle_step_is_timed_as_a_replay_too() -> None:
    """Where nothing groups a FULL replay costs only the empty launches' GPU time: here
    10% of the step, over the idle margin, so off."""
    verdict = selfcheck.check(Subject(saved_s=5e-4, launch_s=0, idle_s=1e-4), reps=3)
    assert not verdict.on and "where nothing groups" in verdict.reason
    fine = selfcheck.check(Subject(saved_s=5e-4, launch_s=0, idle_s=1e-5), reps=3)
    assert fine.on
