"""Fair share between tenants (docs/fairness.md#tenants: the rules, the proof of their
bound); what a tenant id is.  ``TenantShare`` keeps a VTC counter per tenant (Sheng et
al., OSDI'24): ``INPUT_WEIGHT`` per computed prompt token and ``OUTPUT_WEIGHT`` per
generated token over the tenant's weight, a cache hit at ``hit_weight`` of a computed
token.  A tenant with a request waiting and below its share of the engine's seats is
backlogged; it is lifted to the least backlogged counter when it becomes so.  The share
admits the backlogged tenants within their quanta of one another (``window``), and the
queue orders by prefix inside that window.  A tenant's quantum is ``quantum`` scaled by
its part of the recent service over its fair part; a newcomer's is 0, so, as under VTC,
its next request goes before anyone more served.  Queries are read-only.  Costs: O(1) a
charge; O(T) in C a query (``T`` tenants seen); a decision at 10,000 tenants 0.3 ms
(``benchmarks/core/``).  Tenant ids: an engine argument (``TENANT_ARG``) an HTTP front
fills (``named_tenant``), each checked by ``parse_tenant``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Hashable, Mapping

import numpy as np

from feather_sched.telemetry.prometheus import OTHER_TENANTS

Tenant = Hashable

DEFAULT_TENANT = "default"
"""The tenant of a request that names none."""
RESERVED_TENANTS = frozenset({DEFAULT_TENANT, OTHER_TENANTS})
"""Names a request cannot give its tenant: the bucket of requests that name none, and the
metrics' label of the tenants past ``max_tenant_labels`` (``named_tenant`` refuses them,
so a client cannot pass for either)."""
MAX_TENANT_CHARS = 256
"""The longest tenant id (a hashed e-mail address or a UUID fits)."""
TENANT_HEADER = "x-tenant-id"
"""The HTTP header in which a gateway names a request's tenant."""
TENANT_ARG = "tenant"
"""The key of a request's tenant among its engine arguments: vLLM's
``SamplingParams.extra_args`` (an OpenAI body's ``vllm_xargs``), SGLang's
``custom_params``."""
INPUT_WEIGHT = 1.0
"""Service per computed prompt token (VTC's ``w_p``)."""
OUTPUT_WEIGHT = 2.0
"""Service per generated token (VTC's ``w_q``: a decode token costs about twice)."""
DEFAULT_QUANTUM_TOKENS = 16384
"""How far (in weighted tokens) a tenant may get ahead of the least served one while the
prefix order picks it: a few requests' worth, so a group's members still run together."""
RECENT_QUANTA = 16
"""The half-life of ``RecentService``, in quanta of service to all tenants: what a
tenant's recent part of the service is measured over."""
DEFAULT_HIT_WEIGHT = 0.5
"""What a prompt token served from the prefix cache costs its tenant, relative to one the
engine computes: half (``TenantShare``: 0 charges computed tokens only, 1 is VTC's)."""


def service_of(computed_tokens: int, output_tokens: int) -> float:
    """VTC's service for ``computed_tokens`` prompt tokens computed and ``output_tokens``
    generated, before any weight."""
    return INPUT_WEIGHT * computed_tokens + OUTPUT_WEIGHT * output_tokens


_INT_LIMIT = 10 ** (MAX_TENANT_CHARS - 1)
"""Integers below this in size have at most ``MAX_TENANT_CHARS`` characters, sign included."""


def parse_tenant(value: object, source: str = "tenant") -> str:
    """A request's tenant from the raw value its engine or HTTP front carries (the one
    place a tenant id is checked): a string of 1 to ``MAX_TENANT_CHARS`` printable
    characters as given, not beginning or ending with whitespace (``"alice "`` would be
    a tenant apart from ``"alice"``); an integer (not a bool) as its decimal string (so
    ``7`` and ``"7"`` are one tenant: JSON gives numeric ids as numbers); None as
    ``DEFAULT_TENANT``.  ValueError naming ``source`` (where the value came from) and
    saying what was given otherwise.  O(length)."""
    if value is None:
        return DEFAULT_TENANT
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < _INT_LIMIT:
        return str(value)
    if isinstance(value, str) and 0 < len(value) <= MAX_TENANT_CHARS and \
            value.isprintable() and value == value.strip():
        return value
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise ValueError(f"{source} must be a non-empty string of at most {MAX_TENANT_CHARS} "
                     "printable characters, no whitespace at either end, or an integer; "
                     f"got {type(value).__name__} {shown}")


def named_tenant(header: str | None, engine_args: object, user: object,
                 args_field: str = "vllm_xargs", header_name: str = TENANT_HEADER
                 ) -> str | None:
    """The tenant an HTTP request names, parsed (``parse_tenant``): the tenant ``header``
    (a gateway's word; ``header_name``, ``x-tenant-id`` unless configured) wins, then
    ``TENANT_ARG`` of the body's ``engine_args`` (its field ``args_field``: vLLM's
    ``vllm_xargs``, SGLang's ``custom_params``; where it is a mapping), then OpenAI's
    ``user`` (``user_tenant``); None where the request names none (``DEFAULT_TENANT``'s).
    Only the value chosen is parsed, so a client's own word does not fail a request its
    gateway named. ValueError for a bad header or engine argument, Feather's own fields, or
    one that is a ``RESERVED_TENANTS`` name (a ``user`` of that name names none).  O(1)
    plus the parse."""
    if header is not None:
        source = f"the {header_name} header"
        return _unreserved(parse_tenant(header, source), source)
    if isinstance(engine_args, Mapping) and engine_args.get(TENANT_ARG) is not None:
        return _unreserved(parse_tenant(engine_args[TENANT_ARG], f"{args_field}.{TENANT_ARG}"),
                           f"{args_field}.{TENANT_ARG}")
    tenant = user_tenant(user)
    return None if tenant in RESERVED_TENANTS else tenant


def _unreserved(tenant: str, source: str) -> str:
    if tenant in RESERVED_TENANTS:
        raise ValueError(f"{source}: the tenant name {tenant!r} is reserved (Feather's "
                         f"names for {' and '.join(sorted(RESERVED_TENANTS))}); leave the "
                         "tenant out for the default one")
    return tenant


def user_tenant(user: object) -> str | None:
    """OpenAI's ``user`` as a tenant: a free-form end-user id in OpenAI's API, so a value
    that is not a tenant id (empty, whitespace at an end, over ``MAX_TENANT_CHARS``, not
    a string or integer) names none, and the request is the default tenant's, rather
    than a valid request failing.  O(length)."""
    try:
        return None if user is None or user == "" else parse_tenant(user, "user")
    except ValueError:
        return None


def grown(array: np.ndarray, slot: int, fill: int = 0) -> np.ndarray:
    """``array`` (one entry a tenant slot) with room for ``slot``: itself where it has
    it, else doubled (at least 64 entries), the new entries ``fill``.  O(1) amortised."""
    if slot < len(array):
        return array
    size = max(64, 2 * slot + 1, 2 * len(array))
    return np.concatenate([array, np.full(size - len(array), fill, array.dtype)])


class TenantShare:
    """Per-tenant service counters, backlog and seats, and the tenants the share admits.

    Each tenant seen gets a slot in growing arrays (counter, weight, requests running and
    waiting, per class waiting, seated), so the queries are vectorised over the slots:
    O(T) in C, ``T`` the tenants seen, and read-only.  State changes only in the calls
    that change it: the lifts in ``wait``, ``refresh`` and ``unrun``."""

    def __init__(self, weights: Mapping[Tenant, float] | None = None,
                 quantum: float = DEFAULT_QUANTUM_TOKENS,
                 hit_weight: float = DEFAULT_HIT_WEIGHT, shares_seats: bool = True) -> None:
        """``weights``: a tenant's share relative to others (a tenant not named: 1);
        ``quantum``: in weighted tokens, non-negative; ``hit_weight``: what a cache hit
        costs relative to a computed prompt token, in [0, 1]; ``shares_seats``: whether a
        tenant at its share of the seats yields (off: counters alone, as VTC)."""
        weights = dict(weights or {})
        for tenant, weight in weights.items():
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
                raise ValueError(f"tenant {tenant!r}: weight must be a positive number, "
                                 f"got {weight!r}")
        if not (math.isfinite(quantum) and quantum >= 0):
            raise ValueError(f"quantum must be a non-negative number, got {quantum!r}")
        if not 0 <= hit_weight <= 1:
            raise ValueError(f"hit_weight must be a number in [0, 1], got {hit_weight!r}")
        self.weights = weights
        self.quantum = float(quantum)
        self.hit_weight = float(hit_weight)
        self.shares_seats = shares_seats
        self._slots: dict[Tenant, int] = {}
        self._names: list[Tenant] = []
        self._service = np.zeros(0)
        self._weight = np.zeros(0)
        self._running = np.zeros(0, dtype=np.int64)
        self._waiting = np.zeros(0, dtype=np.int64)
        """Waiting requests of each tenant, all classes."""
        self._backlog: dict[int, np.ndarray] = {}
        """Per priority class, waiting requests of each tenant there."""
        self._seated = np.zeros(0, dtype=bool)
        """Waiting tenants at their seat share (``refresh``, ``run``); not backlogged."""
        self._active = 0
        """Tenants with a request running or waiting (``quantum_of``)."""
        self._waiting_weight = 0.0
        self._idle = 0
        """Running requests of the tenants with nothing waiting."""
        self.seats: int | None = None
        """The engine's seats as of the last ``refresh`` (None: no seat share)."""
        self._per_weight = math.inf
        """Seats per unit of weight of the waiting tenants, as of the last ``refresh``."""
        self.floor = 0.0
        """The least counter of the backlogged tenants as last seen (never decreases)."""
        self.recent = RecentService(RECENT_QUANTA * max(self.quantum, 1.0))
        """Each tenant's part of the recent service, by slot (``quantum_of``)."""

    def _slot(self, tenant: Tenant) -> int:
        """The tenant's slot, given one if new (the arrays doubled when full).  O(1)
        amortised."""
        slot = self._slots.get(tenant)
        if slot is not None:
            return slot
        slot = self._slots[tenant] = len(self._names)
        self._names.append(tenant)
        if slot == len(self._service):
            self._service, self._weight = grown(self._service, slot), grown(self._weight, slot)
            self._running, self._waiting = grown(self._running, slot), grown(self._waiting, slot)
            self._seated = grown(self._seated, slot)
            self._backlog = {p: grown(b, slot) for p, b in self._backlog.items()}
        self._weight[slot] = self.weights.get(tenant, 1.0)
        return slot

    def service(self, tenant: Tenant) -> float:
        """The tenant's counter: its weighted service so far (lifts included).  O(1)."""
        slot = self._slots.get(tenant)
        return 0.0 if slot is None else float(self._service[slot])

    def services(self) -> np.ndarray:
        """Every slot's counter (a view: read, do not change).  O(1)."""
        return self._service[:len(self._names)]

    def weight(self, tenant: Tenant) -> float:
        return self.weights.get(tenant, 1.0)

    def slot(self, tenant: Tenant) -> int:
        """The tenant's slot in the share's arrays (given one if new).  O(1)."""
        return self._slot(tenant)

    def tenant_of(self, slot: int) -> Tenant:
        """The tenant of a slot.  O(1)."""
        return self._names[slot]

    def charge(self, tenant: Tenant, computed_tokens: int, output_tokens: int) -> None:
        """The engine computed ``computed_tokens`` prompt tokens (recomputation included,
        cache hits not) and generated ``output_tokens`` tokens for the tenant: each
        computed token ``1 - hit_weight`` of ``INPUT_WEIGHT`` (the rest was charged at
        admission), each generated one ``OUTPUT_WEIGHT``.  O(1)."""
        cost = (1 - self.hit_weight) * INPUT_WEIGHT * computed_tokens + \
            OUTPUT_WEIGHT * output_tokens
        self._add(tenant, cost / self.weight(tenant))

    def admitted(self, tenant: Tenant, prompt_tokens: int) -> float:
        """A request of the tenant with ``prompt_tokens`` prompt tokens was admitted (again,
        after a preemption): ``hit_weight`` of its whole prompt.  Returns the charge,
        before the tenant's weight (what ``refund`` takes back).  O(1)."""
        cost = self.hit_weight * INPUT_WEIGHT * prompt_tokens
        self._add(tenant, cost / self.weight(tenant))
        return cost

    def refund(self, tenant: Tenant, cost: float) -> None:
        """An admission charged ``cost`` (``admitted``) did not take effect: the engine
        did not run the request.  The counter goes back down, but not below the floor
        (where it was not already), so the least backlogged counter never decreases."""
        slot = self._slot(tenant)
        service = float(self._service[slot])
        refunded = max(service - cost / self.weight(tenant), min(service, self.floor))
        self._service[slot] = refunded
        self.recent.add(slot, refunded - service)

    def _add(self, tenant: Tenant, weighted: float) -> None:
        slot = self._slot(tenant)
        self._service[slot] += weighted
        self.recent.add(slot, weighted)

    def quantum_of(self, tenant: Tenant) -> float:
        """How far ahead of ``tenant``, while it is backlogged, another tenant may be
        admitted: its entry of ``quanta`` (a tenant never seen: the whole quantum).  O(T)
        in C."""
        slot = self._slots.get(tenant)
        return self.quantum if slot is None else float(self.quanta()[slot])

    def quanta(self) -> np.ndarray:
        """Every slot's quantum: ``quantum`` scaled by its recent part of the service over
        its fair part (``RecentService``; fair: one over the tenants with a request
        running or waiting), at most 1: 0 for a tenant with no recent service (a newcomer,
        or one whose service decayed away), whose next request then goes before any tenant
        more served, as under VTC.  O(T) in C."""
        parts = self.recent.parts(len(self._names))
        scaled = self.quantum * np.minimum(1.0, max(1, self._active) * parts)
        return scaled

    # ---- backlog and seats ------------------------------------------------------------

    def wait(self, tenant: Tenant, priority: int = 0) -> None:
        """One more request of the tenant waits in class ``priority``; a tenant's first
        is lifted to the least backlogged counter (``floor``).  O(1), the first O(T) in C."""
        slot = self._slot(tenant)
        if not self._waiting[slot]:
            self._raise_floor()
            self._service[slot] = max(self._service[slot], self.floor)
            self._active += not self._running[slot]
            self._idle -= int(self._running[slot])
            self._waiting_weight += self._weight[slot]
            self._seated[slot] = self._at_share(slot)
        self._waiting[slot] += 1
        backlog = self._backlog.get(priority)
        if backlog is None:
            backlog = self._backlog[priority] = np.zeros(len(self._service), np.int64)
        backlog[slot] += 1

    def unwait(self, tenant: Tenant, priority: int = 0) -> None:
        """A waiting request of the tenant in class ``priority`` stops waiting.  O(1), the
        tenant's last O(T) in C (the floor)."""
        slot = self._slots[tenant]
        self._backlog[priority][slot] -= 1
        if self._waiting[slot] == 1:
            self._raise_floor()  # it counts once more: a tenant leaving raises the floor
        self._waiting[slot] -= 1
        if not self._waiting[slot]:
            self._seated[slot] = False
            self._active -= not self._running[slot]
            self._idle += int(self._running[slot])
            self._waiting_weight -= self._weight[slot]

    def run(self, tenant: Tenant) -> None:
        """One more request of the tenant runs (holds a seat); one that reaches its seat
        share (as of the last ``refresh``) leaves the backlog.  O(1), O(T) in C then."""
        slot = self._slot(tenant)
        self._active += not (self._running[slot] or self._waiting[slot])
        self._running[slot] += 1
        if not self._waiting[slot]:
            self._idle += 1
        elif not self._seated[slot] and self._at_share(slot):
            self._raise_floor()
            self._seated[slot] = True

    def unrun(self, tenant: Tenant) -> None:
        """A running request of the tenant stops running (finished, preempted, held); one
        that drops below its seat share joins the backlog again, lifted (as ``wait``).
        O(1), O(T) in C then."""
        slot = self._slots[tenant]
        self._running[slot] -= 1
        self._active -= not (self._running[slot] or self._waiting[slot])
        if not self._waiting[slot]:
            self._idle -= 1
        elif self._seated[slot] and not self._at_share(slot):
            self._raise_floor()  # the least of the others, it still seated
            self._seated[slot] = False
            self._service[slot] = max(self._service[slot], self.floor)

    def running(self, tenant: Tenant) -> int:
        """The tenant's running requests."""
        slot = self._slots.get(tenant)
        return 0 if slot is None else int(self._running[slot])

    def ranking(self) -> dict[Tenant, int]:
        """The tenants with a request running or waiting, numbered by counter, the least
        served 0 (equal counters: the one seen first): the preemption order's tenants
        (``FeatherRuntime.order``).  O(T log T) in C, plus O(those tenants)."""
        n = len(self._names)
        slots = np.flatnonzero((self._running[:n] > 0) | (self._waiting[:n] > 0))
        ordered = slots[np.argsort(self._service[slots], kind="stable")]
        names = self._names
        return {names[slot]: place for place, slot in enumerate(ordered.tolist())}

    def clear_backlog(self) -> None:
        """Nothing waits or runs any more (the queue was rebuilt); the counters stay."""
        for array in (self._running, self._waiting, self._seated, *self._backlog.values()):
            array[:] = 0
        self._active = self._idle = 0
        self._waiting_weight = 0.0

    def seat_share(self, tenant: Tenant, seats: int) -> float:
        """A waiting tenant's seat share: the ``seats`` that tenants with nothing waiting
        do not hold, split by weight over the tenants with a request waiting.  O(1)."""
        return (seats - self._idle) / self._waiting_weight * self.weight(tenant)

    def _at_share(self, slot: int) -> bool:
        return bool(self._running[slot] >= self._per_weight * self._weight[slot])

    def refresh(self, seats: int | None) -> None:
        """Start a pass with the engine's ``seats`` (None: unknown, no seat share): the
        seat shares computed once for the pass; a tenant that reached its share leaves
        the backlog, one that fell below it joins it again, lifted to the least counter
        of the others (as ``unwait`` and ``wait``).  O(T) in C."""
        self.seats = seats
        self._per_weight = math.inf
        if seats is not None and self.shares_seats and self._waiting_weight > 0:
            self._per_weight = (seats - self._idle) / self._waiting_weight
        n = len(self._names)
        seated = (self._waiting[:n] > 0) & (self._running[:n] >= self._per_weight *
                                            self._weight[:n])
        freed = self._seated[:n] & ~seated
        if not freed.any() and np.array_equal(seated, self._seated[:n]):
            return
        self._raise_floor()
        self._seated[:n] = seated
        self._raise_floor(excluded=freed)
        self._service[:n][freed] = np.maximum(self._service[:n][freed], self.floor)

    def _raise_floor(self, excluded: np.ndarray | None = None) -> None:
        """The floor up to the least counter of the backlogged tenants (all classes), but
        ``excluded``; unchanged where there are none.  O(T) in C."""
        n = len(self._names)
        backlogged = (self._waiting[:n] > 0) & ~self._seated[:n]
        if excluded is not None:
            backlogged &= ~excluded
        if backlogged.any():
            self.floor = max(self.floor, float(self._service[:n][backlogged].min()))

    # ---- admission (read-only) --------------------------------------------------------

    def backlogged(self, priority: int = 0) -> np.ndarray:
        """A mask over the slots of the tenants backlogged in class ``priority``: waiting
        there, not at their seat share (all those waiting there where every one is).
        O(T) in C."""
        n = len(self._names)
        backlog = self._backlog.get(priority)
        if backlog is None:
            return np.zeros(n, dtype=bool)
        waiting = backlog[:n] > 0
        below = waiting & ~self._seated[:n]
        return below if below.any() else waiting

    def window(self, priority: int = 0) -> np.ndarray:
        """A mask over the slots of the tenants the share admits now in class
        ``priority``: backlogged there, no more than ``quanta`` of any of them ahead of
        it (the least served always among them).  O(T) in C."""
        backlogged = self.backlogged(priority)
        if not backlogged.any():
            return backlogged
        services = self.services()
        limit = (services[backlogged] + self.quanta()[backlogged]).min()
        return backlogged & (services <= limit)

    def least_served(self, priority: int = 0) -> Tenant | None:
        """The backlogged tenant of class ``priority`` with the least counter (equal: the
        one seen first; None: none is backlogged there).  O(T) in C."""
        backlogged = self.backlogged(priority)
        if not backlogged.any():
            return None
        return self._names[int(np.argmin(np.where(backlogged, self.services(), np.inf)))]

    def eligible(self, tenant: Tenant, priority: int = 0) -> bool:
        """Whether the share admits a request of ``tenant`` in class ``priority`` now:
        ``tenant`` among the ``eligible_tenants``, or nobody backlogged there.  O(T) in C."""
        window = self.window(priority)
        slot = self._slots.get(tenant)
        return not window.any() or (slot is not None and bool(window[slot]))

    def eligible_tenants(self, priority: int = 0) -> list[Tenant]:
        """The tenants the share admits now in class ``priority`` (``window``), in the
        order first seen.  O(T) in C plus O(those tenants)."""
        names = self._names
        return [names[slot] for slot in np.flatnonzero(self.window(priority)).tolist()]


class RecentService:
    """Each slot's part of the recent service: the service it was charged (weighted),
    decayed by half every ``half_life`` of service charged to all, over the total so
    decayed.  Decayed by service, not time, so it reads the same on any engine; O(1) a
    charge (the decay is folded into a growing scale, rescaled now and then)."""

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self._scaled = np.zeros(64)
        self._total = 0.0
        self._since = 0.0
        """Service charged since the scale was last reset."""

    def add(self, slot: int, service: float) -> None:
        """Slot ``slot`` was charged ``service`` (negative: refunded)."""
        self._scaled = grown(self._scaled, slot)
        amount = service * 2.0 ** (self._since / self.half_life)
        before = float(self._scaled[slot])
        scaled = max(before + amount, 0.0)
        self._total += scaled - before
        self._scaled[slot] = scaled
        self._since += max(service, 0.0)
        if self._since > 64 * self.half_life:  # rescale before the scale overflows
            self._scaled *= 2.0 ** (-self._since / self.half_life)
            self._scaled[self._scaled <= 1e-12] = 0.0
            self._total = float(self._scaled.sum())
            self._since = 0.0

    def part(self, slot: int) -> float:
        """The slot's part of the recent service, in [0, 1] (0 before any)."""
        if self._total <= 0 or slot >= len(self._scaled):
            return 0.0
        return float(self._scaled[slot]) / self._total

    def parts(self, n: int) -> np.ndarray:
        """``part`` of slots 0 to ``n - 1``.  O(n) in C."""
        scaled = self._scaled[:n]
        if len(scaled) < n:
            scaled = np.concatenate([scaled, np.zeros(n - len(scaled))])
        return scaled / self._total if self._total > 0 else np.zeros(n)


class TenantFifo:
    """VTC's order within a tenant: per class, first come first served, a request that
    returns (preempted, or skipped by the engine) at the head, as vLLM's FCFS queue
    prepends it.  ``enter`` and ``leave`` O(log n) amortised (lazy heaps, compacted when
    half stale), ``head`` amortised O(log n)."""

    def __init__(self) -> None:
        self._heaps: dict[tuple[int, Tenant], list[tuple[int, Hashable]]] = {}
        self._places: dict[Hashable, tuple[int, Tenant, int]] = {}
        """Each waiting request's (class, tenant, place); the smallest place is the head."""
        self._waiting: Counter[tuple[int, Tenant]] = Counter()
        self._entries = itertools.count(1)

    def enter(self, request_id: Hashable, tenant: Tenant, priority: int = 0,
              front: bool = False) -> None:
        """The request waits: at its tenant's tail in its class, or at the head."""
        entry = next(self._entries)
        place = -entry if front else entry
        self._places[request_id] = (priority, tenant, place)
        queue = (priority, tenant)
        self._waiting[queue] += 1
        heap = self._heaps.setdefault(queue, [])
        heapq.heappush(heap, (place, request_id))
        if len(heap) > 2 * self._waiting[queue] + 64:
            self._heaps[queue] = [(p, r) for p, r in heap if self._places.get(r) ==
                                  (*queue, p)]
            heapq.heapify(self._heaps[queue])

    def leave(self, request_id: Hashable) -> None:
        """The request stops waiting."""
        priority, tenant, _ = self._places.pop(request_id)
        self._waiting[priority, tenant] -= 1

    def place(self, request_id: Hashable) -> int:
        """The waiting request's place in its tenant's queue (smaller: nearer the head)."""
        return self._places[request_id][2]

    def head(self, tenant: Tenant, priority: int = 0) -> Hashable | None:
        """The tenant's first waiting request in class ``priority``; None if none."""
        heap = self._heaps.get((priority, tenant))
        while heap:
            place, request_id = heap[0]
            if self._places.get(request_id) == (priority, tenant, place):
                return request_id
            heapq.heappop(heap)
        return None
