"""Fair share between tenants: a virtual service counter per tenant, and which tenants
may be admitted from now.

The counter is VTC's (Sheng et al., OSDI'24): a tenant's service is ``INPUT_WEIGHT``
per prompt token the engine computed for it plus ``OUTPUT_WEIGHT`` per token it
generated, over the tenant's weight (``charge``).  Only computed tokens count: a
prefix-cache hit costs the tenant nothing, so a tenant whose requests share a prefix
pays for it once.  A tenant is *backlogged* in a priority class while one of its
requests waits in it (``wait``/``unwait``).  When a tenant becomes backlogged its counter
is lifted to the least counter of the backlogged tenants (``floor``): service it did not
ask for while idle is not banked.

Admission (``eligible``): a backlogged tenant may be admitted while its counter is
within ``quantum`` of the least counter among the tenants backlogged in the class,
DLPM's deficit idea (Cao et al., arXiv 2501.14312): inside that window the queue admits
in the tree's prefix order, outside it no tenant gets ahead.  Quantum 0 is VTC's rule
(only the least served, ties aside).

The bound.  For tenants ``f`` and ``g`` backlogged in one class throughout an interval
(no more urgent request waiting, no request of theirs admitted over the share: by the
starvation backstop ``max_wait_s``, a STOP bound, or a path bypassing the queue), the
service they receive in it, each over its weight, differs by at most::

    2 * (Q + n * U)

``Q`` the quantum, ``U = INPUT_WEIGHT * L_in + OUTPUT_WEIGHT * L_out`` the most service
one request receives (``L_in`` and ``L_out`` the longest prompt and output, a preempted
request's recomputation counted in), ``n`` the most requests one tenant has running at
once (at most the engine's seats).  Why: a tenant is admitted only while its counter is
within ``Q`` of the least backlogged one, which never decreases (counters only grow,
joiners are lifted to it); after its last admission its counter grows only by its
running requests' service, ``n * U`` at most; so every backlogged counter stays within
``Q + n * U`` of the least, and the difference over an interval is that of two such
gaps.  VTC states ``2 * max(w_p * L_in, w_q * M)`` (``M`` a batch's token capacity) for
charging a prompt whole at admission; charging computed tokens as they are computed is
what lets the in-flight term in.

Costs: ``charge``, ``wait`` and ``unwait`` O(1) (a tenant's first waiting request
O(backlogged tenants), for the lift); ``eligible`` and ``least_served`` O(tenants
backlogged in the class).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping

Tenant = Hashable

DEFAULT_TENANT = "default"
"""The tenant of a request whose engine names none."""
INPUT_WEIGHT = 1.0
"""Service per computed prompt token (VTC's ``w_p``)."""
OUTPUT_WEIGHT = 2.0
"""Service per generated token (VTC's ``w_q``: a decode token costs about twice)."""
DEFAULT_QUANTUM_TOKENS = 16384
"""How far (in weighted tokens) a tenant may get ahead of the least served one while the
prefix order picks it: a few requests' worth, so a group's members still run together."""


class TenantShare:
    """Per-tenant service counters and backlog, and the tenants the share admits now."""

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
        """Per priority class, waiting requests of each backlogged tenant."""
        self._waiting: dict[Tenant, int] = {}
        """Waiting requests of each backlogged tenant, all classes."""
        self.floor = 0.0
        """The least counter of the backlogged tenants as last seen (never decreases)."""

    def service(self, tenant: Tenant) -> float:
        """The tenant's counter: its weighted service so far (lifts included)."""
        return self._service.get(tenant, 0.0)

    def weight(self, tenant: Tenant) -> float:
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant: Tenant, computed_tokens: int, output_tokens: int) -> None:
        """The engine computed ``computed_tokens`` prompt tokens (recomputation included,
        cache hits not) and generated ``output_tokens`` tokens for the tenant."""
        cost = INPUT_WEIGHT * computed_tokens + OUTPUT_WEIGHT * output_tokens
        self._service[tenant] = self.service(tenant) + cost / self.weight(tenant)

    # ---- backlog ----------------------------------------------------------------------

    def wait(self, tenant: Tenant, priority: int = 0) -> None:
        """One more request of the tenant waits in class ``priority``."""
        if tenant not in self._waiting:
            self.floor = max(self.floor, min(map(self.service, self._waiting), default=0.0))
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
            self.floor = max(self.floor, min(map(self.service, self._waiting)))
            del self._waiting[tenant]

    def clear_backlog(self) -> None:
        """Nothing waits any more (the queue was rebuilt); the counters stay."""
        self._backlog.clear()
        self._waiting.clear()

    # ---- admission --------------------------------------------------------------------

    def least_served(self, priority: int = 0) -> Tenant | None:
        """The backlogged tenant of class ``priority`` with the least counter (None: none
        is backlogged there)."""
        return min(self._backlog.get(priority, ()), key=self.service, default=None)

    def eligible(self, tenant: Tenant, priority: int = 0) -> bool:
        """Whether the share admits a request of ``tenant`` in class ``priority`` now:
        its counter within ``quantum`` of the least backlogged one's in the class."""
        least = self.least_served(priority)
        return least is None or self.service(tenant) <= self.service(least) + self.quantum

    def eligible_tenants(self, priority: int = 0) -> list[Tenant]:
        """The backlogged tenants of class ``priority`` the share admits now."""
        backlog = self._backlog.get(priority, {})
        if not backlog:
            return []
        limit = min(map(self.service, backlog)) + self.quantum
        return [tenant for tenant in backlog if self.service(tenant) <= limit]
