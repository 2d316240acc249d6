"""Fair share between tenants: a virtual service counter per tenant, a share of the
engine's seats, and which tenants may be admitted from now; and what a tenant id is.

The counter is VTC's (Sheng et al., OSDI'24): a tenant's service is ``INPUT_WEIGHT``
per prompt token the engine computed for it plus ``OUTPUT_WEIGHT`` per token it
generated, over the tenant's weight (``charge``).  Only computed tokens count: a
prefix-cache hit costs the tenant nothing, so a tenant whose requests share a prefix
pays for it once.

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
rule (only the least served, ties aside).

The bound.  For tenants ``f`` and ``g`` backlogged throughout an interval in which only
one class has requests waiting (and none of theirs admitted over the share: by the
starvation backstop ``max_wait_s``, a STOP bound, or a path bypassing the queue), the
service they receive in it, each over its weight, differs by at most::

    2 * (Q + n * U)

``Q`` the quantum, ``U = INPUT_WEIGHT * L_in + OUTPUT_WEIGHT * L_out`` the most service
one request receives (``L_in`` and ``L_out`` the longest prompt and output, a preempted
request's recomputation counted in), ``n`` the most requests one tenant has running after
an admission: it was below its seat share before, so ``n <= ceil(S * w / W)`` (``w`` its
weight, ``W`` the weight of the tenants waiting then: ``S / k`` for ``k`` equal tenants
all waiting), and ``n <= S`` where the seats are unknown.  Why: the least counter ``m``
of the backlogged tenants never decreases (counters only grow, a tenant leaving raises
it, a joiner is lifted to it); a tenant is admitted only while backlogged and within
``Q`` of ``m``, and after its last admission its counter grows only by its running
requests' service, ``n * U`` at most, whether it stays backlogged or not; so every
backlogged counter stays within ``[m, m + Q + n * U]``, and the difference over an
interval is that of two such gaps.  VTC states ``2 * max(w_p * L_in, w_q * M)`` (``M`` a
batch's token capacity) for charging a prompt whole at admission; charging computed
tokens as they are computed is what lets the in-flight term in, and the seat share is
what makes ``n`` a share of the seats rather than all of them.  The seat share is a
guarantee of its own: while a tenant below its share waits in the class, no tenant at
its share is admitted there.

Costs: ``charge``, ``wait``, ``unwait``, ``run`` and ``unrun`` O(1) (a tenant's first
waiting request O(backlogged tenants), for the lift); ``eligible_tenants``,
``least_served`` and ``eligible`` O(T), ``T`` the tenants with a request running or
waiting (the seat shares), O(tenants backlogged in the class) without seats.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping

Tenant = Hashable

DEFAULT_TENANT = "default"
"""The tenant of a request that names none."""
MAX_TENANT_CHARS = 256
"""The longest tenant id (a hashed e-mail address or a UUID fits)."""
TENANT_HEADER = "x-tenant-id"
"""The HTTP header in which a gateway names a request's tenant."""
TENANT_ARG = "tenant"
"""The key of a request's tenant among its engine arguments: vLLM's
``SamplingParams.extra_args`` (an OpenAI body's ``vllm_xargs``)."""
INPUT_WEIGHT = 1.0
"""Service per computed prompt token (VTC's ``w_p``)."""
OUTPUT_WEIGHT = 2.0
"""Service per generated token (VTC's ``w_q``: a decode token costs about twice)."""
DEFAULT_QUANTUM_TOKENS = 16384
"""How far (in weighted tokens) a tenant may get ahead of the least served one while the
prefix order picks it: a few requests' worth, so a group's members still run together."""


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


def named_tenant(header: str | None, engine_args: object, user: object) -> str | None:
    """The tenant an HTTP request names, parsed (``parse_tenant``): the ``x-tenant-id``
    ``header`` (a gateway's word) wins, then ``TENANT_ARG`` of the body's
    ``engine_args`` (vLLM's ``vllm_xargs``; where it is a mapping), then OpenAI's ``user``
    field (where not empty); None where the request names none (``DEFAULT_TENANT``'s).
    Only the value chosen is parsed, so a client's odd ``user`` does not fail a request
    its gateway named.  ValueError for a bad value.  O(1) plus the parse."""
    if header is not None:
        return parse_tenant(header, f"the {TENANT_HEADER} header")
    if isinstance(engine_args, Mapping) and engine_args.get(TENANT_ARG) is not None:
        return parse_tenant(engine_args[TENANT_ARG], f"vllm_xargs.{TENANT_ARG}")
    if user is not None and user != "":
        return parse_tenant(user, "user")
    return None


class TenantShare:
    """Per-tenant service counters, backlog and seats, and the tenants the share admits."""

    def __init__(self, weights: Mapping[Tenant, float] | None = None,
                 quantum: float = DEFAULT_QUANTUM_TOKENS) -> None:
        """``weights``: a tenant's share relative to others (a tenant not named: 1);
        ``quantum``: in weighted tokens, non-negative."""
        weights = dict(weights or {})
        for tenant, weight in weights.items():
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
                raise ValueError(f"tenant {tenant!r}: weight must be a positive number, "
                                 f"got {weight!r}")
        if not (math.isfinite(quantum) and quantum >= 0):
            raise ValueError(f"quantum must be a non-negative number, got {quantum!r}")
        self.weights = weights
        self.quantum = float(quantum)
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

    def service(self, tenant: Tenant) -> float:
        """The tenant's counter: its weighted service so far (lifts included)."""
        return self._service.get(tenant, 0.0)

    def weight(self, tenant: Tenant) -> float:
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant: Tenant, computed_tokens: int, output_tokens: int) -> float:
        """The engine computed ``computed_tokens`` prompt tokens (recomputation included,
        cache hits not) and generated ``output_tokens`` tokens for the tenant; returns
        the service that is (``service_of``), before the tenant's weight."""
        cost = service_of(computed_tokens, output_tokens)
        self._service[tenant] = self.service(tenant) + cost / self.weight(tenant)
        return cost

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
        if seats is not None and self._running and self._waiting:
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
        if not backlogged:
            return []
        limit = min(map(self.service, backlogged)) + self.quantum
        return [tenant for tenant in backlogged if self.service(tenant) <= limit]
