"""What the queue knows of each request it holds, fixed when the request enters: its
chunk keys, arrival, prompt tokens, class, prefix group and tenant (``EntryTable``)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter

from feather_sched.core.tenants import DEFAULT_TENANT

RequestId = Hashable


@dataclass
class Entry:
    keys: list
    arrival_s: float
    tokens: int
    priority: int
    sequence: int
    """Order of first entry into the queue: ties between equal arrival times."""
    group: Hashable
    """Its prefix group (``prefix.group_of`` its keys)."""
    tenant: Hashable = DEFAULT_TENANT
    age_key: tuple[int, float, int] = field(init=False)
    """(priority, arrival_s, sequence), as ``EntryTable.age_key`` gives it."""

    def __post_init__(self) -> None:
        self.age_key = (self.priority, self.arrival_s, self.sequence)


_AGE_KEY = attrgetter("age_key")
_GROUP = attrgetter("group")


class EntryTable:
    """The entries by request id, and the per-request reads a queue answers from them.
    Each read is O(1) (the list reads O(n), in C); KeyError for an unknown request."""

    def __init__(self) -> None:
        self._requests: dict[RequestId, Entry] = {}
        self._sequence_numbers = itertools.count()

    def _enter(self, request_id: RequestId, keys: list, arrival_s: float, tokens: int,
               priority: int, group: Hashable, tenant: Hashable) -> Entry:
        entry = Entry(keys, arrival_s, tokens, priority, next(self._sequence_numbers), group,
                      tenant)
        self._requests[request_id] = entry
        return entry

    def __contains__(self, request_id: object) -> bool:
        """Whether the queue knows the request, in any state."""
        return request_id in self._requests

    def arrival_s(self, request_id: RequestId) -> float:
        return self._requests[request_id].arrival_s

    def age_key(self, request_id: RequestId) -> tuple[int, float, int]:
        """Sorts requests by class, the most urgent first, then by age, the oldest first:
        (priority, arrival time, order of entry)."""
        return self._requests[request_id].age_key

    def age_keys(self, request_ids: Iterable[RequestId]) -> list[tuple[int, float, int]]:
        """``age_key`` of each request, in order."""
        return list(map(_AGE_KEY, map(self._requests.__getitem__, request_ids)))

    def group(self, request_id: RequestId) -> Hashable:
        """The request's prefix group (``prefix.group_of`` its chunk keys)."""
        return self._requests[request_id].group

    def groups(self, request_ids: Iterable[RequestId]) -> list[Hashable]:
        """``group`` of each request, in order."""
        return list(map(_GROUP, map(self._requests.__getitem__, request_ids)))

    def priority(self, request_id: RequestId) -> int:
        """The request's priority class (lower is more urgent)."""
        return self._requests[request_id].priority

    def tenant(self, request_id: RequestId) -> Hashable:
        """The request's tenant."""
        return self._requests[request_id].tenant

    def keys(self, request_id: RequestId) -> list:
        """The request's chunk keys."""
        return self._requests[request_id].keys
