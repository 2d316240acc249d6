"""This project's vLLM harness tests pass on the vLLM releases of ``.venv-drift`` (0.33 and
0.34, ``scripts/drift.sh``), each run in a subprocess; vLLM's own scheduler tests on each
release are ``test_releases.py``'s."""

from __future__ import annotations

import pytest

from tests.helpers.releases import DRIFT, RELEASES, drift_ready, run

pytest.importorskip("vllm", reason="the vllm extra is not installed")

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


@pytest.mark.parametrize("release", RELEASES)
def test_the_harness_tests_pass_on_the_release(release: str) -> None:
    drift_ready(release)
    done = run([DRIFT, "exec", release, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "-m", "not real_engine", *HARNESS], timeout=1200)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    assert " passed" in done.stdout.splitlines()[-1]
