"""Median and spread of repeated runs in a ``feather bench --json`` file.

    .venv/bin/python benchmarks/vllm/medians.py RESULT.json [--metric output_throughput]
        [--base NAME]

``feather bench`` labels a scheduler given again ``name#2``, ``name#3``; runs of one name
form its sample, and round k (the k-th run of every name) gives each scheduler a ratio to
the base scheduler's run in that round (the first scheduler unless ``--base`` names
another), so a ratio compares runs made minutes apart (``feather_sched.bench.study``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from feather_sched.bench.study import load_rounds, ratio_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("--metric", default="output_throughput")
    parser.add_argument("--base", help="scheduler the ratios are to (default: the first)")
    args = parser.parse_args()
    try:
        print(ratio_table(load_rounds(args.result), args.metric, args.base))
    except ValueError as error:
        raise SystemExit(f"{args.result}: {error}") from None


if __name__ == "__main__":
    main()
