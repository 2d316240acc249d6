"""Subprocesses of tests run against a vLLM release from ``scripts/drift.sh``."""

from __future__ import annotations

import sys


def prelude() -> str:
    """Python source a test's subprocess runs first: under ``scripts/drift.sh exec`` (its
    pytest plugin ``feather_release`` loaded here), the plugin's patch of vLLM's CPU
    platform, so the child builds configs as the tests do; elsewhere nothing."""
    if "feather_release" not in sys.modules:
        return ""
    return "import feather_release; feather_release.pytest_configure(None)\n"
