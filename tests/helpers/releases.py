"""Subprocesses of tests run against a vLLM release from ``scripts/drift.sh``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIFT = REPO / "scripts" / "drift.sh"
RELEASES = ("0.33.0", "0.34.0")
"""The releases in .venv-drift (0.32.0 is this environment's)."""


def prelude() -> str:
    """Python source a test's subprocess runs first: under ``scripts/drift.sh exec`` (its
    pytest plugin ``feather_release`` loaded here), the plugin's patch of vLLM's CPU
    platform, so the child builds configs as the tests do; elsewhere nothing."""
    if "feather_release" not in sys.modules:
        return ""
    return "import feather_release; feather_release.pytest_configure(None)\n"


def drift_ready(release: str) -> None:
    """Fails the test unless ``release`` is built in .venv-drift."""
    if not (REPO / ".venv-drift" / "releases" / release / "vllm").is_dir():
        pytest.fail(f"vLLM {release} is not in .venv-drift: run scripts/setup.sh --drift "
                    "(make test does)")


def run(command: list, timeout: int) -> subprocess.CompletedProcess:
    """``command`` from the repository root, its output captured, under this Python."""
    return subprocess.run([str(part) for part in command], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable})
