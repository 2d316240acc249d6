"""Scheduler names: parsed once, with errors that list what is valid where."""

from __future__ import annotations

import pytest

from feather_sched.scheduler_names import (
    ENGINE_KINDS,
    SIM_KINDS,
    SchedulerKind,
    parse_scheduler,
    parse_schedulers,
)


def test_feather_names_carry_gate_and_order() -> None:
    name = parse_scheduler("feather-chunk-loss-noorder")
    assert (name.kind, name.gate, name.order_running) == (SchedulerKind.FEATHER, "chunk-loss",
                                                          False)
    assert name.feather_options({"max_wait_s": 5}) == {
        "max_wait_s": 5, "gate": "chunk-loss", "order_running": False}
    assert parse_scheduler("feather-bandit").order_running
    unbounded = parse_scheduler("feather-always-noorder-unbounded")
    assert (unbounded.gate, unbounded.order_running, unbounded.bounded) == ("always", False,
                                                                            False)
    assert unbounded.feather_options({})["max_overtakes"] is None
    assert "max_overtakes" not in parse_scheduler("feather-always").feather_options({})
    assert unbounded.feather_options({})["max_stops"] is None


def test_fair_share_and_vtc_have_names() -> None:
    fair = parse_scheduler("feather-model-unbounded-fair")
    assert (fair.gate, fair.bounded, fair.fair) == ("model", False, True)
    assert fair.feather_options({})["fairness"] == "tenants"
    assert "fairness" not in parse_scheduler("feather-model").feather_options({})
    for context in (ENGINE_KINDS, SIM_KINDS):
        assert parse_scheduler("vtc", context).kind is SchedulerKind.VTC
    assert not parse_scheduler("vtc").priority_policy(2)
    assert parse_scheduler("vtc").feather_options({"gate": "bandit"}) == {
        "gate": "bandit", "fairness": "vtc"}  # Feather's runtime; the gate does not apply
    assert parse_scheduler("vtc-noshared").feather_options({})[
        "shared_prefix_attention"] == "off"
    with pytest.raises(ValueError, match="unknown scheduler"):
        parse_scheduler("feather-model-fair-unbounded")


def test_each_context_accepts_only_what_it_can_run() -> None:
    assert [n.kind for n in parse_schedulers("fcfs, fcfs-nocache,feather-always",
                                             ENGINE_KINDS)] == [
        SchedulerKind.FCFS, SchedulerKind.FCFS_NOCACHE, SchedulerKind.FEATHER]
    with pytest.raises(ValueError, match=r"unknown scheduler 'sglang-lpm': use fcfs, "
                                         r"fcfs-nocache, priority, vtc, "
                                         r"vllm-active-cap\[-CAP\], feather-"):
        parse_scheduler("sglang-lpm", ENGINE_KINDS)
    with pytest.raises(ValueError, match="unknown scheduler 'fcfs-nocache'"):
        parse_scheduler("fcfs-nocache", SIM_KINDS)


def test_priority_names_the_engines_priority_policy_and_feather_follows_the_workload() -> None:
    for context in (ENGINE_KINDS, SIM_KINDS):
        assert parse_scheduler("priority", context).kind is SchedulerKind.PRIORITY
    assert parse_scheduler("priority-shared", ENGINE_KINDS).shared_prefix
    runs = {name: parse_scheduler(name) for name in
            ("priority", "feather-model", "feather-always-noorder", "fcfs", "sglang-lpm")}
    assert {n: r.priority_policy(2) for n, r in runs.items()} == {
        "priority": True, "feather-model": True, "feather-always-noorder": True,
        "fcfs": False, "sglang-lpm": False}
    assert {n: r.priority_policy(1) for n, r in runs.items()} == {
        "priority": True, "feather-model": False, "feather-always-noorder": False,
        "fcfs": False, "sglang-lpm": False}
    with pytest.raises(ValueError, match="unknown scheduler 'priority-model'"):
        parse_scheduler("priority-model")


@pytest.mark.parametrize("bad", ["feather-greedy", "feather-", "lifo", "feather-bandit-order",
                                 "feather-bandit-unbounded-noorder"])
def test_bad_names_fail(bad: str) -> None:
    with pytest.raises(ValueError, match=f"unknown scheduler '{bad}'"):
        parse_scheduler(bad)


def test_an_empty_list_fails() -> None:
    with pytest.raises(ValueError, match="no scheduler given"):
        parse_schedulers(" , ")
    with pytest.raises(ValueError, match="sglang-lpm"):
        parse_scheduler("feather-feather")


def test_any_name_may_turn_shared_prefix_attention_on_or_off() -> None:
    assert parse_scheduler("fcfs").shared_prefix is None
    shared = parse_scheduler("fcfs-shared", ENGINE_KINDS)
    assert (shared.kind, shared.shared_prefix) == (SchedulerKind.FCFS, True)
    assert shared.attention_options() == {"shared_prefix_attention": "on"}
    plain = parse_scheduler("feather-model-noorder-noshared")
    assert (plain.gate, plain.order_running, plain.shared_prefix) == ("model", False, False)
    assert plain.feather_options({})["shared_prefix_attention"] == "off"
    assert "shared_prefix_attention" not in parse_scheduler("feather-model").feather_options({})


@pytest.mark.parametrize("bad", ["fcfs-shared-noshared", "feather-model-shared-noorder",
                                 "feather-shared"])
def test_the_attention_suffix_comes_last_and_once(bad: str) -> None:
    with pytest.raises(ValueError, match=f"unknown scheduler '{bad}'"):
        parse_scheduler(bad)
