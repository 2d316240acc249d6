"""The package map's import rules (``feather_sched/__init__.py``), checked by import-linter
over the real import graph (``[tool.importlinter]`` in ``pyproject.toml``), and each rule
shown to fail on a copy of the package with one forbidden import added."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "src" / "feather_sched"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the project's contracts over the package found in ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"),
                           "--no-cache"], cwd=src, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_package_keeps_every_import_rule() -> None:
    result = lint_imports(ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "rule"), [
    ("core/cht.py", "import vllm", "Only the integrations and the drivers import an engine"),
    ("core/queue.py", "from feather_sched.sim import engine", "Layers"),
    ("core/runtime.py", "from feather_sched.bench import report", "Layers"),
    ("sim/engine.py", "from feather_sched.integrations.vllm import scheduler", "Layers"),
    ("routing/feather.py", "import ray", "Only the integrations and the drivers import an engine"),
    ("integrations/sglang/scheduler.py", "from feather_sched.core.cht import ChunkedHashTree",
     "Adapters use the core's public surface"),
    ("integrations/vllm/scheduler.py", "from feather_sched.gates.base import GateContext",
     "Adapters use the core's public surface"),
    ("workloads/spec.py", "from feather_sched.core.queue import FeatherQueue",
     "Workloads import the embedded model and core.tenants only"),
    ("results/summary.py", "from feather_sched.routing import router",
     "Results import telemetry, workloads and core.tenants only"),
    ("core/cht.py", "from feather_sched.core import queue", "No import cycles"),
    ("gates/step_model.py", "def lazy():\n    from feather_sched.gates import model",
     "No import cycles"),
])
def test_a_forbidden_import_breaks_its_rule(tmp_path: Path, module: str, line: str,
                                            rule: str) -> None:
    copy = tmp_path / "feather_sched"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}  # the forbidden import\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    broken = [row for row in result.stdout.splitlines() if "BROKEN" in row.split()]
    assert [row for row in broken if row.startswith(rule)], result.stdout
