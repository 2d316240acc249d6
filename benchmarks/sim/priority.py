"""Two priority classes in the simulator: what Feather keeps of vLLM's priority policy and
of its own grouping gain.

    .venv/bin/python benchmarks/sim/priority.py [--set NAME]       # ~2 min

Llama-3-8B on the H100 SXM profile, vLLM's limits. 10% of the requests (a seeded random
choice, so both classes hold members of every prefix group) are in priority class 0,
the rest in class 1. On each workload and seed, four runs:

* ``priority``: vLLM's own scheduler under its priority policy (waiting by (priority,
  arrival), the victim of preemption the latest arrival of the least urgent class);
* ``feather-model``: Feather under the same policy (strict classes, Feather's order,
  gate and fairness bound inside the most urgent class waiting);
* ``fcfs (1 class)`` and ``feather-model (1 class)``: the same workload with its
  priorities stripped (one class), for the grouping gain without classes.

Cells: 32 groups x 25 requests of 4K-token prefixes at 70 and 100 req/s (over FCFS's
capacity of about 58 req/s, where grouping pays); and, under KV pressure, 400 + 3 x 20
requests of 4K-token prefixes at 100 req/s in KV pools of 2,500 and 1,500 blocks (they
preempt). Medians over ``SEEDS`` with their range.  Writes priority.json (every run's
figures) and priority.md into results/NAME/ (default: the commit).
"""

from __future__ import annotations

from collections.abc import Callable

from peers import FCFS, SATURATED_BEST, peer_table

from feather_sched.bench.study import (
    MODEL,
    Study,
    by_scheduler,
    markdown_table,
    parser,
    sim_plan,
    summaries,
)
from feather_sched.results.summary import median_and_range as spread
from feather_sched.workloads.spec import ArrivalSpec, Workload, prioritized
from feather_sched.workloads.synthetic import minority_groups, shared_prefix_groups

SEEDS = range(5)
HIGH_SHARE = 0.1
RUNS = (  # (label, scheduler, with priority classes)
    ("priority", "priority", True),
    ("feather-model", "feather-model", True),
    ("fcfs (1 class)", "fcfs", False),
    ("feather-model (1 class)", "feather-model", False),
)
PEERS = SATURATED_BEST
"""Each peer's knob at its best setting on peers.py's saturated shared-prefix grid (results
e1b38ec; every cell here is over FCFS's capacity too).  None of them has priority
classes: each runs the two-class workload first come first served (classes stripped)."""
PEER_RUNS = tuple((name, name, True) for name in PEERS.values())
FIGURES = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "preemptions",
           "max_preemptions_per_request", "by_priority", "ttft_by_group",
           "preemptions_by_group", "mean_tpot_ms", "cold_p99_ttft_ms")


def groups_at(rate: float) -> Callable[[int], Workload]:
    return lambda seed: shared_prefix_groups(
        groups=32, prompts_per_group=25, prefix_len=4096, suffix_len=32, output_len=50,
        arrival=ArrivalSpec("poisson", rate), seed=seed)


def minorities(seed: int) -> Workload:
    return minority_groups(majority=400, minorities=[20, 20, 20], prefix_len=4096,
                           suffix_len=32, output_len=200,
                           arrival=ArrivalSpec("poisson", 100), seed=seed)


CELLS = (  # (label, workload of a seed, KV blocks: None for the device's pool)
    ("32 x 25, 4K prefixes, 70 req/s", groups_at(70), None),
    ("32 x 25, 4K prefixes, 100 req/s", groups_at(100), None),
    ("400 + 3 x 20, 4K prefixes, 100 req/s, 2,500 blocks", minorities, 2500),
    ("400 + 3 x 20, 4K prefixes, 100 req/s, 1,500 blocks", minorities, 1500),
)


def measure(workload: Workload, blocks: int | None, scheduler: str) -> dict:
    plan = sim_plan(workload, "h100-sxm", **({} if blocks is None else {"num_blocks": blocks}))
    summary = summaries(plan, [scheduler])[scheduler]
    return {key: summary[key] for key in FIGURES}


def cell_runs(make: Callable[[int], Workload], blocks: int | None) -> list[dict]:
    """Per seed: each run's figures."""
    rows = []
    for seed in SEEDS:
        workload = make(seed)
        classes = {True: prioritized(workload, HIGH_SHARE, seed=seed),
                   False: prioritized(workload, 0.0)}
        rows.append({label: measure(classes[mixed], blocks, scheduler)
                     for label, scheduler, mixed in (*RUNS, *PEER_RUNS)})
    return rows


def ratios(runs: dict) -> dict[str, float]:
    """One seed's ratios: Feather over the priority policy for the urgent class's TTFT
    and the rest's throughput; each throughput gain, and the share of it Feather keeps
    under classes."""
    feather, priority = runs["feather-model"], runs["priority"]
    alone, fcfs = runs["feather-model (1 class)"], runs["fcfs (1 class)"]
    urgent, rest = feather["by_priority"], priority["by_priority"]
    with_classes = feather["output_throughput"] / priority["output_throughput"]
    one_class = alone["output_throughput"] / fcfs["output_throughput"]
    return {
        "urgent mean TTFT": urgent["0"]["mean_ttft_ms"] / rest["0"]["mean_ttft_ms"],
        "urgent p99 TTFT": urgent["0"]["p99_ttft_ms"] / rest["0"]["p99_ttft_ms"],
        "rest throughput": urgent["1"]["output_throughput"] / rest["1"]["output_throughput"],
        "gain with classes": with_classes,
        "gain in one class": one_class,
        "gain kept": (with_classes - 1) / (one_class - 1),
    }


def main() -> None:
    study = Study(__file__, set_name=parser(__doc__).parse_args().set)
    cells = []
    for label, make, blocks in study.each(CELLS, lambda cell: cell[0]):
        seeds = cell_runs(make, blocks)
        cells.append({"cell": label, "kv_blocks": blocks, "seeds": list(SEEDS),
                      "runs": seeds, "ratios": [ratios(runs) for runs in seeds]})
    study.save("priority", {"hardware": "h100-sxm", "model": MODEL,
                            "high_priority_share": HIGH_SHARE, "cells": cells},
               markdown(cells))


def markdown(cells: list[dict]) -> str:
    n = len(SEEDS)
    lines = [
        "# Two priority classes: Feather under vLLM's priority policy (simulator)",
        "",
        "`benchmarks/sim/priority.py`: Llama-3-8B on the H100 SXM profile, 10% of requests "
        "in class 0, the rest in class 1; medians over "
        f"{n} seeds (range). Ratios are Feather over vLLM's priority policy on the same "
        "workload; *gain* is output tok/s over the baseline's (with classes: "
        "`feather-model` / `priority`; one class: `feather-model` / `fcfs` on the workload "
        "with priorities stripped); *kept* is (gain with classes - 1) / (gain in one "
        "class - 1). Targets: urgent TTFT <= 1.1x, rest throughput >= 1.0x, kept >= 90%, "
        "every group's TTFT <= 1.25x.",
        "",
    ]
    rows = []
    for cell in cells:
        r = {key: [seed[key] for seed in cell["ratios"]] for key in cell["ratios"][0]}
        kept = spread([100 * k for k in r["gain kept"]], "{:.0f}%") \
            if min(r["gain in one class"]) > 1.05 else "(no gain to keep)"
        rows.append([cell["cell"], *(f"{spread(r[key])}x" for key in (
            "urgent mean TTFT", "urgent p99 TTFT", "rest throughput", "gain with classes",
            "gain in one class")), kept])
    lines += [markdown_table(["cell", "urgent mean TTFT", "urgent p99 TTFT", "rest tok/s",
                              "gain with classes", "gain in one class", "kept"], rows),
              "", "Per run (medians): output tok/s; class 0 and class 1 mean / p99 TTFT (s); "
              "preemptions in all / most of one request.", ""]
    rows = []
    for cell in cells:
        for label, _, mixed in (*RUNS, *PEER_RUNS):
            runs = [seed[label] for seed in cell["runs"]]
            rows.append([cell["cell"], label,
                         spread([r["output_throughput"] for r in runs], "{:,.0f}"),
                         class_ttft(runs, "0") if mixed else "-",
                         class_ttft(runs, "1") if mixed else "-",
                         f"{spread([r['preemptions'] for r in runs], '{:.0f}')} / "
                         f"{spread([r['max_preemptions_per_request'] for r in runs], '{:.0f}')}"])
    lines += [markdown_table(["cell", "run", "tok/s", "class 0 TTFT s", "class 1 TTFT s",
                              "preemptions"], rows),
              "", "Under KV pressure, per prefix group (group 0 the majority, 1-3 the "
              "minorities): TTFT ratio mean / p99, Feather over FCFS on one class and over "
              "vLLM's priority policy with classes; preemptions of the group (all runs of "
              "the cell, medians).", ""]
    rows = []
    for cell in cells:
        if cell["kv_blocks"] is None:
            continue
        first = cell["runs"][0]["fcfs (1 class)"]["ttft_by_group"]
        for group, g in first.items():
            rows.append([cell["cell"], group, str(g["requests"]),
                         group_ratio(cell, group, "feather-model (1 class)", "fcfs (1 class)"),
                         group_ratio(cell, group, "feather-model", "priority"),
                         f"{group_preemptions(cell, group, 'fcfs (1 class)')} / "
                         f"{group_preemptions(cell, group, 'feather-model (1 class)')}",
                         f"{group_preemptions(cell, group, 'priority')} / "
                         f"{group_preemptions(cell, group, 'feather-model')}"])
    lines.append(markdown_table(
        ["cell", "group", "requests", "feather / fcfs, 1 class", "feather / priority, classes",
         "preemptions fcfs / feather, 1 class", "preemptions priority / feather, classes"],
        rows))
    lines += ["", PEERS_NOTE, "", peer_table(peer_cells(cells))]
    return "\n".join(lines)


PEERS_NOTE = (
    "Peers' knobs, at `PEERS`'s settings (the best on peers.py's saturated grid, e1b38ec, "
    "not re-tuned here), on the two-class workload, which none of them can tell apart (the "
    "per-run table above gives each class's TTFT under them): throughput, mean and p99 "
    "TTFT, TPOT and the cold requests' p99 TTFT over FCFS's (one class) on the same seed, "
    "and `feather-model`'s (with classes) over the peer's; the last row of a cell is "
    "`feather-model` over FCFS and over the peer with the best median throughput.")


def peer_cells(cells: list[dict]) -> list[dict]:
    """The cells as ``peers.peer_table`` reads them (FCFS: ``fcfs (1 class)``), each by
    output throughput."""
    return [{"name": cell["cell"], "objective": "output_throughput", "best": PEERS,
             "runs": by_scheduler({FCFS if label == "fcfs (1 class)" else label: run
                                   for label, run in seed.items()} for seed in cell["runs"])}
            for cell in cells]


def class_ttft(runs: list[dict], priority: str) -> str:
    mean = [r["by_priority"][priority]["mean_ttft_ms"] / 1e3 for r in runs]
    p99 = [r["by_priority"][priority]["p99_ttft_ms"] / 1e3 for r in runs]
    return f"{spread(mean)} / {spread(p99)}"


def group_ratio(cell: dict, group: str, ours: str, base: str) -> str:
    values = {key: [seed[ours]["ttft_by_group"][group][key]
                    / seed[base]["ttft_by_group"][group][key] for seed in cell["runs"]]
              for key in ("mean_ttft_ms", "p99_ttft_ms")}
    return f"{spread(values['mean_ttft_ms'])}x / {spread(values['p99_ttft_ms'])}x"


def group_preemptions(cell: dict, group: str, label: str) -> str:
    return spread([seed[label]["preemptions_by_group"][group]["preemptions"]
                   for seed in cell["runs"]], "{:.0f}")


if __name__ == "__main__":
    main()
