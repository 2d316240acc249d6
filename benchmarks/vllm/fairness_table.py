"""Each group's TTFT against the same group under FCFS, from ``feather bench --json`` files.

    .venv/bin/python benchmarks/vllm/fairness_table.py RESULT.json [RESULT.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from feather_sched.bench.study import fairness_cells, markdown_table


def rows(path: Path) -> list[list[str]]:
    document = json.loads(path.read_text())
    runs = document["runs"]
    fcfs = runs["fcfs"]["ttft_by_group"]
    return [[document["config"]["workload"], name, f"{run['output_throughput']:.1f}",
             *fairness_cells(run["ttft_by_group"], fcfs)] for name, run in runs.items()]


def main() -> None:
    print(markdown_table(
        ["workload", "scheduler", "out tok/s", "majority TTFT mean / p99 s",
         "worst minority TTFT mean / p99 s", "worst group vs FCFS (mean / p99)"],
        (row for path in sys.argv[1:] for row in rows(Path(path)))))


if __name__ == "__main__":
    main()
