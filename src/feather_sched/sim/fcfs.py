"""vLLM's default waiting queue for the simulator: first come, first served.

Sim policies drive the same contract as ``FeatherRuntime`` (``enter_waiting``,
``discard``, ``begin_pass``, ``decide``, ``admit``, ``end_pass``, ``end_step``), so the
simulated engine has one code path for every scheduler.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from feather_sched.gate import Decision

if TYPE_CHECKING:
    from feather_sched.sim.engine import SimRequest
    from feather_sched.steplog import BatchEntry


class Offer(NamedTuple):
    """A baseline's answer: always ADD its head request."""

    request_id: Hashable
    decision: Decision = Decision.ADD


class FcfsPolicy:
    """Arrival order; a preempted request goes back to the head (vLLM's ``prepend``)."""

    name = "fcfs"
    orders_running = False

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
        return Offer(self._queue[0].request_id) if self._queue else None

    def admit(self, request: SimRequest) -> None:
        head = self._queue.popleft()
        if head is not request:
            raise RuntimeError(f"admitted {request.request_id!r}, not the head "
                               f"{head.request_id!r}")

    def end_pass(self, step: Hashable, running: Sequence[SimRequest]) -> None:
        pass

    def end_step(self, step: Hashable, batch_size: int, seconds: float,
                 batch: Sequence[BatchEntry] | None = None) -> None:
        pass
