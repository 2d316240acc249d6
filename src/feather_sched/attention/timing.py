"""How the self-check times a path: the way the engine will run it.

Where the engine replays CUDA graphs (vLLM's FULL decode graphs), what a step costs is the
GPU time of the replay: Python, argument packing and launch latency are paid once, at
capture. So ``GraphTimer.seconds`` warms the path up (compiles), captures one call in a
CUDA graph and times its replays with CUDA events: the median seconds per replay. Steps
the engine runs eagerly (PIECEWISE graphs for mixed batches: attention between the
captured pieces) pay the host's launch cost as well, measured on its own by
``host_seconds`` (wall time to issue one call, the device drained between calls), so
the verdict can weigh the path's extra launches against the GPU time it saves.

The graph and the events come from factories, so the logic is tested on a CPU with fakes;
on a GPU they are ``torch.cuda.CUDAGraph`` and timing ``torch.cuda.Event``. Engine-
agnostic: torch only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def cuda_graph() -> Any:
    import torch

    return torch.cuda.CUDAGraph()


def cuda_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


def capture_into(graph: Any, run: Callable[[], object]) -> None:
    """Capture one call of ``run`` into ``graph`` (on a side stream, as torch requires)."""
    import torch

    with torch.cuda.graph(graph):
        run()


class GraphTimer:
    """Times a call as a CUDA graph replay (see the module docstring)."""

    def __init__(self, sync: Callable[[], object],
                 graph: Callable[[], Any] = cuda_graph,
                 event: Callable[[], Any] = cuda_event,
                 capture: Callable[[Any, Callable[[], object]], None] = capture_into,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.sync, self.graph, self.event, self.capture = sync, graph, event, capture
        self.clock = clock

    def seconds(self, run: Callable[[], object], reps: int) -> float:
        """Median GPU seconds of one replay of ``run`` captured once, over ``reps``
        replays (after a warm-up call outside the graph and one untimed replay)."""
        run()
        self.sync()
        graph = self.graph()
        self.capture(graph, run)
        graph.replay()
        self.sync()
        times = []
        for _ in range(reps):
            start, end = self.event(), self.event()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # CUDA events count milliseconds
        return statistics.median(times)

    def host_seconds(self, run: Callable[[], object], reps: int) -> float:
        """Median host seconds to issue one eager call of ``run`` (its launches), the
        device drained before each so no call waits on the one before."""
        run()
        self.sync()
        times = []
        for _ in range(reps):
            begun = self.clock()
            run()
            times.append(self.clock() - begun)
            self.sync()
        return statistics.median(times)
