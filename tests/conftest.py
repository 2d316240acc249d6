"""Test-wide set-up: SGLang's scheduler code imports on this CPU machine as in the product
(``feather_sched.integrations.sglang.stand_ins``); a fault Feather contains fails the test
that did not ask for faults, so containment never hides a bug; the modules that start an
engine process are marked ``engine`` (and the tests that start one in other modules), and
the tests of minutes each ``slow`` (``make check`` runs every other test, ``make test``
all)."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import pytest

from feather_sched.core.faults import FaultGuard
from feather_sched.integrations.sglang.stand_ins import prepare_sglang_import

prepare_sglang_import()
# The attention self-check's verdicts: one cache for the session (each engine after the
# first with the same shapes starts without measuring), never the user's ~/.cache.
os.environ["FEATHER_CACHE_DIR"] = tempfile.mkdtemp(prefix="feather-cache-")


ENGINE_MODULES = frozenset({
    "bench/test_offline.py",  # a real vLLM engine per scheduler
    "bench/test_soak.py",  # a real feather serve under load and a restart
    "bench/test_trace_replay.py",  # a trace replayed on the real vLLM engine
    "integrations/ray/test_serve.py",  # Ray Serve with vLLM replicas
    "integrations/sglang/test_attention_server.py",  # an SGLang server
    "integrations/sglang/test_server.py",
    "integrations/sglang/test_tenants_server.py",
    "integrations/vllm/test_attention.py",  # vLLM engines (LLM), Feather's backend on/off
    "integrations/vllm/test_batch_order.py",  # the order's effect in a real engine
    "integrations/vllm/test_engine.py",
    "integrations/vllm/test_kv_events.py",
    "integrations/vllm/test_releases.py",  # pytest processes against each release (.venv-drift)
    "integrations/vllm/test_releases_harness.py",
    "integrations/vllm/test_urgent.py",
    "test_serve.py",  # feather serve's real servers
})
"""Test modules (relative to ``tests/``) that start an engine process: marked ``engine``,
so ``pytest -m "not engine"`` (``make check``) runs the rest."""

ENGINE_TESTS = frozenset({
    # `feather attention-check --end-to-end`: two vLLM CPU engines, the path on and off
    "integrations/vllm/test_attention_proof.py::"
    "test_the_cpu_engine_gives_the_same_tokens_with_the_path_on_and_off",
    # a plain vLLM engine run in a process without Feather's core
    "integrations/vllm/test_backends.py::"
    "test_without_feathers_core_a_plain_vllm_engine_still_runs",
})
"""Tests (ids relative to ``tests/``) that start an engine process in modules that
otherwise start none: marked ``engine`` too."""

SLOW_TESTS = frozenset({
    # a kernel's whole case set in Triton's CPU interpreter (one process each)
    "attention/test_triton_kernels.py::test_kernels_in_the_triton_interpreter",
    "integrations/sglang/test_attention_triton.py::test_kernels_in_the_triton_interpreter",
    "integrations/vllm/test_attention_gpu.py::"
    "test_forward_and_self_check_in_the_triton_interpreter",
    "test_gpu_decode_kit.py::test_the_self_check_runs_in_the_kit[present]",
})
"""Tests (ids relative to ``tests/``) of minutes each on a 2-core CPU: marked ``slow``,
left to ``make test``.  ``make check`` keeps a sample of each engine's interpreted
kernels: ``attention/test_gpu_decode.py`` and the kit's, ``integrations/vllm/
test_host_tables.py``, ``integrations/sglang/test_attention_triton.py``'s sample."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    missing = sorted(name for name in ENGINE_MODULES if not (tests / name).is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py's ENGINE_MODULES names no module: {missing}")
    for item in items:
        module = item.path.relative_to(tests).as_posix()
        if module in ENGINE_MODULES or f"{module}::{item.name}" in ENGINE_TESTS:
            item.add_marker(pytest.mark.engine)
        if f"{module}::{item.name}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    modules = {item.path.relative_to(tests).as_posix(): item.module for item in items
               if isinstance(item, pytest.Function)}
    stale = sorted(name for name in ENGINE_TESTS | SLOW_TESTS
                   if name.split("::")[0] in modules and
                   not hasattr(modules[name.split("::")[0]], name.split("::")[1].split("[")[0]))
    if stale:
        raise pytest.UsageError(f"tests/conftest.py's ENGINE_TESTS/SLOW_TESTS name no test: "
                                f"{stale}")


@pytest.fixture
def self_check_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines' self-check in this process, where a test's patches of its subject hold
    (on an AMX CPU the engines run it in a child: ``tests/attention/test_isolation.py``)."""
    from feather_sched.attention import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "tiles_need_isolation", lambda: False)


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
