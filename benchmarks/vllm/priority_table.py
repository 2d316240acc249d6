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
import json
import statistics
from pathlib import Path

from medians import rounds


def per_round(path: Path, base: str, other: str, figure) -> list[float]:
    """``figure(other's run) / figure(base's run)`` for each round of ``path``."""
    by_name = rounds(json.loads(path.read_text())["runs"])
    return [figure(run) / figure(ref)
            for run, ref in zip(by_name[other], by_name[base], strict=True)]


def urgent(key: str):
    return lambda run: run["by_priority"]["0"][key]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}x ({min(values):.3f} - {max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("classes", type=Path)
    parser.add_argument("one_class", type=Path)
    args = parser.parse_args()
    feather = "feather-model"
    rows = [
        ("class-0 mean TTFT", per_round(args.classes, "priority", feather,
                                        urgent("mean_ttft_ms")), "<= 1.1x"),
        ("class-0 p99 TTFT", per_round(args.classes, "priority", feather,
                                       urgent("p99_ttft_ms")), "<= 1.1x"),
        ("class-1 output tok/s", per_round(
            args.classes, "priority", feather,
            lambda run: run["by_priority"]["1"]["output_throughput"]), ">= 1.0x"),
    ]
    with_classes = per_round(args.classes, "priority", feather,
                             lambda run: run["output_throughput"])
    one_class = per_round(args.one_class, "fcfs", feather,
                          lambda run: run["output_throughput"])
    rows += [("output tok/s, two classes (feather / priority)", with_classes, ""),
             ("output tok/s, one class (feather / fcfs)", one_class, "")]
    print("| figure (Feather / vLLM) | median ratio (range over rounds) | target |")
    print("|---|---|---|")
    for name, values, target in rows:
        print(f"| {name} | {spread(values)} | {target} |")
    gain, single = statistics.median(with_classes), statistics.median(one_class)
    print(f"\nGrouping gain kept: {gain:.3f} / {single:.3f} = {gain / single:.1%} of the "
          f"one-class gain; of its excess over 1: {(gain - 1) / (single - 1):.1%} "
          "(target >= 90%).")


if __name__ == "__main__":
    main()
