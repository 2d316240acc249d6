"""Fair share between tenants: a virtual service counter per tenant, a share of the
engine's seats, and which tenants may be admitted from now; and what a tenant id is.

The counter is VTC's (Sheng et al., OSDI'24): a tenant's service is ``INPUT_WEIGHT`` per
prompt token and ``OUTPUT_WEIGHT`` per token generated for it, over the tenant's weight;
a prompt token the prefix cache serves costs ``hit_weight`` of one the engine computes.
So the share charges ``hit_weight`` of the whole prompt when a request is admitted
(``admitted``; ``refund`` where the engine does not run it after all) and the rest,
``1 - hit_weight`` of ``INPUT_WEIGHT``, per prompt token as the engine computes it, with
each generated token (``charge``; a recomputation after preemption is computed again).
``hit_weight`` 0 charges computed tokens only: a tenant whose requests share a prefix
pays for it once.  1 is VTC's own charge, the whole prompt at admission whoever computed
it.  Between them (``DEFAULT_HIT_WEIGHT``) a hit costs half a computed token: sharing
still pays the tenant that shares, but its requests are not near-free, and near-free
requests are what let a tenant whose prompts hit the cache fill the KV pool while one
whose requests share nothing waits (docs/fairness.md#tenants).

Tenant ids.  A request names its tenant by an engine argument (``TENANT_ARG`` of vLLM's
``SamplingParams.extra_args``, of SGLang's ``custom_params``), which an HTTP front fills
from the ``x-tenant-id`` header, the body's own or OpenAI's ``user`` (``named_tenant``);
every id, wherever it comes from, is checked by ``parse_tenant``.

Seats.  Cheap service is not cheap seats: a request whose prompt is a cache hit costs
its tenant a few tokens at admission, then holds one of the engine's seats for its whole
output, so a counter alone lets such a tenant fill the seats in one burst while the
others wait.  Where the engine's seats ``S`` are known (``seats``), a tenant with a
request waiting has a *seat share*: the seats that tenants with nothing waiting do not
hold, split by weight over the tenants with a request waiting (``seat_share``).  Such a
tenant running its share or more is *at its seat share*.

A tenant is *backlogged* while one of its requests waits (in a class, ``wait``/
``unwait``) and it is not at its seat share.  When a tenant becomes backlogged (its first
waiting request, or a seat of its own freed) its counter is lifted to the least counter
of the other backlogged tenants (``floor``, the last one seen where none is): service it
did not ask for while idle, or could not take while holding its share of the seats, is
not banked.  Where every tenant waiting in a class is at its seat share, they all count
as backlogged there, so the share alone never leaves a seat idle: with one class, the
shares of the tenants waiting add up to the seats the others leave, so every one of them
is at its share only when no seat is free.

Admission (``eligible_tenants``): a backlogged tenant may be admitted while its counter
is within ``quantum`` of the least counter among the tenants backlogged in the class,
DLPM's deficit idea (Cao et al., arXiv 2501.14312): inside that window the queue admits
in the tree's prefix order, the least served tenant first among requests sharing as much
(``FeatherQueue.rank_key``), and outside it no tenant gets ahead.  Quantum 0 is VTC's
rule (only the least served, ties aside).  The window is the tightest any backlogged
tenant ``f`` sets: no tenant more than ``Q_f = quantum_of(f)`` ahead of ``f`` is admitted,
``Q_f`` the quantum scaled by ``f``'s part of the recent service over its fair part
(``RecentService``; at most the whole quantum).  The quantum buys the tenants ahead
locality with the waits of those behind; a light tenant (an interactive one, a few
requests that share nothing) gains nothing from it, so it is held back by little more
than its own part.

The bound.  For tenants ``f`` and ``g`` backlogged throughout an interval in which only
one class has requests waiting (and none of theirs admitted over the share: by the
starvation backstop ``max_wait_s``, a STOP bound, or a path bypassing the queue), the
service they receive in it, each over its weight, differs by at most::

    2 * (Q + n * U)

``Q`` the quantum, ``U = INPUT_WEIGHT * L_in + OUTPUT_WEIGHT * L_out`` the most service
one request is charged (``L_in`` and ``L_out`` the longest prompt and output, a preempted
request's readmission and recomputation counted in), ``n`` the most requests one tenant
has running after an admission: it was below its seat share before, so ``n <= ceil(S *
w / W)`` (``w`` its weight, ``W`` the weight of the tenants waiting then: ``S / k`` for
``k`` equal tenants all waiting), and ``n <= S`` where the seats are unknown.  Why: the
least counter ``m`` of the backlogged tenants never decreases (counters only grow but
for a refund, which stops at the floor; a tenant leaving raises ``m``, a joiner is lifted
to it); a tenant is admitted only while backlogged and within ``Q`` of ``m``, and from
then its counter grows only by its running requests' service, the admission's charge
included, ``n * U`` at most, whether it stays backlogged or not; so every backlogged
counter stays within ``[m, m + Q + n * U]``, and the difference over an interval is that
of two such gaps.  A tenant's own quantum is at most ``Q``, so the window is never wider
than the bound's; and while ``f`` is backlogged no tenant more than ``Q_f`` ahead of it
is admitted in its class (the light tenant's guarantee: its requests go before another
tenant's once that one is ``Q_f`` ahead, however much that one's requests share).  VTC
states ``2 * max(w_p * L_in, w_q * M)`` (``M`` a batch's token capacity) for charging a
prompt whole at admission; charging it as it is computed is what lets the in-flight
term in, and the seat share is what makes ``n`` a share of the
seats rather than all of them.  The seat share is a guarantee of its own: while a tenant
below its share waits in the class, no tenant at its share is admitted there.

VTC itself (``fairness: vtc``) is this share at quantum 0, hit weight 1 and no seat share
(``shares_seats`` off), with ``TenantFifo``'s order in place of the tree's: the least
served tenant's oldest request next.

Preemption.  The share also says whom the engine preempts first: ``ranking`` orders the
tenants by counter, and the runtime's running order, whose end vLLM preempts and SGLang
retracts, puts the most served tenant's requests last in each class
(``FeatherRuntime.order``).  Preempting charges nobody, so the bound stands as stated.

Costs: ``charge``, ``admitted``, ``refund``, ``wait``, ``unwait``, ``run`` and ``unrun``
O(1) (a tenant's first waiting request O(backlogged tenants), for the lift);
``eligible_tenants``, ``least_served`` and ``eligible`` O(T), ``T`` the tenants with a
request running or waiting (the seat shares), O(tenants backlogged in the class) without
seats; ``ranking`` O(T log T).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Hashable, Mapping

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


class TenantShare:
    """Per-tenant service counters, backlog and seats, and the tenants the share admits."""

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
        self._service: dict[Tenant, float] = {}
        self._backlog: dict[int, dict[Tenant, int]] = {}
        """Per priority class, waiting requests of each tenant with one waiting there."""
        self._waiting: dict[Tenant, int] = {}
        """Waiting requests of each tenant with one waiting, all classes."""
        self._running: dict[Tenant, int] = {}
        """Running requests of each tenant with one running."""
        self._seated: set[Tenant] = set()
        """Waiting tenants at their seat share when last seen (``_seat``); not backlogged."""
        self.floor = 0.0
        """The least counter of the backlogged tenants as last seen (never decreases)."""
        self.recent = RecentService(RECENT_QUANTA * max(self.quantum, 1.0))
        """Each tenant's part of the recent service (``quantum_of``)."""

    def service(self, tenant: Tenant) -> float:
        """The tenant's counter: its weighted service so far (lifts included)."""
        return self._service.get(tenant, 0.0)

    def weight(self, tenant: Tenant) -> float:
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant: Tenant, computed_tokens: int, output_tokens: int) -> None:
        """The engine computed ``computed_tokens`` prompt tokens (recomputation included,
        cache hits not) and generated ``output_tokens`` tokens for the tenant: each
        computed token ``1 - hit_weight`` of ``INPUT_WEIGHT`` (the rest was charged at
        admission), each generated one ``OUTPUT_WEIGHT``."""
        cost = (1 - self.hit_weight) * INPUT_WEIGHT * computed_tokens + \
            OUTPUT_WEIGHT * output_tokens
        self._add(tenant, cost / self.weight(tenant))

    def admitted(self, tenant: Tenant, prompt_tokens: int) -> float:
        """A request of the tenant with ``prompt_tokens`` prompt tokens was admitted (again,
        after a preemption): ``hit_weight`` of its whole prompt.  Returns the charge,
        before the tenant's weight (what ``refund`` takes back)."""
        cost = self.hit_weight * INPUT_WEIGHT * prompt_tokens
        self._add(tenant, cost / self.weight(tenant))
        return cost

    def refund(self, tenant: Tenant, cost: float) -> None:
        """An admission charged ``cost`` (``admitted``) did not take effect: the engine
        did not run the request.  The counter goes back down, but not below the floor
        (where it was not already), so the least backlogged counter never decreases."""
        service = self.service(tenant)
        refunded = max(service - cost / self.weight(tenant), min(service, self.floor))
        self._service[tenant] = refunded
        self.recent.add(tenant, refunded - service)

    def _add(self, tenant: Tenant, weighted: float) -> None:
        self._service[tenant] = self.service(tenant) + weighted
        self.recent.add(tenant, weighted)

    def quantum_of(self, tenant: Tenant) -> float:
        """How far ahead of ``tenant``, while it is backlogged, another tenant may be
        admitted: ``quantum`` scaled by its recent part of the service over its fair
        part (``RecentService``), at most 1: the whole quantum for a tenant served its
        share or more, less for a lighter one, 0 for one not served lately.  The
        quantum lets the tenants ahead run what shares a prefix together; it is
        locality bought with the waits of those behind, and a light tenant (a few
        interactive requests that share nothing) has little to gain from it.  O(T)."""
        if not self.quantum:
            return 0.0
        active = max(1, len(self._running.keys() | self._waiting.keys()))
        return self.quantum * min(1.0, active * self.recent.part(tenant))

    # ---- backlog and seats ------------------------------------------------------------

    def wait(self, tenant: Tenant, priority: int = 0) -> None:
        """One more request of the tenant waits in class ``priority``."""
        if tenant not in self._waiting:
            self._raise_floor()
            self._service[tenant] = max(self.service(tenant), self.floor)
            self._waiting[tenant] = 0
        self._waiting[tenant] += 1
        backlog = self._backlog.setdefault(priority, {})
        backlog[tenant] = backlog.get(tenant, 0) + 1

    def unwait(self, tenant: Tenant, priority: int = 0) -> None:
        """A waiting request of the tenant in class ``priority`` stops waiting."""
        backlog = self._backlog[priority]
        backlog[tenant] -= 1
        if not backlog[tenant]:
            del backlog[tenant]
        self._waiting[tenant] -= 1
        if not self._waiting[tenant]:
            self._raise_floor()
            del self._waiting[tenant]
            self._seated.discard(tenant)

    def run(self, tenant: Tenant) -> None:
        """One more request of the tenant runs (holds a seat)."""
        self._running[tenant] = self._running.get(tenant, 0) + 1

    def unrun(self, tenant: Tenant) -> None:
        """A running request of the tenant stops running (finished, preempted, held)."""
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]

    def running(self, tenant: Tenant) -> int:
        """The tenant's running requests."""
        return self._running.get(tenant, 0)

    def ranking(self) -> dict[Tenant, int]:
        """The tenants with a request running or waiting, numbered by counter, the least
        served 0 (equal counters: the one first seen running, then waiting, first): the
        preemption order's tenants (``FeatherRuntime.order``).  O(T log T)."""
        tenants = sorted(dict.fromkeys([*self._running, *self._waiting]), key=self.service)
        return {tenant: place for place, tenant in enumerate(tenants)}

    def clear_backlog(self) -> None:
        """Nothing waits or runs any more (the queue was rebuilt); the counters stay."""
        self._backlog.clear()
        self._waiting.clear()
        self._running.clear()
        self._seated.clear()

    def seat_share(self, tenant: Tenant, seats: int) -> float:
        """A waiting tenant's seat share: the ``seats`` that tenants with nothing waiting
        do not hold, split by weight over the tenants with a request waiting.  O(T)."""
        return self._seats_per_weight(seats) * self.weight(tenant)

    def _seats_per_weight(self, seats: int) -> float:
        idle = sum(n for t, n in self._running.items() if t not in self._waiting)
        return (seats - idle) / sum(map(self.weight, self._waiting))

    def _seat(self, seats: int | None) -> None:
        """Bring the tenants at their seat share up to date (none without ``seats``): one
        that reaches it leaves the backlog, one that falls below it joins it again, lifted
        to the least counter of the others (as ``unwait`` and ``wait``).  O(T)."""
        seated: set[Tenant] = set()
        if seats is not None and self.shares_seats and self._running and self._waiting:
            per_weight = self._seats_per_weight(seats)
            seated = {t for t in self._waiting if self.running(t) >= per_weight * self.weight(t)}
        if seated == self._seated:
            return
        self._raise_floor()
        freed = self._seated - seated
        self._seated = seated
        self._raise_floor(excluded=freed)
        for tenant in freed:
            self._service[tenant] = max(self.service(tenant), self.floor)

    def _raise_floor(self, excluded: set[Tenant] | None = None) -> None:
        """The floor up to the least counter of the backlogged tenants (all classes), but
        ``excluded``; unchanged where there are none."""
        backlogged = [t for t in self._waiting
                      if t not in self._seated and not (excluded and t in excluded)]
        self.floor = max(self.floor, min(map(self.service, backlogged), default=0.0))

    # ---- admission --------------------------------------------------------------------

    def _backlogged(self, priority: int, seats: int | None) -> list[Tenant]:
        """The tenants backlogged in class ``priority``: waiting there, not at their seat
        share (all those waiting there where every one is)."""
        self._seat(seats)
        waiting = list(self._backlog.get(priority, ()))
        return [t for t in waiting if t not in self._seated] or waiting

    def least_served(self, priority: int = 0, seats: int | None = None) -> Tenant | None:
        """The backlogged tenant of class ``priority`` with the least counter (None: none
        is backlogged there); ``seats``: the engine's, for the seat share."""
        return min(self._backlogged(priority, seats), key=self.service, default=None)

    def eligible(self, tenant: Tenant, priority: int = 0, seats: int | None = None) -> bool:
        """Whether the share admits a request of ``tenant`` in class ``priority`` now:
        ``tenant`` among the ``eligible_tenants``, or nobody waiting there."""
        backlogged = self._backlogged(priority, seats)
        return not backlogged or tenant in self._window(backlogged)

    def eligible_tenants(self, priority: int = 0, seats: int | None = None) -> list[Tenant]:
        """The tenants the share admits now in class ``priority``: backlogged there with
        a counter within ``quantum`` of the least of them; ``seats``: the engine's, for
        the seat share (None: no seat share)."""
        return self._window(self._backlogged(priority, seats))

    def _window(self, backlogged: list[Tenant]) -> list[Tenant]:
        """The backlogged tenants no more than ``quantum_of`` any of them ahead of it
        (the least served always among them).  O(T)."""
        if not backlogged:
            return []
        limit = min(self.service(t) + self.quantum_of(t) for t in backlogged)
        return [tenant for tenant in backlogged if self.service(tenant) <= limit]


class RecentService:
    """Each tenant's part of the recent service: the service it was charged (weighted),
    decayed by half every ``half_life`` of service charged to all tenants, over the
    total so decayed.  Decayed by service, not time, so it reads the same on any engine;
    O(1) a charge (the decay is folded into a growing scale, rescaled now and then)."""

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self._scaled: dict[Tenant, float] = {}
        self._total = 0.0
        self._since = 0.0
        """Service charged since the scale was last reset."""

    def add(self, tenant: Tenant, service: float) -> None:
        """The tenant was charged ``service`` (negative: refunded)."""
        amount = service * 2.0 ** (self._since / self.half_life)
        scaled = max(self._scaled.get(tenant, 0.0) + amount, 0.0)
        self._total += scaled - self._scaled.get(tenant, 0.0)
        self._scaled[tenant] = scaled
        self._since += max(service, 0.0)
        if self._since > 64 * self.half_life:  # rescale before the scale overflows
            factor = 2.0 ** (-self._since / self.half_life)
            self._scaled = {t: v * factor for t, v in self._scaled.items() if v * factor > 1e-12}
            self._total = sum(self._scaled.values())
            self._since = 0.0

    def part(self, tenant: Tenant) -> float:
        """The tenant's part of the recent service, in [0, 1] (0 before any)."""
        return self._scaled.get(tenant, 0.0) / self._total if self._total > 0 else 0.0


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
