"""The tables of the SGLang runs in a run set's folder: ``run.sh``'s policies side by side,
or ``ordering.sh``'s running batch ordered by prefix group and not.

    .venv/bin/python benchmarks/sglang/tables.py policies benchmarks/sglang/results/SET
    .venv/bin/python benchmarks/sglang/tables.py ordering benchmarks/sglang/results/SET
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from feather_sched.bench.study import markdown_table

POLICIES = ("fcfs", "lpm", "dfs-weight", "hrrn", "shortest-prefill-first", "routing-key",
            "feather")
"""``run.sh``'s servers: ``<policy>.json``, the run labelled ``sglang-<policy>`` (those a
set has: older sets ran four)."""
ORDERING = ("ordered-1", "unordered-1", "ordered-2", "unordered-2")
"""``ordering.sh``'s runs: ``ordering-<run>.json`` and Feather's ``ordering-<run>.stats.json``."""


def run(path: Path, label: str) -> dict:
    return json.loads(path.read_text())["runs"][label]


def policies(folder: Path) -> str:
    """Per policy: output tok/s, its ratio to FCFS's, mean TTFT and TPOT."""
    runs = {p: run(folder / f"{p}.json", f"sglang-{p}") for p in POLICIES
            if (folder / f"{p}.json").is_file()}
    base = runs["fcfs"]["output_throughput"]
    return markdown_table(
        ["policy", "output tok/s", "vs fcfs", "mean TTFT ms", "mean TPOT ms"],
        ([name, f"{s['output_throughput']:.1f}", f"{s['output_throughput'] / base:.2f}x",
          f"{s['mean_ttft_ms']:.0f}", f"{s['mean_tpot_ms']:.1f}"] for name, s in runs.items()))


def ordering(folder: Path) -> str:
    """Per run: output tok/s, mean TPOT, median ITL and the batches Feather reordered; then
    each setting's median mean TPOT over its runs."""
    runs = {r: run(folder / f"ordering-{r}.json", r) for r in ORDERING}
    stats = {r: json.loads((folder / f"ordering-{r}.stats.json").read_text()) for r in runs}
    lines = [markdown_table(
        ["run", "output tok/s", "mean TPOT ms", "median ITL ms", "batches reordered"],
        ([name, f"{s['output_throughput']:.1f}", f"{s['mean_tpot_ms']:.1f}",
          f"{s['median_itl_ms']:.1f}", str(stats[name]["reordered_batches"])]
         for name, s in runs.items()))]
    for kind in ("ordered", "unordered"):
        tpot = [runs[f"{kind}-{i}"]["mean_tpot_ms"] for i in (1, 2)]
        lines.append(f"{kind}: median mean TPOT {statistics.median(tpot):.1f} ms "
                     f"(runs {min(tpot):.1f}-{max(tpot):.1f})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("table", choices=("policies", "ordering"))
    parser.add_argument("folder", type=Path, help="the run set's folder")
    args = parser.parse_args()
    print({"policies": policies, "ordering": ordering}[args.table](args.folder))


if __name__ == "__main__":
    main()
