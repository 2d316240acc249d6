"""Feather's Prometheus metrics in multiprocess mode, collected as a server collects them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from feather_sched.core.config import FeatherConfig
from feather_sched.gates.base import Decision
from tests.core.test_runtime import View, req
from feather_sched.core.runtime import FeatherRuntime

rt = FeatherRuntime(FeatherConfig(gate="always"), View(), clock=lambda: 5.0, name="test")
rt.meter.scheduled(0.002)
for r in (req("a0", 0), req("a1", 0), req("b0", 1)):
    rt.enter_waiting(r)
running = []
rt.begin_pass(running)
while (answer := rt.decide()) is not None and answer.decision is Decision.ADD:
    request = rt.request(answer.request_id)
    rt.admit(request)
    running.append(request)
rt.end_pass(1, running)
rt.enter_waiting(running[1])  # the engine preempted a1 (group 0 ran two)
rt.preempted(running[1])
rt.begin_pass([running[0], running[2]])
rt.discard("a1")
rt.discard("b0")
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(generate_latest(registry).decode())
"""


def multiprocess_env(directory: Path) -> dict[str, str]:
    """A child's environment: multiprocess mode in ``directory``, the same import path."""
    return {"PROMETHEUS_MULTIPROC_DIR": str(directory), "PATH": "/usr/bin:/bin",
            **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}


def test_metrics_reach_a_multiprocess_registry(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=multiprocess_env(tmp_path), check=True, cwd=Path(__file__).parents[2])
    text = done.stdout
    assert "# HELP feather:gate_decisions_total Admissions by outcome" in text
    assert 'feather:gate_decisions_total{decision="add",scheduler="test"} 3.0' in text
    assert 'feather:gate_questions_total{scheduler="test"} 3.0' in text
    assert 'feather:prefix_groups_per_step_count{scheduler="test"} 1.0' in text
    assert 'feather:num_requests_running{scheduler="test"} 3.0' in text
    assert 'feather:admission_deferral_seconds_sum{scheduler="test"} 15.0' in text
    assert 'feather:schedule_seconds_count{scheduler="test"} 1.0' in text
    assert 'feather:preemptions_total{priority="0",scheduler="test"} 1.0' in text
    assert 'feather:preempted_group_size_sum{scheduler="test"} 2.0' in text
    assert 'feather:request_preemptions_sum{scheduler="test"} 1.0' in text
    assert 'feather:request_preemptions_count{scheduler="test"} 2.0' in text


TENANT_SCRIPT = """
import sys
from types import SimpleNamespace
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from feather_sched.core.config import FeatherConfig
from feather_sched.core.runtime import FeatherRuntime
from feather_sched.gates.base import Decision
from tests.core.test_runtime import TenantReq, TenantView, req

config = FeatherConfig.from_sources({"gate": "always", "fairness": sys.argv[1],
                                     "max_tenant_labels": 2}, environ={})
rt = FeatherRuntime(config, TenantView(), clock=lambda: 4.0, name="test")
requests = [TenantReq(f"{tenant}{i}", req(f"{tenant}{i}", 0).keys, arrival=1.0,
                      priority=int(tenant == "c"), tenant=tenant)
            for tenant in "abc" for i in range(2)]
for request in requests:
    rt.enter_waiting(request)
running = []
rt.begin_pass(running)
while (answer := rt.decide()) is not None and answer.decision is Decision.ADD:
    running.append(rt.request(answer.request_id))
    rt.admit(running[-1])
rt.end_pass(1, running)
for request in running:
    rt.served(request.rid, computed_tokens=10, generated_tokens=1)
urgent = TenantReq("u", req("u", 1).keys, arrival=3.0, tenant="a")
rt.enter_waiting(urgent)
victim, = rt.urgent_victims(running, urgent, SimpleNamespace(made_by=bool))
assert victim.tenant == "c"
rt.preempted(victim, urgent=True)  # the engine preempts it
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(generate_latest(registry).decode())
"""


@pytest.mark.parametrize("fairness", ["tenants", "off"])
def test_tenant_series_name_at_most_the_cap_and_count_urgent_preemptions(
        tmp_path, fairness: str) -> None:
    """Six requests of three tenants, two tenant labels (the default tenant besides them),
    fair share on or off: the first two tenants seen are named, the third is ``other``;
    each admission, its wait and its service land on its tenant's series; an urgent
    preemption is counted by the victim's class."""
    done = subprocess.run([sys.executable, "-c", TENANT_SCRIPT, fairness], capture_output=True,
                          text=True, env=multiprocess_env(tmp_path), check=True,
                          cwd=Path(__file__).parents[2])
    text = done.stdout
    for tenant in ("a", "b", "other"):
        assert f'feather:tenant_admissions_total{{scheduler="test",tenant="{tenant}"}} 2.0' \
            in text
        assert ('feather:tenant_admission_deferral_seconds_sum'
                f'{{scheduler="test",tenant="{tenant}"}} 6.0') in text
        assert ('feather:tenant_service_tokens_total'
                f'{{scheduler="test",tenant="{tenant}"}} 24.0') in text
    assert 'tenant="c"' not in text
    assert 'feather:urgent_preemptions_total{priority="1",scheduler="test"} 1.0' in text


FRESH_SCRIPT = """
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from feather_sched.core.config import FeatherConfig
from feather_sched.core.runtime import FeatherRuntime
from tests.core.test_runtime import View

FeatherRuntime(FeatherConfig(gate="always"), View(), name="fresh")
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(generate_latest(registry).decode())
"""


def documented_series(kind: str | None = None) -> dict[str, str]:
    """The ``feather:`` series docs/metrics.md lists (of ``kind``, where given): name ->
    type."""
    table = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\| `(feather:[a-z_]+)` \| (counter|gauge|histogram) \|", table, re.M)
    return {name: type_ for name, type_ in rows if kind in (None, type_)}


def exposed_series(text: str, documented: dict[str, str]) -> set[str]:
    """Those of ``documented`` that ``text`` (a /metrics page) serves with HELP, TYPE and
    a sample."""
    found = set()
    for name, type_ in documented.items():
        sample = f"{name}_bucket{{" if type_ == "histogram" else f"{name}{{"
        if f"# HELP {name} " in text and f"# TYPE {name} {type_}" in text and \
                sample in text:
            found.add(name)
    return found


def test_a_fresh_scheduler_serves_every_documented_series_at_zero(tmp_path) -> None:
    """Before any request: every ``feather:`` series docs/metrics.md lists is on the
    registry with its HELP and TYPE, the counters at zero (the default tenant's
    per-tenant series, the preemptions of class 0, the faults of a pass's parts)."""
    done = subprocess.run([sys.executable, "-c", FRESH_SCRIPT], capture_output=True,
                          text=True, env=multiprocess_env(tmp_path), check=True,
                          cwd=Path(__file__).parents[2])
    documented = documented_series()
    assert len(documented_series("counter")) >= 8 and len(documented) >= 15
    assert exposed_series(done.stdout, documented) == set(documented)
    for counter in documented_series("counter"):
        values = re.findall(rf"^{counter}{{.*}} ([0-9.e+-]+)$", done.stdout, re.M)
        assert values and all(float(v) == 0 for v in values), counter
    assert 'feather:tenant_service_tokens_total{scheduler="fresh",tenant="default"} 0.0' \
        in done.stdout


SESSION_SCRIPT = """
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from feather_sched.core.sessions import TOOL_CALLS, RetentionConfig, Sessions
from feather_sched.telemetry.prometheus import SessionSink

sink = SessionSink("test")
sessions = Sessions(RetentionConfig(default_gap_s=2.0), 1000, lambda tokens: tokens * 1e-3)
for name in ("x", "y"):
    sessions.arrived(name + "0", "ns", ["sys", "sys/" + name], 0.0)
    sessions.turn_ended(name + "0", ["sys", "sys/" + name, "sys/" + name + "/o"], 3, 48,
                        1.0, TOOL_CALLS)
sessions.publish(sink)
sessions.arrived("y1", "ns", ["sys", "sys/y", "sys/y/o", "sys/y/o/t"], 2.0)
sessions.reclaim(1, 5.0, lapsed_only=True)  # x0 lapsed at 3.0: released
sessions.publish(sink)
sessions.publish(sink)  # nothing new: the counters stay
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(generate_latest(registry).decode())
"""


def test_session_series_follow_the_session_table(tmp_path) -> None:
    """Two sessions held (sharing a system block: 5 distinct blocks), one continues and
    finds its hold, the other's lapses and is released: the gauges show what is held at
    the last publish, the counters each event once however often it is published."""
    done = subprocess.run([sys.executable, "-c", SESSION_SCRIPT], capture_output=True,
                          text=True, env=multiprocess_env(tmp_path), check=True,
                          cwd=Path(__file__).parents[2])
    text = done.stdout
    assert 'feather:sessions_held{scheduler="test"} 1.0' in text
    assert 'feather:session_blocks_held{scheduler="test"} 3.0' in text
    for event, count in (("held", 2), ("reloads_avoided", 1), ("expired", 1),
                         ("refused", 0), ("displaced", 0)):
        assert f'feather:session_events_total{{event="{event}",scheduler="test"}} ' \
            f'{count:.1f}' in text
