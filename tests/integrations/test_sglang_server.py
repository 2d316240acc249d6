"""The real SGLang server with Feather, measured by feather bench (CPU, tiny model)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from feather_sched.bench.sglang_policy import sglang_available
from tests.conftest import STAND_INS
from tests.servers import bench_server, serving

reason = sglang_available()
if reason:
    pytest.skip(reason, allow_module_level=True)

from feather_sched.models import TINY_LLAMA  # noqa: E402


def test_sglang_server_runs_feather_and_answers_feather_bench(tmp_path) -> None:
    from feather_sched import stats

    log, stats_file = tmp_path / "server.log", tmp_path / "stats.json"
    options = json.dumps({"gate": "bandit", "stats_file": str(stats_file)})
    command = ["feather_sched.integrations.sglang_launch", "--model-path", str(TINY_LLAMA),
               "--device", "cpu", "--load-format", "dummy", "--skip-tokenizer-init",
               "--attention-backend", "torch_native", "--schedule-policy", "feather",
               "--feather-options", options]
    env = {"PYTHONPATH": os.pathsep.join([str(STAND_INS), *sys.path])}
    with serving(command, log, env) as url:
        summary = bench_server(url, tmp_path / "sglang.json", "sglang-feather",
                               "--api", "sglang")
        assert summary["completed"] == 6 and summary["total_output_tokens"] == 30
        time.sleep(stats.WRITE_EVERY_S + 1)  # the meter saves on its next step after this
        bench_server(url, tmp_path / "again.json", "sglang-feather", "--api", "sglang")
    assert "Feather scheduling policy" in log.read_text()
    written = stats.SchedulerStats.read(stats_file)
    assert written.steps > 0 and written.schedule_calls > 0
    assert written.admissions.asked >= written.admissions.add > 0
