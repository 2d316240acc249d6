"""The real SGLang server with Feather, measured by feather bench (CPU, tiny model)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from feather_sched.bench.cht.sglang_policy import sglang_installed
from feather_sched.telemetry.steplog import read_steps
from tests.helpers.servers import BOUNDED_POOL, SGLANG_READY, bench_server, serving, wait_for

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

from feather_sched.models import TINY_LLAMA


def test_sglang_server_runs_feather_and_answers_feather_bench(tmp_path) -> None:
    from feather_sched.telemetry import stats

    log, stats_file, steps = tmp_path / "server.log", tmp_path / "stats.json", tmp_path / "s.csv"
    # gate "always": no STOP holds a group back, so rounds admit mixed groups and the
    # reordering below has batches to act on (the gate's path:
    # tests/integrations/sglang/test_scheduler)
    options = json.dumps({"gate": "always", "stats_file": str(stats_file),
                          "step_log": str(steps), "save_every_s": 0.5})
    command = ["feather_sched.integrations.sglang.launch", "--model-path", str(TINY_LLAMA),
               "--device", "cpu", "--load-format", "dummy", "--skip-tokenizer-init",
               "--attention-backend", "torch_native", "--schedule-policy", "feather",
               "--feather-options", options, "--enable-metrics", *BOUNDED_POOL]
    env: dict[str, str] = {}  # the launcher itself provides what SGLang's import needs
    with serving(command, log, env, SGLANG_READY) as url:
        summary = bench_server(url, tmp_path / "sglang.json", "sglang-feather",
                               "--api", "sglang")
        assert summary["completed"] == 6 and summary["total_output_tokens"] == 30
        # Arrivals over time: SGLang appends each round's admissions to the running batch,
        # interleaving groups; Feather puts the decode batch back in group order.
        bench_server(url, tmp_path / "again.json", "sglang-feather", "--api", "sglang",
                     "--groups", "3", "--prompts-per-group", "5", "--request-rate", "20",
                     "--output-len", "32")
        done = time.time()  # SGLang's idle loop keeps scheduling: it saves every 0.5 s
        wait_for(lambda: stats_file.exists() and stats_file.stat().st_mtime > done + 0.1,
                 "the stats file saved after the runs", timeout_s=30)
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    assert "Feather scheduling policy" in log.read_text()
    written = stats.SchedulerStats.read(stats_file)
    assert written.steps > 0 and written.schedule_calls > 0
    assert written.admissions.asked >= written.admissions.add > 0
    assert written.reordered_batches > 0
    # Feather's metrics from the scheduler process, on SGLang's own /metrics
    assert "# HELP feather:gate_decisions_total" in metrics
    assert 'feather:gate_decisions_total{decision="add",scheduler="FeatherSGLang"}' in metrics
    decodes = [[e.group for e in batch] for batch, _ in read_steps(steps)
               if len(batch) > 1 and all(e.new_tokens == 1 for e in batch)]
    assert decodes and all(contiguous(groups) for groups in decodes), decodes


def contiguous(groups: list[str]) -> bool:
    runs = [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]]
    return len(runs) == len(set(runs))
