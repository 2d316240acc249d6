"""The relay of a replica's Feather metrics to Ray: what it reads and what it records.

The end-to-end path (engine process -> directory -> Ray's Prometheus export) is in
``test_ray_serve.py``; here, the differ on real multiprocess files and on a restart.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from feather_sched.integrations.ray.metrics import Differ, ray_name

WRITE = """
import sys
from feather_sched.telemetry.prometheus import PrometheusSink
sink = PrometheusSink("test")
if sys.argv[1] == "first":
    sink.pass_ended(asked=3, add=2, stop=1, forced=0, admitted=[("t", 0.02), ("t", 0.3),
                    ("t", 200.0)],
                    groups=2, waiting=4, running=2)
    sink.scheduled(0.003)
else:
    sink.pass_ended(asked=1, add=1, stop=0, forced=0, admitted=[("t", 0.02)], groups=1,
                    waiting=0, running=1)
"""


def write(directory: Path, phase: str) -> None:
    """Feather's metrics written by another process, as vLLM's engine process does."""
    subprocess.run([sys.executable, "-c", WRITE, phase], check=True,
                   env={"PROMETHEUS_MULTIPROC_DIR": str(directory), "PATH": "/usr/bin:/bin"},
                   cwd=Path(__file__).parents[3])


def by_name(entries: list) -> dict:
    return {(name, tuple(sorted(labels.items()))): value for name, labels, value in entries}


def test_the_differ_turns_cumulative_files_into_increases_and_observations(tmp_path) -> None:
    collector = MultiProcessCollector(None, path=str(tmp_path))
    differ = Differ()
    write(tmp_path, "first")
    first = differ.changes(collector.collect())
    test = (("scheduler", "test"),)
    increases = by_name(first.increases)
    assert increases == {
        ("feather:gate_decisions", (("decision", "add"), *test)): 2.0,
        ("feather:gate_decisions", (("decision", "stop"), *test)): 1.0,
        ("feather:gate_questions", test): 3.0,
        ("feather:tenant_admissions", (*test, ("tenant", "t"))): 3.0,
    }
    assert by_name(first.values) == {("feather:num_requests_waiting", test): 4.0,
                                     ("feather:num_requests_running", test): 2.0}
    observed = by_name(first.observations)
    # each value lands in its own bucket; past the last bound (120 s), what the sum leaves
    assert observed[("feather:admission_deferral_seconds", test)] == pytest.approx(
        [0.03, 0.375, 200.32 - 0.03 - 0.375])
    assert observed[("feather:prefix_groups_per_step", test)] == [1.5]
    assert observed[("feather:schedule_seconds", test)] == pytest.approx([0.00375])
    assert first.bounds["feather:prefix_groups_per_step"][:3] == [1.0, 2.0, 3.0]

    write(tmp_path, "second")
    second = differ.changes(collector.collect())
    assert by_name(second.increases) == {
        ("feather:gate_decisions", (("decision", "add"), *test)): 1.0,
        ("feather:gate_questions", test): 1.0,
        ("feather:homogeneous_steps", test): 1.0,  # one group this time
        ("feather:tenant_admissions", (*test, ("tenant", "t"))): 1.0,
    }
    observed = by_name(second.observations)
    assert observed[("feather:admission_deferral_seconds", test)] == pytest.approx([0.03])
    assert observed[("feather:prefix_groups_per_step", test)] == [0.5]  # (0, 1]
    assert ("feather:schedule_seconds", test) not in observed  # nothing new


def test_a_counter_that_falls_counts_from_zero_again() -> None:
    """An engine process restarted: its counters start over."""
    def read(value: float) -> list:
        family = CounterMetricFamily("feather:gate_questions", "x", labels=["scheduler"])
        family.add_metric(["s"], value)
        return [family]

    differ = Differ()
    assert differ.changes(read(10)).increases == [("feather:gate_questions",
                                                   {"scheduler": "s"}, 10.0)]
    assert differ.changes(read(10)).increases == []
    assert differ.changes(read(3)).increases == [("feather:gate_questions",
                                                  {"scheduler": "s"}, 3.0)]


def test_names_become_what_rays_export_accepts() -> None:
    assert ray_name("feather:gate_decisions") == "feather_gate_decisions"
