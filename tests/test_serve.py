"""feather serve: the command it builds, and a real server measured by feather bench."""

from __future__ import annotations

import json

import pytest

from feather_sched.serve import SCHEDULER_CLS, vllm_server_command
from tests.servers import bench_server, serving


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


def test_feather_serve_answers_feather_bench(tmp_path) -> None:
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    log = tmp_path / "server.log"
    command = ["feather_sched.cli", "serve", "--gate", "bandit", "--enforce-eager"]
    with serving(command, log, {"VLLM_CPU_KVCACHE_SPACE": "1"}) as url:
        summary = bench_server(url, tmp_path / "server.json", "feather-server",
                               "--max-concurrency", "4")
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 30
    assert summary["prefix_cache_hit_rate"] > 0.3
    assert "Feather scheduler" in log.read_text()
