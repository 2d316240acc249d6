"""Report metrics against hand computations, and the text, table, JSON and plot outputs."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from feather_sched.bench.report import (
    format_ratio_table,
    format_result_block,
    plot,
    preempted_text,
    report_markdown,
    write_json,
)
from feather_sched.cli import app
from feather_sched.results.records import RequestRecord, RunResult, StepRecord
from feather_sched.results.summary import (
    Percentiles,
    median_and_range,
    prefill_over_floor,
    summarize,
)
from feather_sched.workloads.spec import RequestSpec, Workload

VLLM_KEYS = [
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl")
      for stat in ("mean", "median", "std", "p99")),
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms",
]
GROUP_KEYS = ["worst_group_mean_ttft_ms", "worst_group_p99_ttft_ms", "cold_p99_ttft_ms",
              "ttft_by_group"]
PRIORITY_KEYS = ["preemptions", "max_preemptions_per_request", "recomputed_tokens",
                 "preemptions_by_group",
                 "scheduling_policy", "by_priority", "by_tenant", "max_service_gap"]
FEATHER_KEYS = ["mean_batch_size", "mean_groups_per_step", "prefix_cache_hit_rate",
                "gate_add", "gate_stop", "gate_forced", "urgent_preemptions",
                "schedule_ms_per_call", "engine_step_ms"]


def record(rid: str, prompt_len: int, submitted: float, tokens: list[float],
           finished: float | None, success: bool = True, cached: int | None = None,
           group: int = 0):
    return RequestRecord(rid, prompt_len, group=group, submitted_s=submitted,
                         token_times_s=tokens, finished_s=finished, success=success,
                         cached_tokens=cached)


def two_requests_and_a_failure(**kwargs) -> RunResult:
    """a: tokens at 0.1/0.2/0.4; b: a 2-token chunk at 0.8, then 1.0; c failed."""
    records = [
        record("a", 10, 0.0, [0.1, 0.2, 0.4], 0.4, cached=4),
        record("b", 20, 0.5, [0.8, 0.8, 1.0], 1.0, cached=8),
        record("c", 100, 0.6, [0.9], None, success=False),
    ]
    return RunResult("fcfs", records, duration_s=2.0, **kwargs)


def test_keys_are_vllms_then_ours_in_order() -> None:
    assert list(summarize(two_requests_and_a_failure())) == (VLLM_KEYS + GROUP_KEYS
                                                             + PRIORITY_KEYS + FEATHER_KEYS)


def test_ttft_per_group_names_the_worst_group() -> None:
    records = [record(f"m{i}", 10, 0.0, [0.1 + 0.01 * i], 0.2) for i in range(5)]
    records += [record("x0", 10, 0.0, [2.0], 2.1, group=1), record("x1", 10, 1.0, [1.5], 1.6,
                                                                   group=1)]
    s = summarize(RunResult("feather", records, duration_s=3.0))
    groups = s["ttft_by_group"]
    assert list(groups) == ["0", "1"]  # the largest group first
    assert groups["1"] == {"requests": 2, "mean_ttft_ms": pytest.approx(1250.0),
                           "p99_ttft_ms": pytest.approx(1985.0)}
    assert groups["0"]["mean_ttft_ms"] == pytest.approx(120.0)
    assert s["worst_group_mean_ttft_ms"] == pytest.approx(1250.0)
    block = format_result_block(RunResult("feather", records, duration_s=3.0), s)
    assert "Group 1 (2 req):" in block and "1250.00 / 1985.00" in block


def two_classes(**kwargs) -> RunResult:
    """Class 0: u (TTFT 0.1, E2EL 0.3, 3 tokens); class 1: v and w in groups 0 and 1,
    preempted 2 and 1 times (TTFT 0.5 and 1.0, E2EL 1.0 and 2.0, 2 tokens each)."""
    records = [record("u", 10, 0.0, [0.1, 0.2, 0.3], 0.3),
               record("v", 10, 0.0, [0.5, 1.0], 1.0),
               record("w", 10, 1.0, [2.0, 3.0], 3.0, group=1)]
    for r, priority, preempted in zip(records, (0, 1, 1), (0, 2, 1), strict=True):
        r.priority, r.preemptions = priority, preempted
    return RunResult("priority", records, duration_s=4.0, **kwargs)


def test_each_priority_class_gets_its_latencies_and_throughput() -> None:
    s = summarize(two_classes(scheduling_policy="priority"))
    assert s["scheduling_policy"] == "priority"
    assert list(s["by_priority"]) == ["0", "1"]
    urgent, rest = s["by_priority"]["0"], s["by_priority"]["1"]
    assert urgent == {"requests": 1, "mean_ttft_ms": pytest.approx(100.0),
                      "p99_ttft_ms": pytest.approx(100.0), "mean_e2el_ms": pytest.approx(300.0),
                      "p99_e2el_ms": pytest.approx(300.0),
                      "output_throughput": pytest.approx(0.75), "preemptions": 0}
    assert rest["mean_ttft_ms"] == pytest.approx(750.0)
    assert rest["p99_ttft_ms"] == pytest.approx(np.percentile([500, 1000], 99))
    assert rest["mean_e2el_ms"] == pytest.approx(1500.0)
    assert rest["output_throughput"] == pytest.approx(1.0) and rest["preemptions"] == 3
    assert summarize(two_requests_and_a_failure())["by_priority"] is None


def test_preemptions_per_run_and_per_group() -> None:
    s = summarize(two_classes())
    assert (s["preemptions"], s["max_preemptions_per_request"]) == (3, 2)
    assert s["preemptions_by_group"] == {"0": {"preemptions": 2, "max_per_request": 2},
                                         "1": {"preemptions": 1, "max_per_request": 1}}
    unobserved = summarize(two_requests_and_a_failure(preemptions=7))
    assert (unobserved["preemptions"], unobserved["max_preemptions_per_request"],
            unobserved["preemptions_by_group"]) == (7, None, None)
    assert summarize(two_requests_and_a_failure())["preemptions"] is None


def test_the_block_prints_classes_policy_and_preemptions() -> None:
    run = two_classes(scheduling_policy="fcfs")
    lines = format_result_block(run, summarize(run)).splitlines()
    for line in (
        "{:<40} {:<10}".format("Scheduling policy:", "fcfs (priorities stripped to 0)"),
        "{:<40} {:<10}".format("Class 0 (1 req) TTFT mean / p99 (ms):", "100.00 / 100.00"),
        "{:<40} {:<10}".format("Class 1 E2EL mean / p99 (ms):", "1500.00 / 1990.00"),
        "{:<40} {:<10.2f}".format("Class 1 output tok/s:", 1.0),
        "{:<40} {:<10}".format("Group 0:", "2 / 2"),
        "{:<40} {:<10}".format("Preempted (total / max / recomp. tok):", "3 / 2 / n/a"),
    ):
        assert line in lines
    plain = two_requests_and_a_failure()
    block = format_result_block(plain, summarize(plain))
    assert "priority class" not in block and "Preemptions per prefix group" not in block
    assert "{:<40} {:<10}".format("Preempted (total / max / recomp. tok):",
                                  "n/a / n/a / n/a") in block


def test_detailed_json_holds_every_request(tmp_path) -> None:
    run = two_requests_and_a_failure()
    path = tmp_path / "detailed.json"
    write_json(path, [run], {"fcfs": summarize(run)}, {}, detailed=True)
    entry = json.loads(path.read_text())["runs"]["fcfs"]
    assert entry["input_lens"] == [10, 20, 100] and entry["output_lens"] == [3, 3, 1]
    assert entry["ttfts"] == pytest.approx([0.1, 0.3, 0.0])
    assert [pytest.approx(gaps) for gaps in entry["itls"]] == [[0.1, 0.2], [0.2], []]
    assert entry["groups"] == [0, 0, 0] and entry["request_ids"] == ["a", "b", "c"]
    assert entry["priorities"] == [0, 0, 0] and entry["preemptions"] == [None] * 3
    classes = two_classes()
    write_json(path, [classes], {"priority": summarize(classes)}, {}, detailed=True)
    entry = json.loads(path.read_text())["runs"]["priority"]
    assert entry["priorities"] == [0, 1, 1] and entry["preemptions"] == [0, 2, 1]
    assert entry["by_priority"]["1"]["preemptions"] == 3


def test_counts_and_throughputs_exclude_failures() -> None:
    s = summarize(two_requests_and_a_failure())
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 6)
    assert s["duration"] == 2.0
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(18.0)


@pytest.mark.parametrize(("metric", "mean", "median", "std", "p99"), [
    # TTFT: a 0.1, b 0.3.  p99 interpolates: 0.1 + 0.99 * 0.2.
    ("ttft", 200.0, 200.0, 100.0, 298.0),
    # TPOT: a (0.4 - 0.1) / 2 = 0.15, b (0.5 - 0.3) / 2 = 0.1 (chunk tokens still count).
    ("tpot", 125.0, 125.0, 25.0, 149.5),
    # ITL: a 0.1, 0.2; b one gap 0.2 (the 2-token chunk is one arrival, as in vLLM).
    ("itl", 500 / 3, 200.0, 1000 * math.sqrt(0.02 / 9), 200.0),
    # E2EL: a 0.4, b 0.5.
    ("e2el", 450.0, 450.0, 50.0, 499.0),
])
def test_latencies_match_hand_computation(metric, mean, median, std, p99) -> None:
    s = summarize(two_requests_and_a_failure(), Percentiles.parse("ttft,tpot,itl,e2el", "99"))
    got = [s[f"{stat}_{metric}_ms"] for stat in ("mean", "median", "std", "p99")]
    assert got == pytest.approx([mean, median, std, p99])


def test_bad_percentile_flags_fail_clearly() -> None:
    with pytest.raises(ValueError, match="unknown \\['ttlt'\\]"):
        Percentiles.parse("ttft,ttlt", "99")
    with pytest.raises(ValueError, match="in \\(0, 100\\)"):
        Percentiles.parse("ttft", "100")


def test_percentiles_are_named_as_vllm_names_them() -> None:
    s = summarize(two_requests_and_a_failure(),
                  Percentiles.parse("ttft,tpot,itl,e2el", "50,99.9"))
    assert s["p50_ttft_ms"] == pytest.approx(200.0)
    assert "p99.9_e2el_ms" in s and "p99_e2el_ms" not in s


def test_single_token_request_has_no_tpot_and_no_itl() -> None:
    run = RunResult("x", [record("a", 5, 0.0, [0.25], 0.25)], duration_s=1.0)
    s = summarize(run)
    assert s["mean_ttft_ms"] == pytest.approx(250.0)
    assert s["mean_tpot_ms"] == 0.0 and s["mean_itl_ms"] == 0.0


def test_steps_gates_and_engine_hit_rate() -> None:
    run = two_requests_and_a_failure(
        steps=[StepRecord(4, 1), StepRecord(2, 2), StepRecord(3, 3)],
        gate_counts={"add": 7, "stop": 2, "forced": 1},
        prefix_cache_hit_rate=0.75,
    )
    s = summarize(run)
    assert s["mean_batch_size"] == pytest.approx(3.0)
    assert s["mean_groups_per_step"] == pytest.approx(2.0)
    assert (s["gate_add"], s["gate_stop"], s["gate_forced"]) == (7, 2, 1)
    assert s["prefix_cache_hit_rate"] == 0.75


def test_hit_rate_from_cached_tokens_of_successes_only() -> None:
    s = summarize(two_requests_and_a_failure())
    assert s["prefix_cache_hit_rate"] == pytest.approx(12 / 30)
    assert s["mean_batch_size"] is None and s["gate_add"] is None


def test_hit_rate_unknown_when_a_success_lacks_cached_tokens() -> None:
    run = two_requests_and_a_failure()
    run.records[1].cached_tokens = None
    assert summarize(run)["prefix_cache_hit_rate"] is None


@pytest.mark.parametrize("duration", [0.0, 3.0])
def test_runs_without_successes_do_not_crash(duration: float) -> None:
    run = RunResult("x", [record("a", 7, 0.0, [], None, success=False)], duration_s=duration)
    s = summarize(run)
    assert (s["completed"], s["failed"], s["total_input_tokens"]) == (0, 1, 0)
    assert s["mean_ttft_ms"] == 0.0 and s["p99_itl_ms"] == 0.0
    assert s["request_throughput"] == (0.0 if duration else None)
    assert "n/a" in format_result_block(run, s)


def test_result_block_prints_vllms_lines() -> None:
    run = two_requests_and_a_failure(request_rate=4.0, max_concurrency=8,
                                     gate_counts={"add": 7, "stop": 2, "forced": 1})
    lines = format_result_block(run, summarize(run)).splitlines()
    assert lines[0] == "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")
    assert lines[-1] == "=" * 50
    for line in (
        "{:<40} {:<10}".format("Successful requests:", 2),
        "{:<40} {:<10}".format("Maximum request concurrency:", 8),
        "{:<40} {:<10.2f}".format("Request rate configured (RPS):", 4.0),
        "{:<40} {:<10.2f}".format("Output token throughput (tok/s):", 3.0),
        "{s:{c}^{n}}".format(s="Time per Output Token (excl. 1st token)", n=50, c="-"),
        "{:<40} {:<10.2f}".format("Mean TTFT (ms):", 200.0),
        "{:<40} {:<10.2f}".format("P99 TTFT (ms):", 298.0),
        "{:<40} {:<10}".format("Scheduler:", "fcfs"),
        "{:<40} {:<10.2f}".format("Prefix-cache hit rate (%):", 40.0),
        "{:<40} {:<10}".format("Gate ADD / STOP / forced:", "7 / 2 / 1"),
    ):
        assert line in lines


def test_result_block_omits_unset_rate_and_concurrency() -> None:
    run = two_requests_and_a_failure(request_rate=math.inf)
    block = format_result_block(run, summarize(run))
    assert "Request rate configured" not in block
    assert "Maximum request concurrency" not in block
    assert "{:<40} {:<10}".format("Mean running batch size:", "n/a") in block


def faster_run() -> RunResult:
    """Same requests, half the duration and half the latencies of the baseline."""
    records = [record("a", 10, 0.0, [0.05, 0.1, 0.2], 0.2), record("b", 20, 0.0, [0.1], 0.1)]
    return RunResult("feather", records, duration_s=1.0)


def test_ratio_table_shows_value_over_baseline() -> None:
    summaries = {"fcfs": summarize(two_requests_and_a_failure()),
                 "feather": summarize(faster_run())}
    console = Console(record=True, width=200)
    console.print(format_ratio_table(summaries, baseline="fcfs"))
    text = console.export_text()
    assert "x vs fcfs" in text
    assert "1.00 (1.00x)" in text  # fcfs request throughput
    assert "2.00 (2.00x)" in text  # feather: 2 requests in 1 s
    assert "75.00 (0.38x)" in text  # feather mean TTFT 75 ms against 200 ms


def thrashed() -> RunResult:
    """``faster_run`` where b was preempted 3 times and recomputed 1,500 tokens."""
    run = faster_run()
    for r, preempted, computed in zip(run.records, (0, 3), (10, 1520), strict=True):
        r.preemptions, r.cached_tokens, r.computed_tokens = preempted, 0, computed
    return run


def test_every_schedulers_row_shows_its_preemptions_beside_ttft() -> None:
    summaries = {"fcfs": summarize(two_requests_and_a_failure()),
                 "feather": summarize(thrashed())}
    console = Console(record=True, width=250)
    console.print(format_ratio_table(summaries, baseline="fcfs"))
    lines = console.export_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "┃ Scheduler" in line)
    assert [line.split("┃")[7].strip() for line in lines[at - 2:at + 1]] == [
        "Preempted", "(total / max /", "recomputed tok)"]  # beside P99 TTFT
    assert "P99 TTFT" in lines[at].split("┃")[6] and "Mean TPOT" in lines[at].split("┃")[8]
    assert "n/a / n/a / n/a" in next(line for line in lines if "│ fcfs" in line)
    assert "3 / 3 / 1,500" in next(line for line in lines if "│ feather" in line)
    narrow = Console(record=True, width=100)  # a terminal's width: others wrap, not these
    narrow.print(format_ratio_table(summaries, baseline="fcfs"))
    text = narrow.export_text()
    assert "│ feather " in text and "3 / 3 / 1,500" in text
    table = report_markdown(summaries).splitlines()
    assert "preempted (total / max / recomputed tok)" in table[0]
    assert "| 3 / 3 / 1,500 |" in table[3]


def test_ratio_table_rejects_unknown_baseline() -> None:
    with pytest.raises(KeyError):
        format_ratio_table({"fcfs": summarize(faster_run())}, baseline="vllm")


def test_json_round_trips(tmp_path) -> None:
    runs = [two_requests_and_a_failure(), faster_run()]
    summaries = {run.name: summarize(run) for run in runs}
    out = tmp_path / "nested" / "result.json"
    write_json(out, runs, summaries, {"model": "tiny", "output": tmp_path})
    document = json.loads(out.read_text())
    assert list(document["runs"]) == ["fcfs", "feather"]
    assert document["runs"]["fcfs"] == summaries["fcfs"]
    assert document["config"] == {"model": "tiny", "output": str(tmp_path)}


def test_json_refuses_runs_without_summaries(tmp_path) -> None:
    with pytest.raises(ValueError, match="do not match"):
        write_json(tmp_path / "r.json", [faster_run()], {}, {})


def test_plot_writes_a_png(tmp_path) -> None:
    summaries = {"fcfs": summarize(two_requests_and_a_failure()),
                 "feather": summarize(faster_run()),
                 "empty": summarize(RunResult("empty", [], duration_s=0.0))}
    out = tmp_path / "plots" / "compare.png"
    plot(summaries, out)
    assert out.read_bytes().startswith(b"\x89PNG")


def test_scheduler_accounting_is_reported_per_step() -> None:
    from feather_sched.telemetry.stats import SchedulerStats

    run = two_requests_and_a_failure()
    run.scheduler_stats = SchedulerStats(schedule_calls=4, schedule_s=0.002, steps=2,
                                         step_s=0.5)
    summary = summarize(run)
    assert summary["schedule_ms_per_call"] == pytest.approx(0.5)
    assert summary["engine_step_ms"] == pytest.approx(250.0)
    assert "Scheduler time per step (ms):" in format_result_block(run, summary)


def test_feather_report_draws_saved_results(tmp_path) -> None:
    from typer.testing import CliRunner

    from feather_sched.cli import app

    paths = []
    for label in ("one", "two"):
        run = two_requests_and_a_failure()
        path = tmp_path / f"{label}.json"
        write_json(path, [run, faster_run()], {"fcfs": summarize(run),
                                               "feather": summarize(faster_run())}, {})
        paths.append(str(path))
    png, table = tmp_path / "report.png", tmp_path / "report.md"
    result = CliRunner().invoke(app, ["report", *paths, "--plot", str(png), "--markdown",
                                      str(table)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert png.read_bytes().startswith(b"\x89PNG")
    text = table.read_text()
    assert "| one:fcfs | 3.0 | 200.0 |" in text and "| two:feather | 0 | 2 |" in text
    assert "priority class" not in text
    classes = tmp_path / "classes.json"
    write_json(classes, [two_classes()], {"priority": summarize(two_classes())}, {})
    result = CliRunner().invoke(app, ["report", str(classes), "--plot", str(png),
                                      "--markdown", str(table)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "| priority | 1 | 2 | 750.0 / 995.0 | 1500.0 / 1990.0 | 1.0 |" in table.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert CliRunner().invoke(app, ["report", str(bad)]).exit_code != 0


def test_median_and_range_of_repeated_runs() -> None:
    assert median_and_range([1.2, 1.05, 1.12]) == "1.12 (1.05-1.20)"
    assert median_and_range([2400.0, 2000.0], "{:,.0f}") == "2,200 (2,000-2,400)"
    assert median_and_range([0.5]) == "0.50"  # one run: no range


def test_prefill_over_the_floor_counts_each_groups_prefix_once() -> None:
    def record(group: int, cached: int) -> RequestRecord:
        return RequestRecord(f"r{group}-{cached}", 110, group, 0.0, cached_tokens=cached)

    def workload(prefixes: dict[int, int]) -> Workload:
        """A request of each group, with its shared prefix (only those fields count)."""
        return Workload("w", [RequestSpec(f"g{group}", np.ones(110, np.int32), 1, 0.0,
                                          group, shared) for group, shared in prefixes.items()])

    # two groups of two with a 100-token prefix, and one request that shares nothing
    even = workload({0: 100, 1: 100, -1: 0})
    floor = [record(0, 0), record(0, 100), record(1, 0), record(1, 100), record(-1, 0)]
    assert prefill_over_floor(floor, even) == 1.0  # 110 + 10 + 110 + 10 + 110
    recomputed = [record(0, 0), record(0, 0), record(1, 0), record(1, 100), record(-1, 0)]
    assert prefill_over_floor(recomputed, even) == pytest.approx(450 / 350)
    # prefixes by group: group 1 shares 60 tokens, so its second request computes 50
    shorter = [record(0, 0), record(0, 100), record(1, 0), record(1, 60), record(-1, 0)]
    assert prefill_over_floor(shorter, workload({0: 100, 1: 60, -1: 0})) == 1.0  # 550-100-60
    assert prefill_over_floor(shorter, even) == pytest.approx(390 / 350)


def test_figures_per_tenant_and_the_service_gap_while_all_are_in() -> None:
    """a (tenant x) computes 4 prompt tokens, first token at 0.1, two more at 0.2, 0.4;
    b (tenant y) 8 prompt tokens at 0.8, then 1.0: both in over [0.5, 0.4] - never, so
    no gap; c (y) arrives at 0.0 and runs to 1.0: both in over [0.0, 0.4]."""
    records = [
        RequestRecord("a", 10, 0, 0.0, [0.1, 0.2, 0.4], 0.4, True, tenant="x",
                      computed_tokens=4),
        RequestRecord("b", 20, 0, 0.5, [0.8, 1.0], 1.0, True, tenant="y", computed_tokens=8),
    ]
    run = RunResult("vtc", records, duration_s=2.0)
    summary = summarize(run)
    assert summary["by_tenant"]["x"]["service"] == 4 + 2 * 3
    assert summary["by_tenant"]["y"]["service"] == 8 + 2 * 2
    assert summary["by_tenant"]["y"]["requests"] == 1 and summary["max_service_gap"] is None
    records.append(RequestRecord("c", 5, 0, 0.0, [0.3, 0.9], 1.0, True, tenant="y",
                                 computed_tokens=5))
    summary = summarize(RunResult("vtc", records, duration_s=2.0))
    assert summary["max_service_gap"] == (4 + 2 * 3) - (5 + 2 * 1)  # in [0.0, 0.4]
    assert "x (1 req) TTFT" in format_result_block(run, summarize(run))
    records[2].computed_tokens = None
    assert summarize(RunResult("vtc", records, duration_s=2.0))["max_service_gap"] is None
    assert summarize(two_requests_and_a_failure())["by_tenant"] is None


def test_feather_sim_reports_every_schedulers_preemptions(tmp_path) -> None:
    """A KV pool too small for the batch: each scheduler's row, block and JSON carry its
    preemptions and the tokens they recomputed."""
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, [
        "sim", "--groups", "4", "--prompts-per-group", "8", "--prefix-len", "1024",
        "--output-len", "200", "--schedulers", "fcfs,feather-model", "--kv-cache-gib", "0.6",
        "--json", str(out)], env={"COLUMNS": "130"})
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    for name, summary in runs.items():
        figures = preempted_text(summary)
        assert summary["preemptions"] > 0 and summary["recomputed_tokens"] > 0, name
        assert "{:<40} {:<10}".format("Preempted (total / max / recomp. tok):", figures) \
            in result.output
        assert re.search(rf"│ {name} +│.*│ +{figures} │", result.output)
