"""Minority prefix groups under overload, in the simulator: each group's TTFT against FCFS.

    .venv/bin/python benchmarks/sim/fairness.py

A large majority group and one or more small groups arrive shuffled, as a Poisson stream
at 3x FCFS's offline request rate (the queue grows: the scheduler decides who waits).
Llama-3-8B on RTX 6000 Ada and H100 SXM. For every scheduler and group: mean and p99
TTFT, and their ratio to the same group under FCFS (the target: at most 1.25x for
Feather, whose overtaking bound is on by default; "unbounded" turns it off, to show the
starvation it prevents). SGLang's lpm and dfs-weight run on the same workloads. Writes
fairness.json and fairness.md beside this file.
"""

from __future__ import annotations

import json
from pathlib import Path

from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS
from feather_sched.results.summary import group_ttfts, summarize, worst_group_ratios
from feather_sched.sim.runner import SimPlan, simulate
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import minority_groups

HERE = Path(__file__).parent
SCHEDULERS = ("fcfs", "sglang-lpm", "sglang-dfs-weight", "feather-chunk-loss",
              "feather-bandit", "feather-chunk-loss-unbounded", "feather-bandit-unbounded")
SHAPES = (
    # (majority, minority groups, prefix tokens, suffix tokens, output tokens)
    (400, (20,), 4096, 512, 64),
    (400, (10, 10, 10), 1024, 64, 64),
    (200, (5, 5, 5, 5), 10240, 32, 50),
)
LOAD = 3.0
TARGET = 1.25


def runs(hardware: str, shape: tuple) -> list[dict]:
    majority, minorities, prefix, suffix, output = shape

    def plan(rate: float | None) -> SimPlan:
        arrival = ArrivalSpec("poisson", rate) if rate else None
        work = minority_groups(majority=majority, minorities=minorities, prefix_len=prefix,
                               suffix_len=suffix, output_len=output, arrival=arrival, seed=0)
        return SimPlan(workload=work, hardware=HARDWARE[hardware], model=MODELS["llama-3-8b"])

    capacity = summarize(simulate(plan(None), "fcfs"))["request_throughput"]
    overloaded = plan(LOAD * capacity)
    rows = []
    for label in SCHEDULERS:
        run = simulate(overloaded, label)
        summary = summarize(run)
        rows.append({"hardware": hardware, "majority": majority, "minorities": list(minorities),
                     "prefix": prefix, "rate": LOAD * capacity, "scheduler": label,
                     "output_throughput": summary["output_throughput"],
                     "groups": group_ttfts([r for r in run.records if r.success])})
    return rows


def markdown(rows: list[dict]) -> str:
    """Per workload and scheduler: the worst ratio to FCFS over groups, mean and p99."""
    lines = ["| hardware | workload | scheduler | tok/s | majority mean / p99 TTFT s | "
             "worst minority mean / p99 TTFT s | worst group ratio to FCFS (mean / p99) |",
             "|---|---|---|---|---|---|---|"]
    fcfs: dict = {}
    for row in rows:
        shape = (row["hardware"], row["majority"], tuple(row["minorities"]), row["prefix"])
        groups = row["groups"]
        if row["scheduler"] == "fcfs":
            fcfs[shape] = groups
        mean_ratio, p99_ratio = worst_group_ratios(groups, fcfs[shape])
        minority = [g for k, g in groups.items() if k != "0"]
        worst = max(minority, key=lambda g: g["mean_ttft_ms"])
        verdict = "" if max(mean_ratio, p99_ratio) <= TARGET else " over"
        lines.append(
            f"| {row['hardware']} | {row['majority']} + {'/'.join(map(str, row['minorities']))}"
            f", {row['prefix']} prefix | {row['scheduler']} | {row['output_throughput']:,.0f} "
            f"| {groups['0']['mean_ttft_ms'] / 1e3:.2f} / {groups['0']['p99_ttft_ms'] / 1e3:.2f} "
            f"| {worst['mean_ttft_ms'] / 1e3:.2f} / {worst['p99_ttft_ms'] / 1e3:.2f} "
            f"| {mean_ratio:.2f}x / {p99_ratio:.2f}x{verdict} |")
    return "\n".join(lines)


def main() -> None:
    rows = []
    for hardware in ("rtx6000-ada", "h100-sxm"):
        for shape in SHAPES:
            rows += runs(hardware, shape)
            print(f"{hardware} {shape} done", flush=True)
    (HERE / "fairness.json").write_text(json.dumps(rows, indent=1))
    (HERE / "fairness.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
