"""The simulator's decomposition: scheduling vs a shared-prefix kernel, on H100 and H200.

    .venv/bin/python benchmarks/sim/shared_prefix.py [--seeds 3]

Llama-3-8B on the datasheet profiles of the H100 SXM and H200; 8 groups x 100 and 100
groups x 30 requests sharing 4K- or 10K-token prefixes, 32-token suffixes, 50 output
tokens, Poisson arrivals at 100 requests/s (an overloaded server). Four runs per cell:
vLLM's FCFS (``fcfs``), FCFS with a kernel that reads each group's prefix once per step
(``fcfs-shared``: the cost model's cascade term), Feather (``feather-model``, its
defaults) and Feather with that kernel (``feather-model-shared``). Each cell runs over
``--seeds`` workload seeds; the table gives the median output-throughput ratio to plain
FCFS with its range. Writes shared-prefix.json and shared-prefix.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS
from feather_sched.results.summary import summarize
from feather_sched.sim.runner import SimPlan, simulate
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import shared_prefix_groups

HERE = Path(__file__).parent
SCHEDULERS = ("fcfs", "fcfs-shared", "feather-model", "feather-model-shared")
SHAPES = ((8, 100), (100, 30))
PREFIXES = (4096, 10240)
HARDWARE_NAMES = ("h100-sxm", "h200")
RATE = 100.0


def run_cell(hardware: str, groups: int, per_group: int, prefix: int, seed: int) -> dict:
    workload = shared_prefix_groups(groups=groups, prompts_per_group=per_group,
                                    prefix_len=prefix, suffix_len=32, output_len=50,
                                    arrival=ArrivalSpec(kind="poisson", rate=RATE), seed=seed)
    plan = SimPlan(workload=workload, hardware=HARDWARE[hardware], model=MODELS["llama-3-8b"])
    return {name: summarize(simulate(plan, name)) for name in SCHEDULERS}


def markdown(rows: list[dict]) -> str:
    lines = ["| hardware | groups x requests | prefix | FCFS tok/s | "
             + " | ".join(f"{name} / fcfs" for name in SCHEDULERS[1:])
             + " | feather-model-shared / fcfs-shared |",
             "|---|---|---|---|" + "---|" * len(SCHEDULERS)]
    for row in rows:
        runs = row["runs"]
        ratios = [_spread([run[name]["output_throughput"] / run["fcfs"]["output_throughput"]
                           for run in runs]) for name in SCHEDULERS[1:]]
        ratios.append(_spread([run["feather-model-shared"]["output_throughput"]
                               / run["fcfs-shared"]["output_throughput"] for run in runs]))
        base = statistics.median(run["fcfs"]["output_throughput"] for run in runs)
        lines.append(f"| {row['hardware']} | {row['groups']} x {row['per_group']} | "
                     f"{row['prefix']} | {base:,.0f} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    for hardware in HARDWARE_NAMES:
        for groups, per_group in SHAPES:
            for prefix in PREFIXES:
                runs = [run_cell(hardware, groups, per_group, prefix, seed)
                        for seed in range(args.seeds)]
                rows.append({"hardware": hardware, "groups": groups, "per_group": per_group,
                             "prefix": prefix, "rate": RATE, "runs": runs})
                print(f"{hardware} {groups}x{per_group} {prefix}: "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
    (HERE / "shared-prefix.json").write_text(json.dumps(
        {"command": f"benchmarks/sim/shared_prefix.py --seeds {args.seeds}", "rows": rows},
        indent=1))
    text = markdown(rows)
    (HERE / "shared-prefix.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
