"""FeatherQueue: the Chunked Hash Tree and an ADD/STOP gate behind an engine's waiting queue.

This is the one object every engine adapter wraps.  An admission loop asks
``may_admit()`` (is there a request, and does the gate say ADD?), reads ``peek()``, and
calls ``pop()`` once the engine has room for it.  After a STOP the queue stays closed
until ``new_step`` starts the next scheduling step; ``record_step`` reports an executed
step's measured time, which becomes the gate's reward.

A starvation guard bounds waiting: a request that has waited longer than ``max_wait_s``
is offered ahead of the tree's choice and admitted whatever the gate would say, one such
request per step, so that an overloaded queue (where every request is old) still fills
the rest of each step in the tree's order instead of degrading to FCFS.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from feather_sched.cht import Candidate, ChunkedHashTree, ChunkKey, RequestState
from feather_sched.gate import AlwaysAddGate, Decision, Gate, GateContext

RequestId = Hashable

DEFAULT_MAX_WAIT_S = 30.0
WAITING = RequestState.WAITING


@dataclass(frozen=True)
class Admission:
    """The queue's answer for its current candidate."""

    candidate: Candidate
    decision: Decision
    forced: bool
    """True when the starvation guard overrode the gate."""


@dataclass
class GateCounts:
    """How often the gate was asked and what it said (for reports)."""

    add: int = 0
    stop: int = 0
    forced: int = 0


class FeatherQueue:
    """A waiting queue ordered by shared prefix with the running batch, gated per step."""

    def __init__(
        self,
        gate: Gate | None = None,
        *,
        max_wait_s: float | None = DEFAULT_MAX_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_wait_s is not None and max_wait_s < 0:
            raise ValueError(f"max_wait_s must be non-negative or None, got {max_wait_s}")
        self.tree = ChunkedHashTree()
        self.gate: Gate = gate if gate is not None else AlwaysAddGate()
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.counts = GateCounts()
        self._payloads: dict[RequestId, Any] = {}
        self._arrivals: dict[RequestId, float] = {}
        self._oldest: list[tuple[float, int, RequestId]] = []
        self._sequence = 0
        self._closed = False
        self._forced_this_step = False
        self._admission: Admission | None = None

    # ---- contents ---------------------------------------------------------------------

    def __len__(self) -> int:
        """Waiting requests (the true count, whatever the gate says)."""
        return self.tree.num_waiting

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._payloads

    def __iter__(self) -> Iterator[RequestId]:
        """Waiting request ids in arrival order."""
        return self.tree.waiting_ids()

    @property
    def num_running(self) -> int:
        return self.tree.num_running

    def payload(self, request_id: RequestId) -> Any:
        """The object stored with a request (an engine's own request, for adapters)."""
        return self._payloads[request_id]

    # ---- lifecycle --------------------------------------------------------------------

    def add(
        self,
        request_id: RequestId,
        keys: Sequence[ChunkKey],
        payload: Any = None,
        arrival_s: float | None = None,
    ) -> None:
        """Enqueue a new request with its chunk keys; ``arrival_s`` defaults to now."""
        self.tree.add(request_id, keys)
        self._payloads[request_id] = payload
        self._arrivals[request_id] = self.clock() if arrival_s is None else arrival_s
        self._offer_to_guard(request_id)
        self._changed()

    def peek(self) -> RequestId:
        """The request to admit next: a starved one if any, else the tree's best."""
        return self._current().candidate.request_id

    def pop(self) -> RequestId:
        """Admit the current candidate into the running set and return its id."""
        admission = self._current()
        request_id = admission.candidate.request_id
        self.tree.admit(request_id)
        self._forced_this_step |= admission.forced
        self._changed()
        return request_id

    def requeue(self, request_id: RequestId) -> None:
        """Send a running request back to waiting (preemption); its arrival time stays."""
        self.tree.requeue(request_id)
        self._offer_to_guard(request_id)
        self._changed()

    def finish(self, request_id: RequestId) -> None:
        """Forget a running request that completed."""
        self.tree.finish(request_id)
        self._forget(request_id)

    def remove(self, request_id: RequestId) -> None:
        """Forget a request in any state (abort, rejection)."""
        self.tree.remove(request_id)
        self._forget(request_id)

    # ---- admission --------------------------------------------------------------------

    def may_admit(self) -> bool:
        """True while requests wait and the gate has not said STOP in this step."""
        if self._closed or not self.tree.num_waiting:
            return False
        return self.admission().decision is Decision.ADD

    def admission(self) -> Admission:
        """The gate's decision for the current candidate, asked once per candidate."""
        if self._admission is None:
            self._admission = self._decide()
        return self._admission

    def record_step(self, batch_size: int, seconds: float) -> None:
        """Report an executed step's batch size and measured time (the gate's reward)."""
        if batch_size:
            self.gate.reward(batch_size, seconds)

    def new_step(self) -> None:
        """Start a scheduling step: a STOP of the previous step no longer holds."""
        self.gate.end_step()
        self._closed = False
        self._forced_this_step = False
        self._admission = None

    # ---- internals --------------------------------------------------------------------

    def _current(self) -> Admission:
        if self._admission is not None:
            return self._admission
        starved = self._starved()
        return Admission(self._candidate(starved), Decision.ADD, forced=starved is not None)

    def _candidate(self, starved: RequestId | None) -> Candidate:
        candidate = self.tree.candidate(starved)
        if candidate is None:
            raise IndexError("no waiting request in the FeatherQueue")
        return candidate

    def _decide(self) -> Admission:
        starved = self._starved()
        candidate = self._candidate(starved)
        if self._closed:
            return Admission(candidate, Decision.STOP, forced=False)
        if starved is not None:
            self.counts.forced += 1
            return Admission(candidate, Decision.ADD, forced=True)
        decision = self.gate.decide(
            GateContext(
                batch_size=self.tree.num_running,
                chunk_loss=candidate.chunk_loss,
                sharing_waiters=candidate.sharing_waiters,
                num_waiting=self.tree.num_waiting,
            )
        )
        if decision is Decision.ADD:
            self.counts.add += 1
        else:
            self.counts.stop += 1
            self._closed = True
        return Admission(candidate, decision, forced=False)

    def _starved(self) -> RequestId | None:
        """The oldest waiting request if it has waited past the bound (one a step)."""
        if self.max_wait_s is None or self._forced_this_step:
            return None
        heap = self._oldest
        while heap:
            arrival, _, request_id = heap[0]
            if request_id in self._payloads and self.tree.state(request_id) is WAITING:
                return request_id if self.clock() - arrival > self.max_wait_s else None
            heapq.heappop(heap)
        return None

    def _offer_to_guard(self, request_id: RequestId) -> None:
        if self.max_wait_s is not None:
            self._sequence += 1
            entry = (self._arrivals[request_id], self._sequence, request_id)
            heapq.heappush(self._oldest, entry)

    def _forget(self, request_id: RequestId) -> None:
        del self._payloads[request_id]
        del self._arrivals[request_id]
        self._changed()

    def _changed(self) -> None:
        """Any mutation may change the candidate; a STOP still holds for this step."""
        self._admission = None
