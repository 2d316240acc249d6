"""Test-wide set-up: SGLang's scheduler code imports on this CPU machine as in the product
(``feather_sched.integrations.sglang.stand_ins``); a fault Feather contains fails the test
that did not ask for faults, so containment never hides a bug."""

from __future__ import annotations

import gc
import os
import tempfile

import pytest

from feather_sched.core.faults import FaultGuard
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

prepare_sglang_import()
# The attention self-check's verdicts: one cache for the session (each engine after the
# first with the same shapes starts without measuring), never the user's ~/.cache.
os.environ["FEATHER_CACHE_DIR"] = tempfile.mkdtemp(prefix="feather-cache-")


@pytest.fixture
def contained_faults() -> list[tuple[str, Exception]]:
    """The faults Feather contained during the test (``FaultGuard.fault``: where, what),
    in order; a test that asks for this fixture may have them."""
    return []


@pytest.fixture(autouse=True)
def _contained_faults_fail_the_test(request: pytest.FixtureRequest,
                                    monkeypatch: pytest.MonkeyPatch):
    allowed = "contained_faults" in request.fixturenames
    seen = request.getfixturevalue("contained_faults") if allowed else []
    original = FaultGuard.fault

    def recording(guard: FaultGuard, where: str, error: Exception) -> None:
        seen.append((where, error))
        original(guard, where, error)

    monkeypatch.setattr(FaultGuard, "fault", recording)
    yield
    if seen and not allowed:
        pytest.fail(f"Feather contained {len(seen)} fault(s), the first in {seen[0][0]}: "
                    f"{seen[0][1]!r}")


@pytest.fixture(autouse=True, scope="module")
def _engines_of_a_module_end_with_it():
    """Shut down the in-process vLLM engines a test module dropped, once it is done
    (``tests/helpers/vllm_engines``): frozen garbage otherwise, shut down by a later
    collection under another module's live engine (seen with pytest-xdist, where a
    worker runs the files in another order)."""
    yield
    gc.unfreeze()
    gc.collect()
