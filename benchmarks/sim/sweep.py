"""The simulator's results table: Feather vs vLLM FCFS vs SGLang LPM / DFS-weight.

    .venv/bin/python benchmarks/sim/sweep.py [--quick]

Llama-3-8B on RTX 6000 Ada and H100 SXM; shared prefixes of 1K, 5K and 10K tokens in 1, 8
and 100 groups, 800 requests, decode lengths 50 and 200; offline (all at once) and Poisson
arrivals at 1.5x FCFS's offline request rate (an overloaded server, where the scheduler
decides the throughput; below capacity every scheduler serves the arrival rate); plus no
sharing. Feather runs with its defaults (the overtaking bound on), with each gate (``model``
starts from the simulated GPU's profile, as a user would give theirs); "unbounded" runs
turn the bound off, to show the share of the gain the bound keeps. Writes sweep.json and
sweep.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS
from feather_sched.results.summary import summarize
from feather_sched.sim.runner import SimPlan, simulate
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import no_sharing, shared_prefix_groups

HERE = Path(__file__).parent
SCHEDULERS = ("fcfs", "sglang-lpm", "sglang-dfs-weight", "feather-always",
              "feather-chunk-loss", "feather-bandit", "feather-model",
              "feather-always-unbounded", "feather-bandit-unbounded")

REQUESTS = 800
POISSON_LOAD = 1.5
SUFFIX = 32


def workload(groups: int | None, prefix: int, output: int, rate: float | None):
    arrival = None if rate is None else ArrivalSpec(kind="poisson", rate=rate)
    if groups is None:
        return no_sharing(requests=REQUESTS, prompt_len=prefix + SUFFIX, output_len=output,
                          arrival=arrival, seed=0)
    return shared_prefix_groups(groups=groups, prompts_per_group=REQUESTS // groups,
                                prefix_len=prefix, suffix_len=SUFFIX, output_len=output,
                                arrival=arrival, seed=0)


def cell(hardware: str, groups: int | None, prefix: int, output: int) -> list[dict]:
    """Offline, then Poisson at 1.5x FCFS's offline request rate."""
    rows = []
    rate = None
    for mode in ("offline", "poisson"):
        plan = SimPlan(workload=workload(groups, prefix, output, rate),
                       hardware=HARDWARE[hardware], model=MODELS["llama-3-8b"])
        for name in SCHEDULERS:
            summary = summarize(simulate(plan, name))
            rows.append({"hardware": hardware, "groups": groups or 0, "prefix": prefix,
                         "output": output, "mode": mode, "rate": rate, "scheduler": name,
                         **{k: summary[k] for k in (
                             "request_throughput", "output_throughput", "mean_ttft_ms",
                             "mean_tpot_ms", "mean_batch_size", "mean_groups_per_step",
                             "hbm_bytes_per_output_token", "modelled_l2_hit_rate")}})
        rate = POISSON_LOAD * rows[0]["request_throughput"]
    return rows


def kept(by_name: dict[str, dict], name: str) -> str:
    """The share of the unbounded version's gain over FCFS that the bounded one keeps
    (where the unbounded gain is at least 5%)."""
    base = by_name["fcfs"]["output_throughput"]
    bounded = by_name[name]["output_throughput"] - base
    unbounded = by_name[f"{name}-unbounded"]["output_throughput"] - base
    return f"{100 * bounded / unbounded:.0f}%" if unbounded > 0.05 * base else "-"


def model_over_fixed(by_name: dict[str, dict]) -> float:
    """The model gate's throughput over the better of always-add and chunk-loss."""
    best = max(by_name[n]["output_throughput"] for n in ("feather-always", "feather-chunk-loss"))
    return by_name["feather-model"]["output_throughput"] / best


def markdown(rows: list[dict]) -> str:
    """One line per cell: output throughput of each scheduler as a ratio to FCFS, and the
    share of the gain the overtaking bound keeps."""
    header = ("| hardware | groups | prefix | output | mode | FCFS tok/s | "
              + " | ".join(SCHEDULERS[1:])
              + " | gain kept (always) | gain kept (bandit) | model / best fixed gate |")
    lines = [header, "|" + "---|" * (9 + len(SCHEDULERS) - 1)]
    cells: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        key = tuple(row[k] for k in ("hardware", "groups", "prefix", "output", "mode"))
        cells.setdefault(key, {})[row["scheduler"]] = row
    for key, by_name in cells.items():
        base = by_name["fcfs"]["output_throughput"]
        ratios = [f"{by_name[n]['output_throughput'] / base:.2f}x" for n in SCHEDULERS[1:]]
        ratios += [kept(by_name, "feather-always"), kept(by_name, "feather-bandit"),
                   f"{model_over_fixed(by_name):.3f}"]
        groups = "none" if key[1] == 0 else key[1]
        lines.append(f"| {key[0]} | {groups} | {key[2]} | {key[3]} | {key[4]} | {base:,.0f} | "
                     + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one hardware, fewer cells")
    args = parser.parse_args()
    hardware = ("h100-sxm",) if args.quick else ("rtx6000-ada", "h100-sxm")
    prefixes = (5120,) if args.quick else (1024, 5120, 10240)
    outputs = (50,) if args.quick else (50, 200)
    started = time.perf_counter()
    rows = []
    for hw in hardware:
        for output in outputs:
            for prefix in prefixes:
                for groups in (1, 8, 100):
                    rows += cell(hw, groups, prefix, output)
                    print(f"{hw} {groups} groups {prefix} prefix {output} out: "
                          f"{time.perf_counter() - started:.0f} s", flush=True)
            rows += cell(hw, None, 1024, output)
    (HERE / "sweep.json").write_text(json.dumps(rows, indent=1))
    (HERE / "sweep.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
