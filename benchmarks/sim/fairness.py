"""Minority prefix groups under overload, in the simulator: each group's TTFT against FCFS.

    .venv/bin/python benchmarks/sim/fairness.py [--set NAME]

A large majority group and one or more small groups arrive shuffled, as a Poisson stream
at 3x FCFS's offline request rate (the queue grows: the scheduler decides who waits).
Llama-3-8B on RTX 6000 Ada and H100 SXM. For every scheduler and group: mean and p99
TTFT, and their ratio to the same group under FCFS (the target: at most 1.25x for
Feather, whose overtaking bound is on by default; "unbounded" turns it off, to show the
starvation it prevents). SGLang's lpm and dfs-weight run on the same workloads. Writes
fairness.json and fairness.md into results/NAME/ (default: the commit).
"""

from __future__ import annotations

from itertools import product

from feather_sched.bench.study import (
    Study,
    fairness_cells,
    markdown_table,
    offline_rate,
    parser,
    sim_plan,
)
from feather_sched.results.summary import group_ttfts, summarize
from feather_sched.sim.runner import simulate
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import minority_groups

SCHEDULERS = ("fcfs", "sglang-lpm", "sglang-dfs-weight", "feather-chunk-loss",
              "feather-bandit", "feather-chunk-loss-unbounded", "feather-bandit-unbounded")
HARDWARE = ("rtx6000-ada", "h100-sxm")
SHAPES = (
    # (majority, minority groups, prefix tokens, suffix tokens, output tokens)
    (400, (20,), 4096, 512, 64),
    (400, (10, 10, 10), 1024, 64, 64),
    (200, (5, 5, 5, 5), 10240, 32, 50),
)
LOAD = 3.0


def runs(hardware: str, shape: tuple) -> list[dict]:
    """Every scheduler's row at ``LOAD`` x FCFS's offline request rate."""
    majority, minorities, prefix, suffix, output = shape

    def workload(rate: float | None):
        return minority_groups(majority=majority, minorities=minorities, prefix_len=prefix,
                               suffix_len=suffix, output_len=output,
                               arrival=ArrivalSpec("poisson", rate) if rate else None, seed=0)

    rate = LOAD * offline_rate(sim_plan(workload(None), hardware))
    overloaded = sim_plan(workload(rate), hardware)
    rows = []
    for label in SCHEDULERS:
        run = simulate(overloaded, label)
        rows.append({"hardware": hardware, "majority": majority, "minorities": list(minorities),
                     "prefix": prefix, "rate": rate, "scheduler": label,
                     "output_throughput": summarize(run)["output_throughput"],
                     "groups": group_ttfts([r for r in run.records if r.success])})
    return rows


def markdown(rows: list[dict]) -> str:
    """Per workload and scheduler: the worst ratio to FCFS over groups, mean and p99."""
    fcfs = {_shape(row): row["groups"] for row in rows if row["scheduler"] == "fcfs"}
    return markdown_table(
        ["hardware", "workload", "scheduler", "tok/s", "majority mean / p99 TTFT s",
         "worst minority mean / p99 TTFT s", "worst group ratio to FCFS (mean / p99)"],
        ([row["hardware"], f"{row['majority']} + {'/'.join(map(str, row['minorities']))}, "
          f"{row['prefix']} prefix", row["scheduler"], f"{row['output_throughput']:,.0f}",
          *fairness_cells(row["groups"], fcfs[_shape(row)])] for row in rows))


def _shape(row: dict) -> tuple:
    return row["hardware"], row["majority"], tuple(row["minorities"]), row["prefix"]


def main() -> None:
    study = Study(__file__, set_name=parser(__doc__).parse_args().set)
    rows = []
    for hardware, shape in study.each(product(HARDWARE, SHAPES),
                                      lambda cell: f"{cell[0]} {cell[1]} done"):
        rows += runs(hardware, shape)
    study.save("fairness", {"rows": rows}, markdown(rows))


if __name__ == "__main__":
    main()
