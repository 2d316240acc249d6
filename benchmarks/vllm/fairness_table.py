"""Each group's TTFT against the same group under FCFS, from ``feather bench --json`` files.

    .venv/bin/python benchmarks/vllm/fairness_table.py RESULT.json [RESULT.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from feather_sched.results.summary import worst_group_ratios

TARGET = 1.25


def rows(path: Path) -> list[str]:
    document = json.loads(path.read_text())
    runs = document["runs"]
    fcfs = runs["fcfs"]["ttft_by_group"]
    lines = []
    for name, run in runs.items():
        groups = run["ttft_by_group"]
        mean, p99 = worst_group_ratios(groups, fcfs)
        minority = max((g for k, g in groups.items() if k != "0"),
                       key=lambda g: g["mean_ttft_ms"])
        verdict = "" if max(mean, p99) <= TARGET else " over"
        lines.append(
            f"| {document['config']['workload']} | {name} | {run['output_throughput']:.1f} | "
            f"{groups['0']['mean_ttft_ms'] / 1e3:.2f} / {groups['0']['p99_ttft_ms'] / 1e3:.2f} | "
            f"{minority['mean_ttft_ms'] / 1e3:.2f} / {minority['p99_ttft_ms'] / 1e3:.2f} | "
            f"{mean:.2f}x / {p99:.2f}x{verdict} |")
    return lines


def main() -> None:
    print("| workload | scheduler | out tok/s | majority TTFT mean / p99 s | "
          "worst minority TTFT mean / p99 s | worst group vs FCFS (mean / p99) |")
    print("|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        print("\n".join(rows(Path(path))))


if __name__ == "__main__":
    main()
