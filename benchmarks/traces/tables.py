"""Tables of the trace and real-text results, and the check of Feather's targets.

    .venv/bin/python benchmarks/traces/tables.py [--sim-set NAME]   # prints results.md

Reads ``sim.json`` and ``sim-overlap.json`` (``sim.py``) of one run set
(``results/NAME/``, default ``SIM_SET``) and every CPU run set's workload files,
``results/*/{mooncake,bfcl-tools,sharegpt}.json`` (``cpu.sh``, ``feather bench --json``
with the schedulers repeated: ``fcfs``, ``feather-model``, ``fcfs#2``, ...), a cell each
labelled ``WORKLOAD, SET``, and writes ``results.md`` beside this file; ``POOLS`` names
the cells whose rounds are also taken together (one line run on two machines, or twice).
Each cell's runs (seeds in the simulator, rounds on the CPU engine) give a median with
its range; Feather's and LPM's ratios to FCFS are taken per seed or round, then their
median and range. The targets are checked on the median ratios (Feather >= 0.98x
FCFS's throughput; mean TTFT, mean E2E latency and p99 TTFT at most FCFS's), and each
cell names the figures of these where LPM does better than Feather by more than 1%.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from feather_sched.bench.study import Runs, markdown_table, pooled, rounds
from feather_sched.bench.study import ratios as per_round
from feather_sched.results.summary import median_and_range

HERE = Path(__file__).parent
FCFS, FEATHER, LPM = "fcfs", "feather-model", "sglang-lpm"
METRICS = (  # (summary key, column, higher is better)
    ("output_throughput", "out tok/s", True),
    ("mean_ttft_ms", "mean TTFT ms", False),
    ("p99_ttft_ms", "p99 TTFT ms", False),
    ("mean_tpot_ms", "mean TPOT ms", False),
    ("mean_e2el_ms", "mean E2E ms", False),
    ("worst_group_mean_ttft_ms", "worst group mean TTFT ms", False),
    ("prefix_cache_hit_rate", "prefix-cache hit rate", True),
)
TARGETS = (  # (summary key, name, bound on Feather / FCFS)
    ("output_throughput", "throughput", 0.98),
    ("mean_ttft_ms", "mean TTFT", 1.0),
    ("mean_e2el_ms", "mean E2E", 1.0),
    ("p99_ttft_ms", "p99 TTFT", 1.0),
)
TIE = 1.01
"""Median ratios within 1% of each other count as a tie between Feather and LPM."""
WORKLOADS = ("mooncake", "bfcl-tools", "sharegpt")
"""The workload files of a CPU run set (``cpu.sh``)."""
SIM_SET = "epyc-d8327ca"
"""The run set whose simulator files the tables read by default."""
AMX_08 = ("amx-7765eb8", "amx-441c368")
"""The AMX Xeon's sets of all three workloads at 0.8x capacity."""
POOLS = {  # label -> the cells (WORKLOAD, SET) pooled: the same line, each machine's load
    "mooncake, 0.8x, AMX Xeon and EPYC": tuple(
        f"mooncake, {s}" for s in ("amx-7765eb8", "amx-152b619", "amx-441c368",
                                   "amx-d7b8151", "epyc-d8327ca", "epyc-a5664c5")),
    "bfcl-tools, 0.8x, AMX Xeon and EPYC": tuple(
        f"bfcl-tools, {s}" for s in (*AMX_08, "epyc-d8327ca")),
    "sharegpt, 0.8x, AMX Xeon and EPYC": tuple(
        f"sharegpt, {s}" for s in (*AMX_08, "epyc-d8327ca")),
    "sharegpt, 1.5x in an H100's KV room": ("sharegpt, amx-h100-kv-85de925",
                                            "sharegpt, amx-h100-kv-3446621"),
}
KEPT = ("completed", "duration", *(key for key, _, _ in METRICS), "median_ttft_ms",
        "p99_tpot_ms", "mean_batch_size", "preemptions", "gate_stop")
"""The summary keys the JSON files keep (per-group arrays are left out)."""

def slim(summary: dict) -> dict:
    """The keys of a summary the results keep."""
    return {key: summary.get(key) for key in KEPT}


def _fmt(value: float, key: str) -> str:
    if key == "prefix_cache_hit_rate":
        return f"{100 * value:.1f}%"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.1f}"


def _median(values: Sequence[float], key: str) -> str:
    return median_and_range(values, lambda value: _fmt(value, key))


def ratios(runs: Runs, name: str, key: str) -> list[float]:
    """Per seed or round: ``name``'s figure over FCFS's."""
    return per_round(runs[name], runs[FCFS], key)


def _ratio(values: Sequence[float]) -> str:
    return median_and_range(values, unit="x") if values else "n/a"


def cell_rows(label: str, runs: Runs) -> list[list[str]]:
    """One row per scheduler: FCFS's medians (range), the others' ratios to FCFS (range);
    the hit rate as a median everywhere."""
    rows = []
    for name, summaries in runs.items():
        cells = []
        for key, _, _ in METRICS:
            values = [s[key] for s in summaries if s.get(key) is not None]
            if not values:
                cells.append("n/a")
            elif name == FCFS or key == "prefix_cache_hit_rate":
                cells.append(_median(values, key))
            else:
                cells.append(_ratio(ratios(runs, name, key)))
        rows.append([label, name, *cells])
    return rows


def misses(runs: Runs) -> list[str]:
    """The targets Feather's median ratios miss, e.g. ``p99 TTFT 1.257x``."""
    missed = []
    for key, name, bound in TARGETS:
        median = statistics.median(ratios(runs, FEATHER, key))
        if not (median >= bound if key == "output_throughput" else median <= bound):
            missed.append(f"{name} {median:.3f}x")
    return missed


def lpm_better(runs: Runs) -> list[str]:
    """The target figures on which LPM's median ratio beats Feather's by more than 1%."""
    if LPM not in runs:
        return []
    losses = []
    for key, name, _ in TARGETS:
        feather = statistics.median(ratios(runs, FEATHER, key))
        lpm = statistics.median(ratios(runs, LPM, key))
        higher = key == "output_throughput"
        if (lpm > feather * TIE) if higher else (lpm < feather / TIE):
            losses.append(f"{name} ({feather:.2f}x vs LPM {lpm:.2f}x)")
    return losses


def verdict(runs: Runs) -> str:
    """Which targets Feather's median ratios meet, and where LPM beats it."""
    missed, losses = misses(runs), lpm_better(runs)
    text = "targets hold" if not missed else "**misses: " + ", ".join(missed) + "**"
    return text + ("; **LPM better on " + ", ".join(losses) + "**" if losses else "")


SUMMARY = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms",
           "worst_group_mean_ttft_ms")


def summary(cells: Sequence[tuple[str, Runs]]) -> str:
    """One row a cell: FCFS's throughput, Feather's median ratios, the targets missed and
    where LPM is better."""
    rows = []
    for label, runs in cells:
        fcfs = statistics.median(s["output_throughput"] for s in runs[FCFS])
        rows.append([label, _fmt(fcfs, ""), *(_ratio(ratios(runs, FEATHER, key))
                                             for key in SUMMARY),
                     ", ".join(misses(runs)) or "none", ", ".join(lpm_better(runs)) or "-"])
    return markdown_table(["cell", "FCFS tok/s", "Feather tok/s", "mean TTFT", "p99 TTFT",
                           "mean E2E", "worst group", "targets missed", "LPM better on"],
                          rows) + "\n"


def table(cells: Sequence[tuple[str, Runs]]) -> str:
    """A markdown table of cells (label, runs), then each cell's verdict."""
    rows = [row for label, runs in cells for row in cell_rows(label, runs)]
    verdicts = [f"- {label}: {verdict(runs)}" for label, runs in cells]
    return "\n".join([markdown_table(["cell", "scheduler", *(c for _, c, _ in METRICS)], rows),
                      "", *verdicts]) + "\n"


def sim_cells(path: Path) -> dict[str, list[tuple[str, Runs]]]:
    """``sim.json``'s cells by workload and hardware."""
    document = json.loads(path.read_text())
    tables: dict[str, list[tuple[str, Runs]]] = {}
    for cell in document["cells"]:
        title = f"{cell['workload']}, {cell['hardware']}"
        label = f"{cell['load']} ({cell['arrivals']})"
        tables.setdefault(title, []).append((label, cell["runs"]))
    return tables


def cpu_paths(results: Path) -> list[Path]:
    """Every run set's workload files, by workload, then set."""
    return sorted((path for workload in WORKLOADS for path in results.glob(f"*/{workload}.json")),
                  key=lambda path: (WORKLOADS.index(path.stem), path.parent.name))


def cpu_cells(paths: Sequence[Path]) -> list[tuple[str, Runs]]:
    """One cell per ``feather bench --json`` file, labelled ``WORKLOAD, SET`` (its name and
    its run set's)."""
    cells = []
    for path in paths:
        document = json.loads(path.read_text())
        runs = {name: [slim(s) for s in summaries]
                for name, summaries in rounds(document["runs"]).items()}
        cells.append((f"{path.stem}, {path.parent.name}", runs))
    return cells


def pool(cells: Sequence[tuple[str, Runs]], names: Sequence[str]) -> Runs:
    """The rounds of the sets ``names`` as one cell (round by round pairs kept)."""
    by_name = dict(cells)
    return pooled(by_name[name] for name in names)


def sim_summary(tables: dict[str, list[tuple[str, Runs]]], heading: str) -> list[str]:
    """A heading and the summary of every cell of a simulator file's tables."""
    everything = [(f"{title}, {label}", runs) for title, cells in tables.items()
                  for label, runs in cells]
    return [f"### {heading}: Feather against FCFS (median ratios, range over seeds)", "",
            summary(everything)]


def main() -> None:
    arguments = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arguments.add_argument("--sim-set", default=SIM_SET, help="the run set of sim.json")
    sim_set = HERE / "results" / arguments.parse_args().sim_set
    parts = []
    if (sim_set / "sim.json").exists():
        tables = sim_cells(sim_set / "sim.json")
        parts += sim_summary(tables, "Simulator")
        for title, cells in tables.items():
            parts += [f"### Simulator: {title}", "", table(cells)]
    if (sim_set / "sim-overlap.json").exists():
        parts += sim_summary(sim_cells(sim_set / "sim-overlap.json"),
                             "Simulator, the scheduler's time overlapping each step "
                             "(vLLM's async scheduling)")
    cpu = cpu_paths(HERE / "results")
    if cpu:
        cells = cpu_cells(cpu)
        parts += ["### Real CPU engine (vLLM 0.32.0, the embedded model): Feather against "
                  "FCFS (median ratios, range over rounds)", "", summary(cells),
                  "### Real CPU engine, sets pooled (median ratios, range over their "
                  "rounds)", "", summary([(label, pool(cells, names))
                                          for label, names in POOLS.items()]),
                  "### Real CPU engine, every figure", "", table(cells)]
    text = "\n".join(parts)
    (HERE / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
