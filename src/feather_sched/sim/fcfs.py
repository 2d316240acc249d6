"""vLLM's default waiting queue for the simulator: first come, first served."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from feather_sched.sim.engine import SimEngine, SimRequest


class FcfsPolicy:
    """Arrival order; a preempted request goes back to the head (vLLM's ``prepend``).

    ``order_running=True`` adds Feather's batch ordering alone, without its admission.
    """

    name = "fcfs"

    def __init__(self, order_running: bool = False) -> None:
        self.order_running = order_running
        self._queue: deque[SimRequest] = deque()

    def add(self, request: SimRequest) -> None:
        self._queue.append(request)

    def peek(self) -> SimRequest | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> SimRequest:
        return self._queue.popleft()

    def requeue(self, request: SimRequest) -> None:
        self._queue.appendleft(request)

    def finish(self, request: SimRequest) -> None:
        pass

    def new_step(self, engine: SimEngine) -> None:
        pass

    def record_step(self, batch_size: int, seconds: float) -> None:
        pass

    def __len__(self) -> int:
        return len(self._queue)
