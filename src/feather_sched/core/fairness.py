"""The fairness bound: no waiting request is passed by more than K later arrivals, nor
held back by more than S of the gate's STOPs (docs/fairness.md#the-guarantee, with why).

Against arrival order: while a request waits, at most ``limit`` later arrivals of its
class or a less urgent one (and, with tenants, of its own tenant) are admitted before it,
and the gate ends at most ``stop_limit`` passes early; at either bound it is due.  A
preempted request waits under the bound afresh.  Only the most urgent class can be due.
Bookkeeping: a sequence number per arrival (together: one), a log of admitted sequences,
a STOP count.  The oldest request of a class and tenant waiting since it arrived (the
head) has the most overtakes and stops of its kind, so only the heads and the requeued
requests are checked; the heads sit in arrays by tenant (``due`` scans them in C) and
one is counted over the log only where its tenant has had ``limit`` admissions since it
entered.  Admissions O(1) amortised; the log is trimmed to what waiting requests need.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from feather_sched.core.tenants import grown

RequestId = Hashable

DEFAULT_MAX_OVERTAKES = 32
DEFAULT_MAX_STOPS = 4


@dataclass
class _Wait:
    entered: int
    """Log position (global) when the request entered waiting."""
    fresh: bool
    """Waiting since it arrived (never ran)."""
    stops: int
    """The STOP count when it entered waiting."""
    tenant_admissions: int = 0
    """Its tenant's admissions (any class) when it entered waiting."""


_NONE = np.iinfo(np.int64).max
"""A tenant's head sequence where it has no request waiting since it arrived."""


class _Heads:
    """For one priority class, each tenant's oldest request waiting since it arrived (its
    head), by tenant number: what ``due`` needs of it, in arrays so the tenants are
    scanned in C."""

    def __init__(self) -> None:
        self.sequence = np.zeros(0, dtype=np.int64)
        """The head's arrival sequence (``_NONE``: no head)."""
        self.stops = np.zeros(0, dtype=np.int64)
        """The STOP count when it entered."""
        self.admissions = np.zeros(0, dtype=np.int64)
        """Its tenant's admissions when it entered."""

    def set(self, tenant: int, sequence: int, wait: _Wait | None) -> None:
        """Record the tenant's head (``wait`` None: it has none).  O(1) amortised."""
        self.sequence = grown(self.sequence, tenant, _NONE)
        self.stops, self.admissions = grown(self.stops, tenant), grown(self.admissions, tenant)
        self.sequence[tenant] = _NONE if wait is None else sequence
        if wait is not None:
            self.stops[tenant], self.admissions[tenant] = wait.stops, wait.tenant_admissions


class OvertakeBound:
    """Counts, for every waiting request, the later arrivals admitted ahead of it."""

    def __init__(self, limit: int | None, stop_limit: int | None = None) -> None:
        for name, value in (("overtaking", limit), ("stop", stop_limit)):
            if value is not None and value < 0:
                raise ValueError(f"the {name} limit must be non-negative, got {value}")
        self.limit = limit
        self.stop_limit = stop_limit
        self._stops = 0
        self._sequence: dict[RequestId, int] = {}
        self._priority: dict[RequestId, int] = {}
        self._tenant: dict[RequestId, int] = {}
        self._classes: set[int] = set()
        """Priority classes seen (one: the log's priorities need not be compared)."""
        self._tenants: set[int] = set()
        """Tenants seen (one: the log's tenants need not be compared)."""
        self._arrivals = itertools.count()
        self._last_arrival: float | None = None
        self._last_sequence = -1
        self._waiting: dict[RequestId, _Wait] = {}
        self._held: dict[RequestId, _Wait] = {}
        self._fresh: dict[tuple[int, int], list[tuple[int, RequestId]]] = {}
        """Per priority class and tenant, a lazy heap of requests waiting since they
        arrived."""
        self._heads: dict[int, _Heads] = {}
        """Per priority class, each tenant's oldest request waiting since it arrived."""
        self._admitted = np.zeros(0, dtype=np.int64)
        """Admissions so far, per tenant number (any class)."""
        self._requeued: set[RequestId] = set()
        self._log = np.zeros(1024, dtype=np.int64)
        self._log_priority = np.zeros(1024, dtype=np.int64)
        self._log_tenant = np.zeros(1024, dtype=np.int64)
        self._log_len = 0
        self._log_base = 0
        """Global position of ``_log[0]``."""
        self._last: tuple[RequestId, _Wait] | None = None
        """The latest admission and the waiting record it ended (to undo a skip)."""

    # ---- transitions (the queue reports them) -----------------------------------------

    def arrive(self, request_id: RequestId, arrival_s: float | None = None,
               priority: int = 0, tenant: int = 0) -> None:
        """A new request of class ``priority`` and tenant number ``tenant`` waits.
        Requests given the same ``arrival_s`` arrived together: none of them counts as
        arriving after another (default: each one after the last).
        """
        if arrival_s is None or arrival_s != self._last_arrival:
            self._last_sequence = next(self._arrivals)
        self._last_arrival = arrival_s
        self._sequence[request_id] = self._last_sequence
        self._priority[request_id] = priority
        self._tenant[request_id] = tenant
        self._classes.add(priority)
        self._tenants.add(tenant)
        self._enter(request_id, self._new_wait(tenant, fresh=True))

    def admit(self, request_id: RequestId) -> None:
        """A waiting (or held) request runs: it passes every older waiting request."""
        wait = self._waiting.pop(request_id, None) or self._held.pop(request_id, None)
        self._requeued.discard(request_id)
        tenant = self._tenant[request_id]
        self._append(self._sequence[request_id], self._priority[request_id], tenant)
        self._admitted = grown(self._admitted, tenant)
        self._admitted[tenant] += 1
        self._refresh_head(request_id)
        self._last = (request_id, wait) if wait is not None and self._log_len else None

    def hold(self, request_id: RequestId, *, was_running: bool) -> None:
        """The request leaves the candidates without running (or stops running unseen).

        A request admitted last and now held was skipped by the engine: its admission is
        undone and its waiting record kept for when it returns.
        """
        if not was_running:
            wait = self._waiting.pop(request_id)
            self._requeued.discard(request_id)
            self._held[request_id] = wait
            self._refresh_head(request_id)
        elif self._last is not None and self._last[0] == request_id:
            self._log_len -= 1
            self._held[request_id] = self._last[1]
        self._last = None

    def requeue(self, request_id: RequestId) -> None:
        """A held or running request waits again (a skip undone keeps its old record)."""
        wait = self._held.pop(request_id, None) or \
            self._new_wait(self._tenant[request_id], fresh=False)
        self._enter(request_id, wait)

    def stopped(self) -> None:
        """The gate ended a pass early: every waiting request was held back once more."""
        self._stops += 1

    def forget(self, request_id: RequestId) -> None:
        """The request leaves for good (finished, aborted)."""
        wait = self._waiting.pop(request_id, None)
        if wait is not None and wait.fresh:
            self._refresh_head(request_id)
        del self._sequence[request_id]
        del self._priority[request_id]
        del self._tenant[request_id]
        self._held.pop(request_id, None)
        self._requeued.discard(request_id)
        if self._last is not None and self._last[0] == request_id:
            self._last = None

    # ---- queries ----------------------------------------------------------------------

    def overtakes(self, request_id: RequestId) -> int:
        """Later arrivals of its class or a less urgent one (and of its tenant) admitted
        since the waiting request entered waiting."""
        wait = self._waiting[request_id]
        start = wait.entered - self._log_base
        later = self._log[start:self._log_len] > self._sequence[request_id]
        if len(self._classes) > 1:
            later &= self._log_priority[start:self._log_len] >= self._priority[request_id]
        if len(self._tenants) > 1:
            later &= self._log_tenant[start:self._log_len] == self._tenant[request_id]
        return int(np.count_nonzero(later))

    def stops(self, request_id: RequestId) -> int:
        """STOPs since the waiting request entered waiting."""
        return self._stops - self._waiting[request_id].stops

    def stops_left(self, priority: int = 0) -> int | None:
        """STOPs the gate may still take before some waiting request of class
        ``priority`` (the most urgent class waiting) is due (None: no stop limit, or none
        waits).  O(T) in C plus O(requeued requests)."""
        if self.stop_limit is None:
            return None
        entered = [self._waiting[r].stops for r in self._requeued_in(priority)]
        heads = self._heads.get(priority)
        present = None if heads is None else heads.sequence != _NONE
        if present is not None and present.any():
            entered.append(int(heads.stops[present].min()))
        if not entered:
            return None
        return max(0, self.stop_limit - (self._stops - min(entered)))

    def due(self, priority: int = 0, tenants: np.ndarray | None = None
            ) -> RequestId | None:
        """The oldest waiting request of class ``priority`` (the most urgent class
        waiting) at either bound; ``tenants``: only theirs (a mask over tenant numbers),
        where given.  O(T) in C, plus one count over the log for each requeued request
        and each tenant head its tenant's admissions could have put at the bound."""
        found: RequestId | None = None
        for request_id in self._requeued_in(priority):
            if tenants is not None and not _marked(tenants, self._tenant[request_id]):
                continue
            if self._at_bound(request_id) and (
                    found is None or self._sequence[request_id] < self._sequence[found]):
                found = request_id
        head = self._due_head(priority, tenants)
        if head is not None and (found is None or
                                 self._sequence[head] < self._sequence[found]):
            found = head
        return found

    def oldest(self, priority: int = 0, tenant: int | None = None,
               tenants: np.ndarray | None = None) -> RequestId | None:
        """The waiting request of class ``priority`` that arrived first (of several that
        arrived together, any), of tenant number ``tenant`` or of the ``tenants`` a mask
        marks, where given; None when none waits.  O(T) in C plus O(requeued)."""
        candidates = [r for r in self._requeued_in(priority)
                      if (tenant is None or self._tenant[r] == tenant) and
                      (tenants is None or _marked(tenants, self._tenant[r]))]
        heads = self._heads.get(priority)
        if heads is not None:
            sequence = heads.sequence if tenants is None else \
                np.where(_aligned(tenants, len(heads.sequence)), heads.sequence, _NONE)
            first = int(np.argmin(sequence)) if tenant is None else tenant
            if first < len(sequence) and sequence[first] != _NONE:
                candidates.append(self._oldest_fresh((priority, first)))
        return min(candidates, key=self._sequence.__getitem__, default=None)

    def arrived_before(self, first: RequestId, second: RequestId) -> bool:
        """Whether ``first`` arrived before ``second`` (not together with it).  O(1)."""
        return self._sequence[first] < self._sequence[second]

    def _requeued_in(self, priority: int) -> list[RequestId]:
        """The class's requests waiting again after they left waiting (preempted ones)."""
        if len(self._classes) == 1:
            return list(self._requeued)
        return [r for r in self._requeued if self._priority[r] == priority]

    def _due_head(self, priority: int, tenants: np.ndarray | None) -> RequestId | None:
        """The oldest tenant head of the class at either bound (among ``tenants``).  A
        head is overtaken only by its tenant's admissions since it entered, so only the
        heads with at least ``limit`` of those are counted."""
        heads = self._heads.get(priority)
        if heads is None:
            return None
        present = heads.sequence != _NONE
        if tenants is not None:
            present &= _aligned(tenants, len(present))
        at = np.zeros(len(present), dtype=bool)
        if self.stop_limit is not None:
            at = present & (heads.stops <= self._stops - self.stop_limit)
        if self.limit is not None:
            self._admitted = grown(self._admitted, len(present) - 1)
            since = self._admitted[:len(present)] - heads.admissions
            for tenant in np.flatnonzero(present & ~at & (since >= self.limit)):
                at[tenant] = self._at_bound(self._oldest_fresh((priority, int(tenant))))
        if not at.any():
            return None
        return self._oldest_fresh((priority, int(np.argmin(np.where(at, heads.sequence,
                                                                      _NONE)))))

    def _at_bound(self, request_id: RequestId) -> bool:
        if self.stop_limit is not None and self.stops(request_id) >= self.stop_limit:
            return True
        if self.limit is None:
            return False
        admitted_since = self._position - self._waiting[request_id].entered
        return admitted_since >= self.limit and self.overtakes(request_id) >= self.limit

    # ---- internals --------------------------------------------------------------------

    @property
    def _position(self) -> int:
        return self._log_base + self._log_len

    def _new_wait(self, tenant: int, fresh: bool) -> _Wait:
        admitted = int(self._admitted[tenant]) if tenant < len(self._admitted) else 0
        return _Wait(self._position, fresh=fresh, stops=self._stops,
                     tenant_admissions=admitted)

    def _enter(self, request_id: RequestId, wait: _Wait) -> None:
        self._waiting[request_id] = wait
        if wait.fresh:
            key = (self._priority[request_id], self._tenant[request_id])
            heap = self._fresh.setdefault(key, [])
            heapq.heappush(heap, (self._sequence[request_id], request_id))
            self._refresh_head(request_id)
        else:
            self._requeued.add(request_id)

    def _refresh_head(self, request_id: RequestId) -> None:
        """Record the head of the request's class and tenant anew (it changed, or may
        have: the request entered or left waiting)."""
        priority, tenant = self._priority[request_id], self._tenant[request_id]
        head = self._oldest_fresh((priority, tenant))
        heads = self._heads.setdefault(priority, _Heads())
        if head is None:
            heads.set(tenant, 0, None)
        else:
            heads.set(tenant, self._sequence[head], self._waiting[head])

    def _oldest_fresh(self, key: tuple[int, int]) -> RequestId | None:
        """The oldest request waiting since it arrived, of a (class, tenant)."""
        heap = self._fresh.get(key, ())
        while heap:
            sequence, request_id = heap[0]
            wait = self._waiting.get(request_id)
            if wait is not None and wait.fresh and self._sequence[request_id] == sequence:
                return request_id
            heapq.heappop(heap)
        return None

    def _append(self, sequence: int, priority: int, tenant: int) -> None:
        if self._log_len == len(self._log):
            self._trim()
            if self._log_len == len(self._log):
                self._log, self._log_priority, self._log_tenant = (
                    np.concatenate([log, np.zeros_like(log)])
                    for log in (self._log, self._log_priority, self._log_tenant))
        self._log[self._log_len] = sequence
        self._log_priority[self._log_len] = priority
        self._log_tenant[self._log_len] = tenant
        self._log_len += 1

    def _trim(self) -> None:
        """Drop log entries no waiting or held request can still count."""
        entries = [w.entered for w in self._waiting.values() if not w.fresh]
        entries += [w.entered for w in self._held.values()]
        for key in self._fresh:
            oldest = self._oldest_fresh(key)
            if oldest is not None:
                entries.append(self._waiting[oldest].entered)
        keep_from = min(entries, default=self._position) - self._log_base
        if keep_from > 0:
            kept = self._log_len - keep_from
            self._log[:kept] = self._log[keep_from:self._log_len]
            self._log_priority[:kept] = self._log_priority[keep_from:self._log_len]
            self._log_tenant[:kept] = self._log_tenant[keep_from:self._log_len]
            self._log_len = kept
            self._log_base += keep_from


def _aligned(mask: np.ndarray, n: int) -> np.ndarray:
    """``mask`` cut or padded (False) to ``n`` entries."""
    if len(mask) >= n:
        return mask[:n]
    return np.concatenate([mask, np.zeros(n - len(mask), dtype=bool)])


def _marked(mask: np.ndarray, tenant: int) -> bool:
    return tenant < len(mask) and bool(mask[tenant])
