"""FeatherRouter's load band on the precise index, in the eviction-heavy cells.

    .venv/bin/python benchmarks/replicas/band.py [--seeds N] [--jobs J]   # ~10 min

The band is where affinity may act: replicas whose load exceeds neither the least loaded
replica's plus ``balance_abs`` nor its times ``balance_rel``.  Cells as ``sim.py
--kv-blocks 2048``: 8 replicas of Llama-3-8B on the H100 profile, each with 2,048 KV
blocks (32K tokens: about six of the 5K-token prefixes), 64 and 400 Zipf groups, one
router and four (``--ingresses``), at 1.5x and 3x power-of-two + FCFS's capacity; Feather
scheduling behind FeatherRouter on the precise index with each band.  Writes band.json
(every run) and band.md (medians over seeds of throughput and p90 TTFT against the
default band's, worst imbalance, prefix-cache hits) here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from itertools import product

from sim import BASELINE, LOADS, PRECISE, over, run_task, save

BANDS = ((8, 1.5), (16, 1.5), (32, 1.5), (64, 1.5), (32, 1.25), (32, 2.0))
"""(balance_abs, balance_rel); (32, 1.5) is the default."""
DEFAULT = (32, 1.5)
CELLS = ((64, 1), (400, 1), (64, 4), (400, 4))
"""(groups, routers)."""
HARDWARE, PREFIX, KV_BLOCKS = "h100-sxm", 5120, 2048


def measure(seeds: int, jobs: int) -> list[dict]:
    """Power-of-two + FCFS's capacity per group count and seed, then Feather's pair on
    the precise index with every band in every cell and load."""
    capacity_cells = list(product({g for g, _ in CELLS}, range(seeds)))
    with ProcessPoolExecutor(jobs) as pool:
        capacity = dict(zip(capacity_cells, (r["request_throughput"] for r in pool.map(
            run_task, [(HARDWARE, groups, PREFIX, None, seed, *BASELINE, {"kv_blocks": KV_BLOCKS})
                   for groups, seed in capacity_cells])), strict=True))
        tasks = [(HARDWARE, groups, PREFIX, load * capacity[groups, seed], seed, PRECISE,
                  "feather-bandit", {"kv_blocks": KV_BLOCKS, "ingresses": routers,
                                     "balance_abs": band[0], "balance_rel": band[1]})
                 for (groups, routers), seed, load, band
                 in product(CELLS, range(seeds), LOADS, BANDS)]
        runs = list(pool.map(run_task, tasks))
    for task, row in zip(tasks, runs, strict=True):
        groups, _, rate, seed = task[1:5]
        row["load"] = round(rate / capacity[groups, seed], 6)
    return runs


def markdown(runs: list[dict]) -> str:
    lines = ["Feather's pair on the precise index with each band, over the default band "
             "(32, 1.5): throughput and p90 TTFT ratios (median of per-seed ratios, range), "
             "worst replica imbalance, prefix-cache hits (median).", "",
             "| groups | routers | load | balance_abs | balance_rel | tok/s x default | "
             "p90 TTFT / default's | imbalance (worst) | prefix hits |",
             "|---|---|---|---|---|---|---|---|---|"]
    keyed = {(r["groups"], r["ingresses"], r["load"], r["balance_abs"], r["balance_rel"],
              r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    for (groups, routers), load, band in product(CELLS, LOADS, BANDS):
        ours = [keyed[groups, routers, load, *band, s] for s in seeds]
        base = [keyed[groups, routers, load, *DEFAULT, s] for s in seeds]

        lines.append(
            f"| {groups} | {routers} | {load:g}x | {band[0]} | {band[1]:g} | "
            f"{over(ours, base, 'output_throughput')} | {over(ours, base, 'p90_ttft_ms')} | "
            f"{max(r['replica_imbalance'] for r in ours):.2f} | "
            f"{statistics.median(r['prefix_cache_hit_rate'] for r in ours):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds per cell")
    parser.add_argument("--jobs", type=int, default=2, help="processes")
    args = parser.parse_args()
    started = time.perf_counter()
    runs = measure(args.seeds, args.jobs)
    config = {"bands": BANDS, "cells": CELLS, "loads": LOADS, "seeds": args.seeds,
              "hardware": HARDWARE, "prefix": PREFIX, "kv_blocks": KV_BLOCKS,
              "wall_s": time.perf_counter() - started}
    save("band", config, runs, markdown(runs), started)


if __name__ == "__main__":
    main()
