"""The real SGLang server with Feather, measured by feather bench (CPU, tiny model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from feather_sched.bench.sglang_policy import sglang_available
from feather_sched.cli import app
from tests.conftest import STAND_INS
from tests.test_serve import free_port, wait_until_serving

reason = sglang_available()
if reason:
    pytest.skip(reason, allow_module_level=True)

from feather_sched.models import TINY_LLAMA  # noqa: E402


def test_sglang_server_runs_feather_and_answers_feather_bench(tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STAND_INS), *sys.path])}
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "feather_sched.integrations.sglang_launch",
             "--model-path", str(TINY_LLAMA), "--device", "cpu", "--load-format", "dummy",
             "--skip-tokenizer-init", "--attention-backend", "torch_native",
             "--host", "127.0.0.1", "--port", str(port), "--schedule-policy", "feather",
             "--feather-options", '{"gate": "bandit"}'],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_until_serving(url, server, timeout_s=240)
            out = tmp_path / "sglang.json"
            result = CliRunner().invoke(app, [
                "bench", "--base-url", url, "--api", "sglang", "--groups", "2",
                "--prompts-per-group", "3", "--prefix-len", "256", "--output-len", "5",
                "--label", "sglang-feather", "--json", str(out)], env={"COLUMNS": "200"})
            assert result.exit_code == 0, result.output
            summary = json.loads(out.read_text())["runs"]["sglang-feather"]
            assert summary["completed"] == 6 and summary["total_output_tokens"] == 30
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    assert "Feather scheduling policy" in log_path.read_text()
