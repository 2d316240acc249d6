"""TenantShare: VTC's counters over computed tokens, the lift of a returning tenant, and
the window of tenants the share admits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_sched.core.tenants import INPUT_WEIGHT, OUTPUT_WEIGHT, TenantShare


def test_service_is_weighted_tokens_over_the_tenants_weight() -> None:
    share = TenantShare({"gold": 2.0})
    share.charge("gold", computed_tokens=100, output_tokens=10)
    share.charge("free", computed_tokens=100, output_tokens=10)
    cost = INPUT_WEIGHT * 100 + OUTPUT_WEIGHT * 10
    assert share.service("gold") == cost / 2 and share.service("free") == cost


def test_only_tenants_within_the_quantum_of_the_least_served_are_admitted() -> None:
    share = TenantShare(quantum=100)
    for tenant in ("a", "b", "c"):
        share.wait(tenant)
    share.charge("a", 50, 0)
    share.charge("b", 101, 0)
    assert share.least_served() == "c"
    assert share.eligible_tenants() == ["a", "c"]
    assert share.eligible("a") and not share.eligible("b")
    share.unwait("c")  # c no longer waits: the window moves up to a
    assert share.eligible_tenants() == ["a", "b"]


def test_backlog_is_per_class() -> None:
    share = TenantShare(quantum=0)
    share.wait("a", priority=0)
    share.wait("b", priority=1)
    share.charge("a", 1000, 0)
    assert share.eligible_tenants(0) == ["a"] and share.least_served(1) == "b"
    assert share.least_served(2) is None and share.eligible("anyone", 2)


def test_a_tenant_that_returns_is_lifted_to_the_least_backlogged_counter() -> None:
    """Idle time banks no credit: otherwise a returning tenant would monopolise."""
    share = TenantShare()
    share.wait("busy")
    share.charge("busy", 5000, 0)
    share.wait("idle")
    assert share.service("idle") == 5000
    share.unwait("idle")
    share.unwait("busy")
    share.charge("busy", 100, 0)  # served after it stopped waiting: no floor moves
    share.wait("late")  # nobody waits: lifted to the floor last seen
    assert share.service("late") == 5000 == share.floor


def test_bad_weights_and_quanta_are_refused() -> None:
    with pytest.raises(ValueError, match="weight must be a positive number"):
        TenantShare({"a": 0})
    with pytest.raises(ValueError, match="quantum must be a non-negative"):
        TenantShare(quantum=-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 400), st.integers(0, 40)),
                min_size=1, max_size=300),
       st.integers(0, 2000))
def test_backlogged_counters_stay_within_the_stated_gap(jobs, quantum) -> None:
    """A work-conserving server of four always-backlogged tenants, one request at a time
    (n = 1), admitting by the share: every counter stays within Q + U of the least."""
    share = TenantShare(quantum=quantum)
    for tenant in range(4):
        share.wait(tenant)
    longest = 0.0
    for _, prompt, output in jobs:
        tenant = min(share.eligible_tenants(), key=lambda t: (-share.service(t), t))
        share.charge(tenant, prompt, output)  # the most served eligible: the worst case
        longest = max(longest, INPUT_WEIGHT * prompt + OUTPUT_WEIGHT * output)
        counters = [share.service(t) for t in range(4)]
        assert max(counters) - min(counters) <= quantum + longest
