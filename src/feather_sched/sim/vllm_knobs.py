"""vLLM's own scheduler knobs a user would switch on instead of Feather, replayed in the
simulator from vLLM 0.34.0's source (``vllm/v1/core/sched/scheduler.py``):
* ``vllm-cache-aware``: ``--cache-aware-admission-window N`` and
  ``--cache-aware-admission-threshold F`` (``Scheduler._reorder_waiting_by_cached_prefix``,
  PR #54625).  Once per ``schedule()``, after the running requests and only when none was
  preempted, if the KV cache's usage is at least ``F``: among the first ``N`` waiting
  requests, those merely waiting (not preempted: vLLM's ``RequestStatus.WAITING`` with no
  computed token) are re-sorted into their own slots by cached prefix tokens, deepest
  first, ties by position (``get_num_cached_tokens``: the last token always recomputed);
  a preempted request keeps its slot.  Then admission is FCFS's.
* ``vllm-active-cap``: ``--max-num-active-seqs N``: admission stops once ``N`` requests
  run, whatever ``max_num_seqs`` sizes the runner for.
Both are vLLM's FCFS otherwise (``sim.fcfs``); ``tests/integrations/vllm/test_vllm_knobs.py``
checks the replayed order against vLLM 0.34's own scheduler.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any, TypeVar

from feather_sched.gates.base import Decision
from feather_sched.sim.fcfs import FcfsPolicy, Offer

if TYPE_CHECKING:
    from feather_sched.sim.engine import SimRequest

T = TypeVar("T")


def reorder_window(head: Sequence[T], movable: Callable[[T], bool],
                   cached_tokens: Callable[[T], int]) -> list[T]:
    """vLLM 0.34's window order: the movable requests of ``head`` re-sorted into their own
    slots by ``cached_tokens``, most first, ties by position; the others stay put.
    O(w log w) for a window of w, one ``cached_tokens`` call per movable request."""
    slots = [i for i, request in enumerate(head) if movable(head[i])]
    reordered = list(head)
    if len(slots) < 2:
        return reordered
    cached = {i: cached_tokens(head[i]) for i in slots}
    for slot, source in zip(slots, sorted(slots, key=lambda i: (-cached[i], i)), strict=True):
        reordered[slot] = head[source]
    return reordered


def cached_prefix_tokens(pool: Any, request: SimRequest) -> int:
    """What vLLM's ``get_num_cached_tokens`` says of a request: its cached leading blocks'
    tokens, up to ``num_tokens - 1`` (the last token is always computed)."""
    block_tokens = pool.block_tokens
    hits = min(len(pool.match(request.keys)), (request.num_tokens - 1) // block_tokens)
    return hits * block_tokens


class CacheAwarePolicy(FcfsPolicy):
    """vLLM's FCFS queue with cache-aware admission (``window``, ``threshold``)."""

    name = "vllm-cache-aware"

    def __init__(self, engine: Any, window: int, threshold: float) -> None:
        if window < 0 or window != int(window) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"need a whole window >= 0 and 0 <= threshold <= 1, got "
                             f"{window}, {threshold}")
        super().__init__()
        self.engine = engine
        self.window = int(window)
        self.threshold = threshold
        self._pending = False
        """A pass began and its reorder has not run yet (it runs at the pass's first
        ``decide``: after the running requests, as vLLM's does)."""

    def begin_pass(self, running: Sequence[SimRequest]) -> list[SimRequest]:
        self._pending = True
        return list(running)

    def decide(self) -> Offer | None:
        if self._pending:
            self._pending = False
            self._reorder()
        return super().decide()

    def _reorder(self) -> None:
        pool = self.engine.pool
        if self.window == 0 or len(self._queue) < 2 or pool.usage < self.threshold:
            return
        head = list(islice(self._queue, self.window))
        order = reorder_window(head, lambda r: r.preemptions == 0,
                               lambda r: cached_prefix_tokens(pool, r))
        if order != head:
            self._queue = deque(order + list(islice(self._queue, len(head), None)))


class ActiveCapPolicy(FcfsPolicy):
    """vLLM's FCFS queue under ``max_num_active_seqs = cap``."""

    name = "vllm-active-cap"

    def __init__(self, cap: int) -> None:
        if cap < 1 or cap != int(cap):
            raise ValueError(f"cap must be a whole number >= 1, got {cap}")
        super().__init__()
        self.cap = int(cap)
        self._running: list[SimRequest] = []

    def begin_pass(self, running: Sequence[SimRequest]) -> list[SimRequest]:
        """The engine admits into the list returned: the cap counts it as it grows."""
        self._running = list(running)
        return self._running

    def decide(self) -> Offer | None:
        offer = super().decide()
        if offer is not None and len(self._running) >= self.cap:
            return Offer(offer.request_id, Decision.STOP)
        return offer
