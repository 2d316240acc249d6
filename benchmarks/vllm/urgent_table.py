"""Urgent preemption on the real engine: Feather under vLLM's priority policy, with urgent
preemption on and off, each against vLLM's own priority policy (``benchmarks/vllm/
urgent.sh``).

    .venv/bin/python benchmarks/vllm/urgent_table.py SEATS-ON.json SEATS-OFF.json

Each ratio is taken per round (the rounds ran minutes apart), then the median and range
over rounds; the target is the issue's: the urgent class's mean and p99 TTFT <= 1.0x.
"""

from __future__ import annotations

from feather_sched.bench.study import Figure, markdown_table, ratios, result_files
from feather_sched.results.summary import median_and_range

BASE, OURS = "priority", "feather-model"


def of_class(priority: str, figure: str) -> Figure:
    return lambda run: run["by_priority"][priority][figure]


FIGURES = [("class-0 mean TTFT", of_class("0", "mean_ttft_ms")),
           ("class-0 p99 TTFT", of_class("0", "p99_ttft_ms")),
           ("class-1 output tok/s", of_class("1", "output_throughput"))]


def main() -> None:
    rows = []
    for path, runs in result_files(__doc__):
        urgent = [run["urgent_preemptions"] for run in runs[OURS]]
        rows.append([path.stem, str(len(urgent)),
                     *(median_and_range(ratios(runs[OURS], runs[BASE], figure), "{:.2f}",
                                        "x", " - ") for _, figure in FIGURES),
                     median_and_range(urgent, "{:.0f}", "", " - ")])
    print(markdown_table(["run", "rounds", *(f"{name} ({OURS} / {BASE})"
                                             for name, _ in FIGURES), "urgent preemptions"],
                         rows))


if __name__ == "__main__":
    main()
