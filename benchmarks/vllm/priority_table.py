"""Two priority classes on the real engine: Feather under vLLM's priority policy against
vLLM's own priority scheduler, and the grouping gain it keeps of the one-class gain.

    .venv/bin/python benchmarks/vllm/priority_table.py CLASSES.json ONE_CLASS.json

``CLASSES.json``: ``feather bench --high-priority-share ... --schedulers
priority,feather-model,...`` (rounds of both); ``ONE_CLASS.json``: the same workload
without classes, ``--schedulers fcfs,feather-model,...``. Each ratio is taken per round
(runs of one round are minutes apart), then the median and range over rounds.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from feather_sched.bench.study import Figure, load_rounds, markdown_table, ratios
from feather_sched.results.summary import median_and_range

FEATHER = "feather-model"


def urgent(key: str) -> Figure:
    return lambda run: run["by_priority"]["0"][key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("classes", type=Path)
    parser.add_argument("one_class", type=Path)
    args = parser.parse_args()
    classes, one = load_rounds(args.classes), load_rounds(args.one_class)

    def over(runs, base: str, figure: Figure) -> list[float]:
        return ratios(runs[FEATHER], runs[base], figure)

    with_classes = over(classes, "priority", "output_throughput")
    one_class = over(one, "fcfs", "output_throughput")
    rows = (  # (figure, per-round ratios, target)
        ("class-0 mean TTFT", over(classes, "priority", urgent("mean_ttft_ms")), "<= 1.1x"),
        ("class-0 p99 TTFT", over(classes, "priority", urgent("p99_ttft_ms")), "<= 1.1x"),
        ("class-1 output tok/s", over(
            classes, "priority", lambda run: run["by_priority"]["1"]["output_throughput"]),
         ">= 1.0x"),
        ("output tok/s, two classes (feather / priority)", with_classes, ""),
        ("output tok/s, one class (feather / fcfs)", one_class, ""),
    )
    print(markdown_table(
        ["figure (Feather / vLLM)", "median ratio (range over rounds)", "target"],
        ([name, median_and_range(values, "{:.3f}", "x", " - "), target]
         for name, values, target in rows)))
    gain, single = statistics.median(with_classes), statistics.median(one_class)
    print(f"\nGrouping gain kept: {gain:.3f} / {single:.3f} = {gain / single:.1%} of the "
          f"one-class gain; of its excess over 1: {(gain - 1) / (single - 1):.1%} "
          "(target >= 90%).")


if __name__ == "__main__":
    main()
