"""Feather across replicas in the simulator: 8 engines behind each router, FCFS or Feather.

    .venv/bin/python benchmarks/replicas/sim.py [--quick]

Llama-3-8B on 8 replicas of H100 SXM and of H200 (datasheet profiles); 8, 64 and 400
prefix groups of 10K-token prefixes (32 unique tokens each, 100 output tokens) with Zipf
popularity (s = 1.1), 2,400 requests per cell; plus a no-sharing cell (1K-token unique
prompts).  Poisson arrivals at 1.5x the request rate power-of-two + FCFS reaches with
every request sent at once (its capacity on that workload), so the system is overloaded
and the routing and scheduling decide the throughput.  Routers: round-robin,
power-of-two, prefix-affinity (Ray Serve's rule), sglang-cache-aware, feather; replicas
run FCFS or Feather (bandit gate, defaults).  Writes sim.json and sim.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from feather_sched.routers import ROUTERS, make_router
from feather_sched.sim.hardware import HARDWARE
from feather_sched.sim.model_profiles import MODELS
from feather_sched.sim.replicas import simulate_replicas
from feather_sched.sim.runner import SimPlan
from feather_sched.workloads import ArrivalSpec, Workload, no_sharing, shared_prefix_groups

HERE = Path(__file__).parent
REPLICAS = 8
REQUESTS = 2400
PREFIX = 10240
SUFFIX = 32
OUTPUT = 100
LOAD = 1.5
SCHEDULERS = ("fcfs", "feather-bandit")
BASELINE = ("power-of-two", "fcfs")
KEYS = ("output_throughput", "request_throughput", "mean_ttft_ms", "p99_ttft_ms",
        "replica_imbalance", "prefix_cache_hit_rate", "mean_groups_per_step",
        "groups_per_replica", "preemptions")


def workload(groups: int | None, rate: float | None) -> Workload:
    arrival = None if rate is None else ArrivalSpec(kind="poisson", rate=rate)
    if groups is None:
        return no_sharing(requests=REQUESTS, prompt_len=1024 + SUFFIX, output_len=OUTPUT,
                          arrival=arrival, seed=0)
    return shared_prefix_groups(groups=groups, prompts_per_group=REQUESTS // groups,
                                prefix_len=PREFIX, suffix_len=SUFFIX, output_len=OUTPUT,
                                popularity="zipf", arrival=arrival, seed=0)


def run(hardware: str, load: Workload, router: str, scheduler: str) -> dict:
    plan = SimPlan(workload=load, hardware=HARDWARE[hardware], model=MODELS["llama-3-8b"])
    result = simulate_replicas(plan, make_router(router, range(REPLICAS), seed=0), scheduler)
    summary = result.summary()
    return {"router": router, "scheduler": scheduler, **{k: summary[k] for k in KEYS}}


def cell(hardware: str, groups: int | None, load: float = LOAD) -> dict:
    """The baseline's capacity (all requests at once), then every pair at ``load`` x it."""
    capacity = run(hardware, workload(groups, None), *BASELINE)["request_throughput"]
    rate = load * capacity
    arrivals = workload(groups, rate)
    rows = [run(hardware, arrivals, router, scheduler)
            for router in ROUTERS for scheduler in SCHEDULERS]
    return {"hardware": hardware, "groups": groups or 0, "capacity_req_s": capacity,
            "rate_req_s": rate, "runs": rows}


def ratios(cell_: dict) -> dict[tuple[str, str], float]:
    by_pair = {(r["router"], r["scheduler"]): r for r in cell_["runs"]}
    base = by_pair[BASELINE]["output_throughput"]
    return {pair: r["output_throughput"] / base for pair, r in by_pair.items()}


def markdown(cells: list[dict]) -> str:
    """Per cell, each router and scheduler: output throughput over power-of-two + FCFS,
    p99 TTFT, replica imbalance and groups per replica; then the issue's targets."""
    lines = ["| hardware | groups | rate req/s | router | scheduler | tok/s | x p2+FCFS | "
             "mean / p99 TTFT ms | imbalance | groups per replica |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        ratio = ratios(c)
        for r in c["runs"]:
            pair = (r["router"], r["scheduler"])
            lines.append(
                f"| {c['hardware']} | {c['groups'] or 'none'} | {c['rate_req_s']:.1f} | "
                f"{pair[0]} | {pair[1]} | {r['output_throughput']:,.0f} | {ratio[pair]:.2f}x | "
                f"{r['mean_ttft_ms']:,.0f} / {r['p99_ttft_ms']:,.0f} | "
                f"{r['replica_imbalance']:.2f} | {r['groups_per_replica']} |")
    lines += ["", "Targets (feather + feather-bandit): >= 1.5x power-of-two + FCFS, >= 1.15x "
              "prefix-affinity + FCFS, imbalance <= 1.3, p99 TTFT <= prefix-affinity + FCFS's; "
              "no loss without sharing.", "",
              "| hardware | groups | x p2+FCFS | x prefix-affinity+FCFS | imbalance | "
              "p99 TTFT / prefix-affinity+FCFS's |", "|---|---|---|---|---|---|"]
    for c in cells:
        ratio = ratios(c)
        by_pair = {(r["router"], r["scheduler"]): r for r in c["runs"]}
        ours, affinity = by_pair[("feather", "feather-bandit")], by_pair[("prefix-affinity",
                                                                          "fcfs")]
        lines.append(
            f"| {c['hardware']} | {c['groups'] or 'none'} | "
            f"{ratio[('feather', 'feather-bandit')]:.2f}x | "
            f"{ratio[('feather', 'feather-bandit')] / ratio[('prefix-affinity', 'fcfs')]:.2f}x"
            f" | {ours['replica_imbalance']:.2f} | "
            f"{ours['p99_ttft_ms'] / affinity['p99_ttft_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="H100 and 64 groups only")
    parser.add_argument("--load", type=float, default=LOAD,
                        help="arrival rate / power-of-two + FCFS's capacity; other than "
                             f"{LOAD}, writes sim-load-<load>.json/md")
    args = parser.parse_args()
    hardware = ("h100-sxm",) if args.quick else ("h100-sxm", "h200")
    group_counts: tuple[int | None, ...] = (64,) if args.quick else (8, 64, 400, None)
    started = time.perf_counter()
    cells = []
    for hw in hardware:
        for groups in group_counts:
            cells.append(cell(hw, groups, args.load))
            print(f"{hw} {groups or 'no'} groups: {time.perf_counter() - started:.0f} s",
                  flush=True)
    config = {"replicas": REPLICAS, "requests": REQUESTS, "prefix": PREFIX, "suffix": SUFFIX,
              "output": OUTPUT, "load": args.load, "zipf_s": 1.1, "model": "llama-3-8b",
              "wall_s": time.perf_counter() - started}
    stem = "sim" if args.load == LOAD else f"sim-load-{args.load:g}"
    (HERE / f"{stem}.json").write_text(json.dumps({"config": config, "cells": cells},
                                                  indent=1))
    (HERE / f"{stem}.md").write_text(markdown(cells))
    print(markdown(cells))


if __name__ == "__main__":
    main()
