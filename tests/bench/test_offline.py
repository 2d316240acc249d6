"""feather bench offline on the real vLLM engine (in-process, tiny sizes)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="the vllm extra is not installed")

from typer.testing import CliRunner

from feather_sched.bench.offline import scheduler_specs
from feather_sched.cli import app


def test_scheduler_names_map_to_engine_configurations() -> None:
    fcfs, nocache, feather, unordered = scheduler_specs(
        ["fcfs", "fcfs-nocache", "feather-bandit", "feather-always-noorder"], {"max_wait_s": 5})
    assert fcfs.scheduler_cls.endswith("InstrumentedScheduler") and fcfs.prefix_caching
    assert not nocache.prefix_caching
    assert feather.feather == {"max_wait_s": 5, "gate": "bandit", "order_running": True}
    assert unordered.feather["gate"] == "always" and not unordered.feather["order_running"]
    with pytest.raises(ValueError, match="unknown scheduler 'lpm'"):
        scheduler_specs(["lpm"], {})


def test_bench_runs_each_scheduler_and_writes_vllm_keys(tmp_path) -> None:
    out, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(app, [
        "bench", "--groups", "2", "--prompts-per-group", "3", "--prefix-len", "256",
        "--output-len", "4", "--schedulers", "fcfs,feather-chunk-loss",
        "--engine-arg", "enforce_eager=true", "--kv-cache-gib", "0.25",
        "--json", str(out), "--plot", str(chart)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Serving Benchmark Result" in result.output
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["fcfs", "feather-chunk-loss"]
    for summary in runs.values():
        assert summary["completed"] == 6 and summary["failed"] == 0
        assert summary["total_output_tokens"] == 24
        assert summary["mean_ttft_ms"] > 0 and summary["engine_step_ms"] > 0
    assert runs["fcfs"]["gate_add"] is None
    assert runs["feather-chunk-loss"]["gate_add"] >= 1
    assert runs["feather-chunk-loss"]["prefix_cache_hit_rate"] > 0.3
    assert chart.stat().st_size > 0


def test_bench_rejects_unknown_schedulers_before_starting_an_engine() -> None:
    result = CliRunner().invoke(app, ["bench", "--schedulers", "fcfs,lifo"],
                                env={"COLUMNS": "200"})
    assert result.exit_code != 0 and "unknown scheduler 'lifo'" in result.output


def test_a_repeated_scheduler_gets_its_own_label() -> None:
    labels = [s.name for s in scheduler_specs(["fcfs", "feather-always", "fcfs"], {})]
    assert labels == ["fcfs", "feather-always", "fcfs#2"]
