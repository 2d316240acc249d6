"""Feather's Prometheus metrics in multiprocess mode, collected as a server collects them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_metrics_reach_a_multiprocess_registry(tmp_path) -> None:
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, check=True, cwd=Path(__file__).parents[2])
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
