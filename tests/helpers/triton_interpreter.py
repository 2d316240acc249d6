"""vLLM's Triton kernels in Triton's CPU interpreter, for tests on a machine without a GPU.

The interpreter takes over only if TRITON_INTERPRET=1 is set before Triton is first
imported, so such tests run in a fresh pytest process (``run_interpreted``).  vLLM's CPU
wheel turns Triton off where Triton has no CPU backend, leaving its kernels undecorated;
``keep_vllm_triton_on`` registers a stand-in entry (its driver is never used: the
interpreter needs none) and must run before vLLM first imports Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).parents[2]


class _NoDriver:
    @staticmethod
    def is_active() -> bool:
        return False


def keep_vllm_triton_on() -> None:
    assert "vllm.triton_utils" not in sys.modules, "vLLM already decided on Triton"
    from triton.backends import Backend, backends

    backends.setdefault("cpu", Backend(compiler=None, driver=_NoDriver))


def with_vllm_triton_on(factory: str, kwargs: dict) -> object:
    """A self-check subject factory for a child process under the interpreter
    (``isolation.Recipe``): vLLM's Triton kept on, then ``factory(**kwargs)``."""
    from feather_sched.attention.isolation import resolve

    keep_vllm_triton_on()
    return resolve(factory)(**kwargs)


def only_interpreted(starter: str) -> Callable[[Callable], Callable]:
    """A decorator for a test that runs only under the interpreter: marked
    ``interpreted`` (what ``run_interpreted`` selects) and skipped elsewhere, naming
    ``starter``, the test that starts that process."""
    skip = pytest.mark.skipif(not INTERPRETED,
                              reason=f"run by the fresh process that {starter} starts")
    return lambda test: pytest.mark.interpreted(skip(test))


def run_interpreted(*node_ids: str) -> subprocess.CompletedProcess:
    """The ``interpreted`` tests of ``pytest node_ids`` in a fresh process under
    TRITON_INTERPRET=1 (the file's other tests ran in this one already)."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "interpreted",
         *node_ids],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True,
        text=True, timeout=600)
