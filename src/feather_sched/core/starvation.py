"""The starvation backstop, ``max_wait_s``: which waiting request has waited past it."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable

RequestId = Hashable


class StarvationGuard:
    """The waiting requests by ``age_key`` (class, arrival, entry) in a lazy heap: the
    first still waiting, and whether a request has waited past ``max_wait_s``.  O(log n)
    an offer, O(log n) amortised the first."""

    def __init__(self, max_wait_s: float, clock: Callable[[], float]) -> None:
        self.max_wait_s = max_wait_s
        self.clock = clock
        self._heap: list[tuple[int, float, int, RequestId]] = []

    def offer(self, request_id: RequestId, age_key: tuple[int, float, int]) -> None:
        """The request (re-)entered waiting."""
        heapq.heappush(self._heap, (*age_key, request_id))

    def first(self, waiting: Callable[[RequestId], bool]) -> RequestId | None:
        """The first offered request, in ``age_key`` order, that is still ``waiting``."""
        heap = self._heap
        while heap:
            request_id = heap[0][-1]
            if waiting(request_id):
                return request_id
            heapq.heappop(heap)
        return None

    def past(self, arrival_s: float) -> bool:
        """Whether a request that arrived at ``arrival_s`` has waited past the bound."""
        return self.clock() - arrival_s > self.max_wait_s
