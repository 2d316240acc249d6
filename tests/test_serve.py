"""feather serve: the command it builds, and a real server measured by feather bench."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from typer.testing import CliRunner

from feather_sched.cli import app
from feather_sched.serve import SCHEDULER_CLS, vllm_server_command


def test_command_merges_feather_options_into_additional_config() -> None:
    command = vllm_server_command(None, {"gate": "bandit"},
                                  ["--additional-config", '{"other": 1}', "--port", "9"])
    config = json.loads(command[command.index("--additional-config") + 1])
    assert config == {"other": 1, "feather": {"gate": "bandit"}}
    assert command[command.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    assert command[-2:] == ["--port", "9"] and "--load-format" in command


def test_bad_options_fail_before_the_server_starts() -> None:
    with pytest.raises(ValueError, match="feather option 'gate'"):
        vllm_server_command(None, {"gate": "sometimes"}, [])
    with pytest.raises(ValueError, match="sets --scheduler-cls itself"):
        vllm_server_command(None, {}, ["--scheduler-cls", "x.Y"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_serving(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"no server at {url} after {timeout_s} s")


def test_feather_serve_answers_feather_bench(tmp_path) -> None:
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "feather_sched.cli", "serve", "--gate", "bandit",
         "--host", "127.0.0.1", "--port", str(port), "--enforce-eager"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until_serving(url, server, timeout_s=240)
        out = tmp_path / "server.json"
        result = CliRunner().invoke(app, [
            "bench", "--base-url", url, "--groups", "2", "--prompts-per-group", "3",
            "--prefix-len", "256", "--output-len", "5", "--max-concurrency", "4",
            "--label", "feather-server", "--json", str(out)], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        summary = json.loads(out.read_text())["runs"]["feather-server"]
        assert summary["completed"] == 6 and summary["total_output_tokens"] == 30
        assert summary["prefix_cache_hit_rate"] > 0.3
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
    assert "Feather scheduler" in (tmp_path / "server.log").read_text()
