"""Medians over rounds of ``kv_events.sh``'s runs: per router, prefix-cache hits, TTFT
mean and p90, output throughput, and the precise index's per-round ratios to each other
router; writes kv_events.md into the run set's folder and prints it.

    .venv/bin/python benchmarks/replicas/kv_events.py [SET]   # default 90a7779/one-ingress

A set's runs are ``<router>-round<k>.json`` (``feather bench --json`` against the endpoint),
in ``results/SET/``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from feather_sched.bench.study import Runs, markdown_table, ratio
from feather_sched.results.summary import median_and_range

HERE = Path(__file__).parent
RECORDED = "90a7779/one-ingress"
"""A recorded run set (``90a7779/two-ingresses``: the other)."""
PRECISE = "feather-precise"
KEYS = (("prefix_cache_hit_rate", "prefix-cache hits", "{:.3f}"),
        ("mean_ttft_ms", "mean TTFT ms", "{:,.0f}"), ("p90_ttft_ms", "p90 TTFT ms", "{:,.0f}"),
        ("output_throughput", "out tok/s", "{:.1f}"))


def runs(folder: Path) -> Runs:
    """Per router label (in name order), each round's summary, in round order."""
    found: dict[str, dict[int, dict]] = {}
    for path in folder.glob("*-round*.json"):
        match = re.fullmatch(r"(.+)-round(\d+)\.json", path.name)
        if match is None:
            continue
        summary = next(iter(json.loads(path.read_text())["runs"].values()))
        found.setdefault(match[1], {})[int(match[2])] = summary
    return {label: [found[label][r] for r in sorted(found[label])] for label in sorted(found)}


def markdown(found: Runs) -> str:
    header = ["router", *(title for _, title, _ in KEYS)]
    lines = [f"Median over {max(len(r) for r in found.values())} rounds (range).", "",
             markdown_table(header, ([label, *(median_and_range([s[key] for s in summaries], fmt)
                                               for key, _, fmt in KEYS)]
                                     for label, summaries in found.items()))]
    precise = found.get(PRECISE)
    if precise:
        lines += ["", f"{PRECISE} / each other router, per round (median, range):", "",
                  markdown_table(header, ([label, *(ratio(precise, summaries, key, "{:.2f}x",
                                                          unit="", strict=False)
                                                    for key, _, _ in KEYS)]
                                          for label, summaries in found.items()
                                          if label != PRECISE))]
    return "\n".join(lines) + "\n"


def render(folder: Path) -> str:
    """kv_events.md's text for the run set in ``folder``."""
    return markdown(runs(folder))


def main() -> None:
    folder = HERE / "results" / (sys.argv[1] if len(sys.argv) > 1 else RECORDED)
    text = render(folder)
    (folder / "kv_events.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
