"""Median and spread of repeated runs in a ``feather bench --json`` file.

    .venv/bin/python benchmarks/vllm/medians.py RESULT.json [--metric output_throughput]
        [--base NAME]

``feather bench`` labels a scheduler given again ``name#2``, ``name#3``; runs of one name
form its sample, and round k (the k-th run of every name) gives each scheduler a ratio to
the base scheduler's run in that round (the first scheduler unless ``--base`` names
another), so a ratio compares runs made minutes apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def rounds(runs: dict[str, dict]) -> dict[str, list[dict]]:
    """Scheduler name -> its runs in order."""
    by_name: dict[str, list[dict]] = {}
    for label, summary in runs.items():
        by_name.setdefault(label.split("#")[0], []).append(summary)
    return by_name


def table(path: Path, metric: str, base_name: str | None = None) -> str:
    by_name = rounds(json.loads(path.read_text())["runs"])
    base_name = base_name or next(iter(by_name))
    if base_name not in by_name:
        raise SystemExit(f"no scheduler {base_name!r} in {path}: {', '.join(by_name)}")
    lines = [f"| scheduler | runs | median {metric} | min - max | median ratio to {base_name} "
             "(per round) | ratio min - max |", "|---|---|---|---|---|---|"]
    for name, runs in by_name.items():
        values = [run[metric] for run in runs]
        ratios = [run[metric] / base[metric]
                  for run, base in zip(runs, by_name[base_name], strict=False)]
        lines.append(f"| {name} | {len(values)} | {statistics.median(values):.1f} | "
                     f"{min(values):.1f} - {max(values):.1f} | "
                     f"{statistics.median(ratios):.3f}x | {min(ratios):.3f} - {max(ratios):.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("--metric", default="output_throughput")
    parser.add_argument("--base", help="scheduler the ratios are to (default: the first)")
    args = parser.parse_args()
    print(table(args.result, args.metric, args.base))


if __name__ == "__main__":
    main()
