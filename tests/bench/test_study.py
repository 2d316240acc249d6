"""The benchmarks' harness (``bench.study``): rounds, per-round ratios, tables, simulator
plans and a study's output."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from feather_sched.bench import study
from feather_sched.bench.offline import scheduler_specs
from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS
from feather_sched.results.summary import median_and_range, summarize
from feather_sched.sim.runner import SimPlan, simulate
from feather_sched.workloads.synthetic import shared_prefix_groups


def summary(tput: float, **more: float) -> dict:
    return {"output_throughput": tput, **more}


def test_rounds_group_feather_benchs_labels_by_scheduler_in_round_order() -> None:
    names = ["fcfs", "feather-model", "fcfs", "feather-model", "fcfs"]
    labels = [spec.name for spec in scheduler_specs(names, {})]  # the labeller itself
    assert labels == ["fcfs", "feather-model", "fcfs#2", "feather-model#2", "fcfs#3"]
    runs = study.rounds({label: summary(i) for i, label in enumerate(labels)})
    assert list(runs) == ["fcfs", "feather-model"]
    assert runs["fcfs"] == [summary(0), summary(2), summary(4)]
    assert runs["feather-model"] == [summary(1), summary(3)]


def test_load_rounds_reads_a_feather_bench_file(tmp_path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"runs": {"fcfs": summary(10), "lpm": summary(12),
                                         "fcfs#2": summary(20), "lpm#2": summary(22)},
                                "config": {}}))
    assert study.load_rounds(path) == {"fcfs": [summary(10), summary(20)],
                                       "lpm": [summary(12), summary(22)]}


def test_seeds_transpose_into_runs() -> None:
    per_seed = [{"fcfs": 1, "lpm": 2}, {"fcfs": 3, "lpm": 4}]
    assert study.by_scheduler(per_seed) == {"fcfs": [1, 3], "lpm": [2, 4]}


def test_ratios_are_taken_round_by_round_not_of_medians() -> None:
    # the machine's speed drifts between rounds: the median of per-round ratios (1.0) is
    # not the ratio of the medians (12 / 15)
    ours = [summary(10.0), summary(30.0), summary(12.0)]
    base = [summary(10.0), summary(15.0), summary(24.0)]
    assert study.ratios(ours, base, "output_throughput") == [1.0, 2.0, 0.5]
    assert study.ratio(ours, base, "output_throughput") == "1.00x (0.50-2.00)"
    by_median = (sorted(s["output_throughput"] for s in ours)[1]
                 / sorted(s["output_throughput"] for s in base)[1])
    assert not math.isclose(by_median, 1.0)


def test_ratios_take_functions_skip_a_zero_base_and_check_rounds() -> None:
    ours = [{"by_priority": {"0": {"ttft": 2.0}}}, {"by_priority": {"0": {"ttft": 3.0}}}]
    base = [{"by_priority": {"0": {"ttft": 4.0}}}, {"by_priority": {"0": {"ttft": 0.0}}}]

    def urgent(run: dict) -> float:
        return run["by_priority"]["0"]["ttft"]

    assert study.ratios(ours, base, urgent) == [0.5]  # round 2's base is 0: no ratio
    with pytest.raises(ValueError):
        study.ratios(ours, base[:1], urgent)
    assert study.ratios(ours, base[:1], urgent, strict=False) == [0.5]


def test_pooled_sets_keep_their_round_pairs() -> None:
    a = {"fcfs": [summary(10)], "feather": [summary(11)]}
    b = {"fcfs": [summary(20), summary(40)], "feather": [summary(30), summary(40)]}
    runs = study.pooled([a, b])
    assert study.ratios(runs["feather"], runs["fcfs"], "output_throughput") == [1.1, 1.5, 1.0]


def test_median_and_range_formats_a_unit_a_separator_and_by_function() -> None:
    assert median_and_range([1.0, 1.2, 0.9], unit="x") == "1.00x (0.90-1.20)"
    assert median_and_range([1.0, 1.2], "{:.3f}", "x", " - ") == "1.100x (1.000 - 1.200)"
    assert median_and_range([150.0, 50.0, 250.0], lambda v: f"<{v:.0f}>") == (
        "<150> (<50>-<250>)")
    assert median_and_range([2.0], unit="x") == "2.00x"


def test_markdown_tables_from_rows_and_from_declared_columns() -> None:
    assert study.markdown_table(["a", "b"], [["1", "2"], ["3", "4"]]) == (
        "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |")
    columns = (("name", lambda item: item[0]), ("double", lambda item: str(2 * item[1])))
    assert study.table(columns, [("x", 1), ("y", 5)]) == (
        "| name | double |\n|---|---|\n| x | 2 |\n| y | 10 |")


def test_the_ratio_table_gives_medians_and_per_round_ratios_to_the_base() -> None:
    runs = {"fcfs": [summary(100.0), summary(50.0), summary(80.0)],
            "feather": [summary(110.0), summary(60.0), summary(96.0)]}
    lines = study.ratio_table(runs, "output_throughput").splitlines()
    assert lines[0] == ("| scheduler | runs | median output_throughput | min - max | "
                        "median ratio to fcfs (per round) | ratio min - max | "
                        "median preempted (total / max / recomputed tok) |")
    assert lines[2] == ("| fcfs | 3 | 80.0 | 50.0 - 100.0 | 1.000x | 1.000 - 1.000 | "
                        "n/a / n/a / n/a |")
    assert lines[3].startswith("| feather | 3 | 96.0 | 60.0 - 110.0 | 1.200x | 1.100 - 1.200 |")
    other = study.ratio_table(runs, "output_throughput", base="feather").splitlines()
    assert other[2].endswith("| 0.833x | 0.833 - 0.909 | n/a / n/a / n/a |")


def test_the_ratio_table_gives_each_schedulers_median_preemptions() -> None:
    figures = [(0, 0, 0), (4, 2, 1200), (6, 3, 2100)]
    runs = {"feather": [{**summary(100.0), **dict(zip(study.PREEMPTION_KEYS, f, strict=True))}
                        for f in figures]}
    assert study.ratio_table(runs, "output_throughput").splitlines()[2].endswith(
        "| 4 / 2 / 1,200 |")
    with pytest.raises(ValueError, match="no scheduler 'lpm'"):
        study.ratio_table(runs, "output_throughput", base="lpm")


def group(mean: float, p99: float) -> dict:
    return {"mean_ttft_ms": mean, "p99_ttft_ms": p99}


def test_fairness_cells_name_the_majority_the_worst_minority_and_a_miss() -> None:
    fcfs = {"0": group(1000, 2000), "1": group(1000, 2000), "2": group(1000, 2000)}
    fair = {"0": group(500, 1000), "1": group(1200, 2400), "2": group(900, 1800)}
    assert study.fairness_cells(fair, fcfs) == ["0.50 / 1.00", "1.20 / 2.40",
                                                "1.20x / 1.20x"]
    starved = {**fair, "2": group(3000, 2000)}
    assert study.fairness_cells(starved, fcfs) == ["0.50 / 1.00", "3.00 / 2.00",
                                                   "3.00x / 1.20x over"]
    assert study.fairness_cells(starved, fcfs, target=4.0)[2] == "3.00x / 1.20x"


def workload(seed: int = 0):
    return shared_prefix_groups(groups=2, prompts_per_group=4, prefix_len=256, suffix_len=16,
                                output_len=4, seed=seed)


def test_a_sim_plan_is_llama_3_8b_with_vllms_gpu_limits() -> None:
    plan = study.sim_plan(workload(), "rtx6000-ada")
    plain = SimPlan(workload=plan.workload, hardware=HARDWARE["rtx6000-ada"],
                    model=MODELS["llama-3-8b"])
    assert (plan.hardware, plan.model, plan.engine) == (
        plain.hardware, plain.model, plain.engine_config())
    assert study.sim_plan(workload(), num_blocks=500).engine.num_blocks == 500


def test_summaries_and_the_offline_rate_are_the_simulators() -> None:
    # The policies' own time uncharged: the figures are then the model's, whatever the host
    # is doing (charged, this tiny run moves with the machine's load).
    plan = study.sim_plan(workload(), charge_scheduler_time=False)
    got = study.summaries(plan, ["fcfs", "sglang-lpm"])
    assert list(got) == ["fcfs", "sglang-lpm"]
    assert all(s["completed"] == 8 for s in got.values())
    expected = summarize(simulate(plan, "fcfs"))["request_throughput"]
    assert study.offline_rate(plan) == pytest.approx(expected, rel=1e-9)


def test_parallel_maps_over_processes_in_order() -> None:
    assert study.parallel(abs, [-3, 2, -1, 0], 2) == [3, 2, 1, 0]


def test_a_studys_parser_takes_a_set_and_its_seeds_and_jobs() -> None:
    args = study.parser("Study. More.", seeds=3, jobs=2).parse_args(["--set", "x"])
    assert (args.set, args.seeds, args.jobs) == ("x", 3, 2)
    bare = study.parser("Study.").parse_args([])
    assert bare.set is None and not hasattr(bare, "seeds")


def test_a_study_writes_its_run_set_with_the_command(tmp_path, capsys) -> None:
    script = tmp_path / "benchmarks" / "sim" / "demo.py"
    script.parent.mkdir(parents=True)
    script.write_text("")
    run = study.Study(script, set_name="h100-check", argv=["--seeds", "2"])
    assert run.folder == script.parent / "results" / "h100-check"
    assert run.command == "benchmarks/sim/demo.py --seeds 2"
    assert [cell for cell in run.each(["a", "b"], lambda cell: f"cell {cell}")] == ["a", "b"]
    run.save("demo", {"rows": [1, 2]}, "| a |\n|---|\n\n")
    assert json.loads((run.folder / "demo.json").read_text()) == {
        "command": "benchmarks/sim/demo.py --seeds 2", "rows": [1, 2]}
    assert (run.folder / "demo.md").read_text() == "| a |\n|---|\n"
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed[:2]] == ["cell a", "cell b"]
    assert printed[2:] == ["| a |", "|---|"]
    elsewhere = study.Study(script, folder=tmp_path / "out")
    assert elsewhere.folder == tmp_path / "out"


def test_a_run_set_is_named_by_the_commit_by_default(monkeypatch, tmp_path) -> None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True, cwd=Path(study.__file__).parent).stdout.strip()
    assert re.fullmatch(rf"{head}(-dirty)?", study.commit())
    monkeypatch.setattr(study, "commit", lambda: "abc1234")
    assert study.Study(tmp_path / "x.py").folder == tmp_path / "results" / "abc1234"


def test_outside_a_checkout_the_commit_is_unknown(monkeypatch) -> None:
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(study.subprocess, "run", no_git)
    assert study.commit() == "unknown"
