"""Tenants on the real engine: Feather's fair share and VTC with Feather's shared-prefix
attention, each against VTC (``benchmarks/vllm/tenants.sh``).

    .venv/bin/python benchmarks/vllm/tenants_table.py TENANTS.json

Each ratio is taken per round (the rounds ran minutes apart), then the median and range
over rounds; the targets are the issue's (the simulator's, ``benchmarks/sim/tenants.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from feather_sched.bench.study import Figure, load_rounds, markdown_table, ratios
from feather_sched.results.summary import median_and_range, pool_tenants
from feather_sched.workloads.synthetic import LIGHT_USER_PREFIX

BASE = "vtc"
RUNS = ("feather-model-fair", "vtc-shared")


LIGHT = "light users"
"""The tenants ``user0``, ``user1``, ... taken together (``pool_tenants``)."""


def tenant_ttft(tenant: str) -> Figure:
    return lambda run: pool_tenants(run["by_tenant"], LIGHT_USER_PREFIX,
                                    LIGHT)[tenant]["mean_ttft_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tenants", type=Path)
    args = parser.parse_args()
    runs = load_rounds(args.tenants)
    tenants = sorted(pool_tenants(runs[BASE][0]["by_tenant"], LIGHT_USER_PREFIX, LIGHT))
    compared = [run for run in RUNS if run in runs]  # the interactive cell: no vtc-shared

    def row(name: str, figure: Figure, target: str) -> list[str]:
        return [name, *(median_and_range(ratios(runs[run], runs[BASE], figure), "{:.2f}",
                                         "x", " - ") for run in compared), target]

    gapped = all(r["max_service_gap"] for r in runs[BASE])  # none where users come and go
    rows = [*([row("largest service gap", "max_service_gap", "<= 1.5x")] if gapped else []),
            row("output tok/s", "output_throughput", ">= 1.5x"),
            *(row(f"{tenant} mean TTFT", tenant_ttft(tenant), "<= 1.25x")
              for tenant in tenants)]
    print(markdown_table([f"figure (run / {BASE})", *compared, "target"], rows))
    print()
    figures = ("output_throughput", *(["max_service_gap"] if gapped else []),
               "prefix_cache_hit_rate", "preemptions")
    print(markdown_table(
        ["run", *figures, *(f"{t} TTFT ms" for t in tenants)],
        ([name, *(median_and_range([r[f] for r in summaries], "{:,.2f}", "", " - ")
                  for f in figures),
          *(median_and_range([tenant_ttft(t)(r) for r in summaries], "{:,.0f}", "", " - ")
            for t in tenants)]
         for name, summaries in runs.items())))


if __name__ == "__main__":
    main()
