"""The simulator's decomposition: scheduling vs a shared-prefix kernel, on H100 and H200.

    .venv/bin/python benchmarks/sim/shared_prefix.py [--seeds 3] [--set NAME]

Llama-3-8B on the datasheet profiles of the H100 SXM and H200; 8 groups x 100 and 100
groups x 30 requests sharing 4K- or 10K-token prefixes, 32-token suffixes, 50 output
tokens, Poisson arrivals at 100 requests/s (an overloaded server). Four runs per cell:
vLLM's FCFS (``fcfs``), FCFS with a kernel that reads each group's prefix once per step
(``fcfs-shared``: the cost model's cascade term), Feather (``feather-model``, its
defaults) and Feather with that kernel (``feather-model-shared``). Each cell runs over
``--seeds`` workload seeds; the table gives the median output-throughput ratio to plain
FCFS with its range. Writes shared-prefix.json and shared-prefix.md into results/NAME/
(default: the commit).
"""

from __future__ import annotations

from itertools import product

from feather_sched.bench.study import (
    Study,
    by_scheduler,
    median,
    parser,
    ratio,
    sim_plan,
    summaries,
    table,
)
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import shared_prefix_groups

SCHEDULERS = ("fcfs", "fcfs-shared", "feather-model", "feather-model-shared")
HARDWARE = ("h100-sxm", "h200")
SHAPES = ((8, 100), (100, 30))
PREFIXES = (4096, 10240)
RATE = 100.0
RATIOS = (*((name, "fcfs") for name in SCHEDULERS[1:]), ("feather-model-shared", "fcfs-shared"))
"""(scheduler, base) of each ratio column."""
COLUMNS = (
    ("hardware", lambda row: row["hardware"]),
    ("groups x requests", lambda row: f"{row['groups']} x {row['per_group']}"),
    ("prefix", lambda row: str(row["prefix"])),
    ("FCFS tok/s", lambda row: median(by_scheduler(row["runs"])["fcfs"], "output_throughput",
                                      "{:,.0f}")),
    *((f"{name} / {base}", lambda row, name=name, base=base: ratio(
        by_scheduler(row["runs"])[name], by_scheduler(row["runs"])[base],
        "output_throughput")) for name, base in RATIOS),
)
"""The table: a row a cell, ratios per seed, then their median (range)."""


def run_cell(hardware: str, groups: int, per_group: int, prefix: int, seed: int) -> dict:
    workload = shared_prefix_groups(groups=groups, prompts_per_group=per_group,
                                    prefix_len=prefix, suffix_len=32, output_len=50,
                                    arrival=ArrivalSpec(kind="poisson", rate=RATE), seed=seed)
    return summaries(sim_plan(workload, hardware), SCHEDULERS)


def markdown(rows: list[dict]) -> str:
    return table(COLUMNS, rows)


def main() -> None:
    args = parser(__doc__, seeds=3).parse_args()
    study = Study(__file__, set_name=args.set)
    rows = []
    for hardware, (groups, per_group), prefix in study.each(
            product(HARDWARE, SHAPES, PREFIXES),
            lambda cell: f"{cell[0]} {cell[1][0]}x{cell[1][1]} {cell[2]}"):
        runs = [run_cell(hardware, groups, per_group, prefix, seed)
                for seed in range(args.seeds)]
        rows.append({"hardware": hardware, "groups": groups, "per_group": per_group,
                     "prefix": prefix, "rate": RATE, "runs": runs})
    study.save("shared-prefix", {"rows": rows}, markdown(rows))


if __name__ == "__main__":
    main()
