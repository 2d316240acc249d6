"""Predicted (simulator) vs measured (real engine) throughput, as a markdown table.

    python benchmarks/sim/compare.py benchmarks/sim/results/8ed5949/validate-*-real.json

Each ``NAME-real.json`` (``feather bench --json``) is read with the ``NAME-sim.json``
beside it (``feather sim --json`` on the same workload).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from feather_sched.bench.study import markdown_table


def main(real_files: list[str]) -> None:
    rows, errors = [], []
    for real_file in real_files:
        real = json.loads(Path(real_file).read_text())
        sim = json.loads(Path(real_file.replace("-real", "-sim")).read_text())
        for name, measured in real["runs"].items():
            predicted = sim["runs"][name]["output_throughput"]
            error = predicted / measured["output_throughput"] - 1
            errors.append(abs(error))
            rows.append([real["config"]["workload"], name,
                         f"{measured['output_throughput']:.1f}", f"{predicted:.1f}",
                         f"{error:+.1%}"])
    print(markdown_table(["workload", "scheduler", "measured tok/s", "predicted tok/s",
                          "error"], rows))
    print(f"\nmean absolute error {sum(errors) / len(errors):.1%}, worst {max(errors):.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
