"""vLLM's own waiting queues for the simulator: first come, first served (the default),
and its priority policy.

Sim policies drive the same contract as ``FeatherRuntime`` (``enter_waiting``,
``discard``, ``begin_pass``, ``decide``, ``admit``, ``end_pass``, ``end_step``), so the
simulated engine has one code path for every scheduler.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from feather_sched.gates.base import BatchLayout, Decision

if TYPE_CHECKING:
    from feather_sched.sim.engine import SimRequest
    from feather_sched.telemetry.steplog import BatchEntry


class Offer(NamedTuple):
    """A baseline's answer: always ADD its head request."""

    request_id: Hashable
    decision: Decision = Decision.ADD


class FcfsPolicy:
    """Arrival order; a preempted request goes back to the head (vLLM's ``prepend``)."""

    name = "fcfs"
    layout = BatchLayout.ENGINE

    def __init__(self) -> None:
        self._queue: deque[SimRequest] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def enter_waiting(self, request: SimRequest) -> None:
        if request.preemptions:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)

    def discard(self, request_id: Hashable) -> bool:
        """Finished requests are not waiting: nothing to forget."""
        return False

    def begin_pass(self, running: Sequence[SimRequest]) -> list[SimRequest]:
        return list(running)

    def preemption_victim(self, running: Sequence[SimRequest]) -> SimRequest:
        """vLLM's FCFS rule: the end of the running list (the latest admitted)."""
        return running[-1]

    def decide(self) -> Offer | None:
        return Offer(self._head().request_id) if len(self) else None

    def admit(self, request: SimRequest) -> None:
        head = self._pop()
        if head is not request:
            raise RuntimeError(f"admitted {request.request_id!r}, not the head "
                               f"{head.request_id!r}")

    def end_pass(self, step: Hashable, running: Sequence[SimRequest]) -> None:
        pass

    def end_step(self, step: Hashable, batch_size: int, seconds: float,
                 batch: Sequence[BatchEntry] | None = None) -> None:
        pass

    def _head(self) -> SimRequest:
        return self._queue[0]

    def _pop(self) -> SimRequest:
        return self._queue.popleft()


def priority_order(request: SimRequest) -> tuple[int, float, int]:
    """vLLM's order under its priority policy: (priority, arrival time), ties by position
    in the workload."""
    return request.spec.priority, request.spec.arrival_s, request.index


class PriorityPolicy(FcfsPolicy):
    """vLLM's priority policy (``scheduling_policy="priority"``): the waiting queue is a
    heap on (priority, arrival), a preempted request re-enters it by the same key, and
    the victim of preemption is ``max(running, key=(priority, arrival))``.  O(log n) a
    call, O(running) a preemption."""

    name = "priority"

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[float, float, int], SimRequest]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def enter_waiting(self, request: SimRequest) -> None:
        heapq.heappush(self._heap, (priority_order(request), request))

    def preemption_victim(self, running: Sequence[SimRequest]) -> SimRequest:
        return max(running, key=priority_order)

    def _head(self) -> SimRequest:
        return self._heap[0][1]

    def _pop(self) -> SimRequest:
        return heapq.heappop(self._heap)[1]
