"""Which waiting request Feather should admit while the engine could run everything in flight.

    .venv/bin/python benchmarks/sim/fits_all_order.py [--seeds 3] [--set NAME]

Issue 63: while everything fits (``FeatherQueue.fits_all``) Feather admits the oldest
waiting request by default (docs/results.md: the tree's best order cost BFCL's p99
there), while SGLang's ``hrrn`` beats its mean TTFT on Mooncake.  The order only matters
within a step's prefill budget then; three rules for that case, the rest of Feather
unchanged:

* ``arrival``: the default, the oldest first;
* ``shortest``: the option ``shortest_when_all_fits``, the fewest uncached prompt tokens
  first (its tokens less the chunks it shares with the running set), ties by arrival;
* ``hrrn``: replayed here in ``FeatherQueue._chosen`` (a scan per candidate), SGLang's
  token aging: prompt tokens admitted since it arrived over its uncached tokens.

The cells and loads of ``peers.py`` (Llama-3-8B, H100 SXM), FCFS and SGLang's ``hrrn``
beside; writes fits-all-order.json and .md into results/NAME/.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import peers

from feather_sched.bench.study import Study, markdown_table, offline_rate, parser, sim_plan
from feather_sched.core.book import QueueBook
from feather_sched.core.queue import FeatherQueue
from feather_sched.results.summary import median_and_range, summarize
from feather_sched.sim.runner import simulate

RULES = ("arrival", "shortest", "hrrn")
BASELINES = ("fcfs", "sglang-hrrn")
CELLS = ("mooncake", "bfcl", "conversation", "sharegpt")
KEPT = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms")


def uncached(queue: QueueBook, request_id: Any) -> int:
    """A waiting request's prompt tokens less its ranked shared chunks' (the tree's own
    count, ``shortest``'s key), at least 1 (a ratio's denominator)."""
    return max(queue.tree._entry(request_id).uncached(queue.tree.chunk_tokens), 1)


def hrrn_chooser() -> Callable[[FeatherQueue, Any], Any]:
    """``FeatherQueue._chosen`` with the highest response ratio while everything fits."""
    chosen = FeatherQueue._chosen

    def key(queue: FeatherQueue, request_id: Any) -> tuple[float, float]:
        tokens = uncached(queue, request_id)
        waited = queue.admitted_tokens - queue.arrived_at[request_id]
        return -waited / tokens, tokens

    def pick(queue: FeatherQueue, due: Any) -> Any:
        candidate = chosen(queue, due)
        if due is not None or queue._promised is not None or queue.share is not None or \
                queue.bound is None or not queue.fits_all():
            return candidate
        priority = queue.tree.priority(candidate)
        same = [r for r in queue.waiting_ids() if queue.tree.priority(r) == priority]
        return min(same, key=lambda r: key(queue, r))

    return pick


@contextmanager
def rule_in_place(rule: str):
    """Feather's queue with ``hrrn`` while everything fits (other rules: as it is)."""
    saved = FeatherQueue._chosen, QueueBook.add, QueueBook.admit
    if rule == "hrrn":
        add, admit = QueueBook.add, QueueBook.admit

        def counted_add(queue: QueueBook, request_id: Any, *args: Any, **kwargs: Any) -> None:
            add(queue, request_id, *args, **kwargs)
            vars(queue).setdefault("arrived_at", {})[request_id] = \
                vars(queue).setdefault("admitted_tokens", 0)

        def counted_admit(queue: QueueBook, request_id: Any) -> None:
            queue.admitted_tokens = vars(queue).get("admitted_tokens", 0) + \
                uncached(queue, request_id)
            admit(queue, request_id)

        FeatherQueue._chosen = hrrn_chooser()  # type: ignore[method-assign]
        QueueBook.add, QueueBook.admit = counted_add, counted_admit  # type: ignore[method-assign]
    try:
        yield
    finally:
        FeatherQueue._chosen, QueueBook.add, QueueBook.admit = saved  # type: ignore[method-assign]


def run_cell(name: str, seeds: int) -> dict[str, list[dict]]:
    """Every rule and baseline on each seed of ``peers.CELLS[name]`` at its load."""
    make, load, _ = peers.CELLS[name]
    rate = load * offline_rate(sim_plan(make(0, None), peers.HARDWARE))
    runs: dict[str, list[dict]] = {}
    for seed in range(seeds):
        plan = sim_plan(make(seed, rate), peers.HARDWARE)
        for scheduler in BASELINES:
            summary = summarize(simulate(plan, scheduler))
            runs.setdefault(scheduler, []).append({k: summary[k] for k in KEPT})
        for rule in RULES:
            options = {"shortest_when_all_fits": rule == "shortest"}
            with rule_in_place(rule):
                summary = summarize(simulate(sim_plan(make(seed, rate), peers.HARDWARE,
                                                      feather_options=options),
                                             peers.FEATHER))
            runs.setdefault(rule, []).append({k: summary[k] for k in KEPT})
    return runs


def markdown(cells: dict[str, dict[str, list[dict]]]) -> str:
    """Per cell and rule: mean and p99 TTFT over ``arrival``'s, seed by seed (median,
    range), and throughput; the baselines beside."""
    rows = []
    for cell, runs in cells.items():
        for name, records in runs.items():
            ratio = [[r[k] / a[k] for r, a in zip(records, runs["arrival"], strict=True)]
                     for k in ("mean_ttft_ms", "p99_ttft_ms")]
            rows.append([cell, name,
                         median_and_range([r["mean_ttft_ms"] for r in records], "{:,.0f}"),
                         median_and_range(ratio[0], unit="x"),
                         median_and_range([r["p99_ttft_ms"] for r in records], "{:,.0f}"),
                         median_and_range(ratio[1], unit="x"),
                         median_and_range([r["output_throughput"] for r in records],
                                          "{:,.0f}")])
    return markdown_table(["cell", "order", "mean TTFT ms", "/ arrival", "p99 TTFT ms",
                           "/ arrival", "output tok/s"], rows)


def main() -> None:
    args = parser(__doc__, seeds=3).parse_args()
    study = Study(__file__, set_name=args.set)
    cells = {}
    for name in CELLS:
        cells[name] = run_cell(name, args.seeds)
        study.progress(name)
    study.save("fits-all-order", {"cells": cells}, markdown(cells))


if __name__ == "__main__":
    sys.exit(main())
