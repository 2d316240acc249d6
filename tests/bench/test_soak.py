"""The soak benchmark, short: a real feather serve under cancellations, preemption, bad
requests and a SIGTERM restart loses no request and ends idle (benchmarks/soak)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

SOAK = Path(__file__).parents[2] / "benchmarks" / "soak" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_short_soak_passes_every_check(tmp_path) -> None:
    soak = load_soak()
    figures = soak.soak(seconds=12, clients=12, workdir=tmp_path)
    assert figures["sent"] > 40 and figures["cancelled"] > 0 and figures["rejected"] > 0
    failed = [name for name, passed in figures["checks"].items() if not passed]
    assert not failed, (failed, {k: v for k, v in figures.items() if k != "checks"})
