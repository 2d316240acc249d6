"""FeatherRouter's load band on the precise index, in the eviction-heavy cells.

    .venv/bin/python benchmarks/replicas/band.py [--seeds N] [--jobs J] [--set NAME]

The band is where affinity may act: replicas whose load exceeds neither the least loaded
replica's plus ``balance_abs`` nor its times ``balance_rel``.  Cells as ``sim.py
--kv-blocks 2048``: 8 replicas of Llama-3-8B on the H100 profile, each with 2,048 KV
blocks (32K tokens: about six of the 5K-token prefixes), 64 and 400 Zipf groups, one
router and four (``--ingresses``), at 1.5x and 3x power-of-two + FCFS's capacity; Feather
scheduling behind FeatherRouter on the precise index with each band; about 10 minutes.
Writes band.json (every run) and band.md (medians over seeds of throughput and p90 TTFT
against the default band's, worst imbalance, prefix-cache hits) into results/NAME/
(default: the commit).
"""

from __future__ import annotations

from itertools import product

from sim import LOADS, PRECISE, capacities, run_task, setting_table, study_main

from feather_sched.bench.study import parallel

BANDS = ((8, 1.5), (16, 1.5), (32, 1.5), (64, 1.5), (32, 1.25), (32, 2.0))
"""(balance_abs, balance_rel); (32, 1.5) is the default."""
DEFAULT = (32, 1.5)
CELLS = ((64, 1), (400, 1), (64, 4), (400, 4))
"""(groups, routers)."""
HARDWARE, PREFIX, KV_BLOCKS = "h100-sxm", 5120, 2048
TABLE = ("Feather's pair on the precise index with each band, over the default band (32, "
         "1.5): throughput and p90 TTFT ratios (median of per-seed ratios, range), worst "
         "replica imbalance, prefix-cache hits (median).",
         ["groups", "routers", "load", "balance_abs", "balance_rel", "tok/s x default",
          "p90 TTFT / default's", "imbalance (worst)", "prefix hits"])
"""The table's introduction and columns."""


def measure(seeds: int, jobs: int) -> list[dict]:
    """Power-of-two + FCFS's capacity per group count and seed, then Feather's pair on
    the precise index with every band in every cell and load."""
    groups_seeds = list(product({g for g, _ in CELLS}, range(seeds)))
    measured = capacities([(HARDWARE, groups, PREFIX, seed) for groups, seed in groups_seeds],
                          {"kv_blocks": KV_BLOCKS}, jobs)
    capacity = {(groups, seed): measured[HARDWARE, groups, PREFIX, seed]
                for groups, seed in groups_seeds}
    tasks = [(HARDWARE, groups, PREFIX, load * capacity[groups, seed], seed, PRECISE,
              "feather-bandit", {"kv_blocks": KV_BLOCKS, "ingresses": routers,
                                 "balance_abs": band[0], "balance_rel": band[1]})
             for (groups, routers), seed, load, band
             in product(CELLS, range(seeds), LOADS, BANDS)]
    runs = parallel(run_task, tasks, jobs)
    for task, row in zip(tasks, runs, strict=True):
        groups, _, rate, seed = task[1:5]
        row["load"] = round(rate / capacity[groups, seed], 6)
    return runs


def markdown(runs: list[dict]) -> str:
    settings = (([str(groups), str(routers), f"{load:g}x", str(band[0]), f"{band[1]:g}"],
                 (groups, routers, load, *band), (groups, routers, load, *DEFAULT))
                for (groups, routers), load, band in product(CELLS, LOADS, BANDS))
    return setting_table(runs, lambda r: (r["groups"], r["ingresses"], r["load"],
                                          r["balance_abs"], r["balance_rel"]),
                         settings, "p90_ttft_ms", ("prefix_cache_hit_rate", "{:.3f}"), *TABLE)


def main() -> None:
    study_main(__file__, __doc__, "band", measure, markdown,
               {"bands": BANDS, "cells": CELLS, "loads": LOADS, "hardware": HARDWARE,
                "prefix": PREFIX, "kv_blocks": KV_BLOCKS})


if __name__ == "__main__":
    main()
