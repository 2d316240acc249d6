"""FeatherRouter's relative load bound (``balance_rel``): Feather's pair against Ray's
prefix-affinity rule + FCFS, per bound, in the cells where the bound acts.

    .venv/bin/python benchmarks/replicas/balance.py [--seeds N] [--jobs J] [--set NAME]

The bound acts where queues are long (past 64 requests with ``balance_abs`` 32 and a
relative bound of 1.5; past 320 with 1.1): at 3x power-of-two's capacity.  Cells as
``sim.py`` (8 replicas, Llama-3-8B, Zipf groups, 2,400 requests) where the choice showed:
64 groups of 5K and 10K-token prefixes on H100 and H200, 400 groups of 5K prefixes and 8
of 10K on the H200; both loads; about 12 minutes.  Writes balance.json (every run) and
balance.md (medians over seeds of per-seed ratios to Ray's rule, worst imbalance, prompt
tokens computed over the floor) into results/NAME/ (default: the commit).
"""

from __future__ import annotations

from itertools import product

from sim import AFFINITY, LOADS, OURS, capacities, run_task, setting_table, study_main

from feather_sched.bench.study import parallel

BOUNDS = (1.1, 1.5, 2.0, 3.0)
TABLE = ("Feather's pair with each `balance_rel` over Ray's prefix-affinity rule + FCFS: "
         "throughput and p99 TTFT ratios (median of per-seed ratios, range), worst replica "
         "imbalance, prompt tokens computed over the floor (median).",
         ["hardware", "groups", "prefix", "load", "balance_rel", "x prefix-affinity",
          "p99 TTFT / prefix-affinity's", "imbalance (worst)", "prefill / floor"])
"""The table's introduction and columns."""
CELLS = (("h200", 64, 5120), ("h100-sxm", 64, 5120), ("h200", 64, 10240),
         ("h100-sxm", 64, 10240), ("h200", 400, 5120), ("h200", 8, 10240))


def measure(seeds: int, jobs: int) -> list[dict]:
    """Power-of-two + FCFS's capacity per cell and seed, then Ray's rule + FCFS and
    Feather's pair with each bound at every load."""
    cells = [(*cell, seed) for cell, seed in product(CELLS, range(seeds))]
    capacity = capacities(cells, {}, jobs)
    pairs = [(AFFINITY, {})] + [(OURS, {"balance_rel": bound}) for bound in BOUNDS]
    tasks = [(hw, groups, prefix, load * capacity[hw, groups, prefix, seed], seed, *pair,
              options) for (hw, groups, prefix, seed), load, (pair, options)
             in product(cells, LOADS, pairs)]
    runs = parallel(run_task, tasks, jobs)
    for task, row in zip(tasks, runs, strict=True):
        hw, groups, prefix, rate, seed = task[:5]
        row.update(prefix=prefix, load=round(rate / capacity[hw, groups, prefix, seed], 6))
    return runs


def markdown(runs: list[dict]) -> str:
    settings = (([hw, str(groups), str(prefix), f"{load:g}x", f"{bound:g}"],
                 (hw, groups, prefix, load, OURS[0], bound),
                 (hw, groups, prefix, load, AFFINITY[0], None))
                for (hw, groups, prefix), load, bound in product(CELLS, LOADS, BOUNDS))
    return setting_table(runs, lambda r: (r["hardware"], r["groups"], r["prefix"], r["load"],
                                          r["router"], r.get("balance_rel")),
                         settings, "p99_ttft_ms", ("prefill_over_floor", "{:.2f}"), *TABLE)


def main() -> None:
    study_main(__file__, __doc__, "balance", measure, markdown,
               {"bounds": BOUNDS, "cells": CELLS, "loads": LOADS})


if __name__ == "__main__":
    main()
