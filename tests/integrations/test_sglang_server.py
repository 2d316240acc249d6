"""The real SGLang server with Feather, measured by feather bench (CPU, tiny model)."""

from __future__ import annotations

import os
import sys

import pytest

from feather_sched.bench.sglang_policy import sglang_available
from tests.conftest import STAND_INS
from tests.servers import bench_server, serving

reason = sglang_available()
if reason:
    pytest.skip(reason, allow_module_level=True)

from feather_sched.models import TINY_LLAMA  # noqa: E402


def test_sglang_server_runs_feather_and_answers_feather_bench(tmp_path) -> None:
    log = tmp_path / "server.log"
    command = ["feather_sched.integrations.sglang_launch", "--model-path", str(TINY_LLAMA),
               "--device", "cpu", "--load-format", "dummy", "--skip-tokenizer-init",
               "--attention-backend", "torch_native", "--schedule-policy", "feather",
               "--feather-options", '{"gate": "bandit"}']
    env = {"PYTHONPATH": os.pathsep.join([str(STAND_INS), *sys.path])}
    with serving(command, log, env) as url:
        summary = bench_server(url, tmp_path / "sglang.json", "sglang-feather",
                               "--api", "sglang")
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 30
    assert "Feather scheduling policy" in log.read_text()
