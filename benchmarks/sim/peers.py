"""Feather against what users would switch on instead: each peer's own knobs, tuned.

    .venv/bin/python benchmarks/sim/peers.py [--seeds 3] [--set NAME] [--cells a,b]

Llama-3-8B on the H100 SXM profile, vLLM's GPU limits. The peers, each knob swept over
its useful range on each workload (every setting's runs are in the JSON):

* ``vllm-cache-aware`` (vLLM 0.34): window 16, 64 or 256 x threshold 0 or 0.5;
* ``vllm-active-cap`` (vLLM's ``max_num_active_seqs``): 32, 64, 128 or 192 of 256 seats;
* SGLang 0.5.23's ``lpm``, ``dfs-weight``, ``hrrn`` and ``routing-key`` (no knob).

Cells: the shared-prefix grid (8 or 32 groups of 4K-token prefixes, 480 requests, with
120 cold requests that share nothing mixed in, Poisson at 1.5x FCFS's offline rate:
saturated); Mooncake's synthetic trace (400 requests of seed k's third, stretched to
0.8x FCFS's capacity: loaded, not swamped); ShareGPT (500 requests, no sharing, 0.8x);
BFCL tool calls (600 requests, 0.8x) and Mooncake's conversation trace (400 requests
of seed k's window, 0.8x), run by ``--cells bfcl,conversation``.
A knob's best setting is the one with the best median over seeds of the cell's
objective: output tokens/s where saturated, mean TTFT where loaded. Figures: output
tokens/s, mean and p99 TTFT, mean TPOT and the p99 TTFT of the cold requests, as
ratios to FCFS, and Feather's to each peer's best setting (per seed, median and range).
Writes peers.json and peers.md into results/NAME/ (default: the commit); ``--tables
JSON`` rewrites a recorded JSON's tables.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from feather_sched.bench.study import Study, markdown_table, offline_rate, parser, sim_plan
from feather_sched.results.summary import median_and_range, summarize
from feather_sched.sim.runner import simulate
from feather_sched.workloads.options import WorkloadArgs
from feather_sched.workloads.spec import ArrivalSpec, Workload
from feather_sched.workloads.synthetic import no_sharing, shared_prefix_groups

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake-synthetic.jsonl"
CONVERSATION = Path(__file__).resolve().parents[1] / "traces" / "mooncake-conversation.jsonl"
TRACE_WINDOW = 3993 // 3
TRACE_REQUESTS = 400
SHAREGPT_REQUESTS = 500
HARDWARE = "h100-sxm"
FEATHER, FCFS = "feather-model", "fcfs"
KNOBS = {
    "vllm-cache-aware": [f"vllm-cache-aware-w{w}-t{t}" for w in (16, 64, 256) for t in (0, 0.5)],
    "vllm-active-cap": [f"vllm-active-cap-{cap}" for cap in (32, 64, 128, 192)],
    "sglang-lpm": ["sglang-lpm"],
    "sglang-dfs-weight": ["sglang-dfs-weight"],
    "sglang-hrrn": ["sglang-hrrn"],
    "sglang-routing-key": ["sglang-routing-key"],
}
"""Each peer and its settings swept."""
SATURATED_BEST = {
    "vllm-cache-aware": "vllm-cache-aware-w16-t0",
    "vllm-active-cap": "vllm-active-cap-192",
    "sglang-lpm": "sglang-lpm",
    "sglang-dfs-weight": "sglang-dfs-weight",
    "sglang-hrrn": "sglang-hrrn",
    "sglang-routing-key": "sglang-routing-key",
}
"""Each peer's best setting on both saturated grid cells (results e1b38ec): the one
tenants.py and priority.py run, over FCFS's capacity too, without re-tuning."""
SCHEDULERS = [FCFS, FEATHER, *(name for names in KNOBS.values() for name in names)]
KEPT = ("completed", "output_throughput", "request_throughput", "mean_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "cold_p99_ttft_ms", "worst_group_p99_ttft_ms",
        "prefix_cache_hit_rate", "preemptions")
FIGURES = (("output_throughput", "tok/s"), ("mean_ttft_ms", "mean TTFT"),
           ("p99_ttft_ms", "p99 TTFT"), ("mean_tpot_ms", "TPOT"),
           ("cold_p99_ttft_ms", "cold p99 TTFT"))


def grid(groups: int, seed: int, rate: float | None, *, shared: int = 480, cold: int = 120,
         prefix: int = 4096, output: int = 50) -> Workload:
    """``groups`` groups of ``prefix``-token prefixes (``shared`` requests, 32-token
    suffixes) and ``cold`` requests of as many tokens that share nothing, Poisson at
    ``rate`` in all (None: all at once)."""
    def arrival(share: float) -> ArrivalSpec | None:
        return None if rate is None else ArrivalSpec(kind="poisson", rate=rate * share)

    total = shared + cold
    grouped = shared_prefix_groups(groups=groups, prompts_per_group=shared // groups,
                                   prefix_len=prefix, suffix_len=32, output_len=output,
                                   arrival=arrival(shared / total), seed=seed)
    alone = no_sharing(requests=cold, prompt_len=prefix + 32, output_len=output,
                       arrival=arrival(cold / total), seed=1000 + seed)
    return Workload(f"grid-{groups}", grouped.requests + alone.requests)


def trace(seed: int, rate: float | None, path: Path = TRACE) -> Workload:
    """``TRACE_REQUESTS`` of the trace from seed k's window, at ``rate`` on average."""
    args = WorkloadArgs(trace=path, start=seed * TRACE_WINDOW, max_requests=TRACE_REQUESTS,
                        seed=seed)
    if rate is not None:
        at_speed_one = args.build()
        args.trace_speed = rate / (len(at_speed_one) / at_speed_one.requests[-1].arrival_s)
    else:
        args.trace_speed = 1e9
    return args.build()


def dataset(name: str, requests: int) -> Callable[[int, float | None], Workload]:
    """``requests`` of a dataset's prompts (seeded order), Poisson at the rate."""
    return lambda seed, rate: WorkloadArgs(dataset_name=name, max_requests=requests,
                                           request_rate=rate, seed=seed).build()


CELLS: dict[str, tuple[Callable[[int, float | None], Workload], float, str]] = {
    "grid-8": (lambda seed, rate: grid(8, seed, rate), 1.5, "output_throughput"),
    "grid-32": (lambda seed, rate: grid(32, seed, rate), 1.5, "output_throughput"),
    "mooncake": (trace, 0.8, "mean_ttft_ms"),
    "sharegpt": (dataset("sharegpt", SHAREGPT_REQUESTS), 0.8, "mean_ttft_ms"),
    "bfcl": (dataset("bfcl-tools", 600), 0.8, "mean_ttft_ms"),
    "conversation": (lambda seed, rate: trace(seed, rate, CONVERSATION), 0.8, "mean_ttft_ms"),
}
"""Each cell: its workload of (seed, rate), its load as a multiple of FCFS's offline
rate, and the objective a knob's best setting is chosen by."""


def run_cell(make: Callable[[int, float | None], Workload], load: float,
             seeds: int) -> tuple[float, dict[str, list[dict]]]:
    """Every scheduler on every seed at ``load`` x FCFS's offline rate (seed 0's)."""
    rate = load * offline_rate(sim_plan(make(0, None), HARDWARE))
    runs: dict[str, list[dict]] = {name: [] for name in SCHEDULERS}
    for seed in range(seeds):
        plan = sim_plan(make(seed, rate), HARDWARE)
        for name in SCHEDULERS:
            summary = summarize(simulate(plan, name))
            runs[name].append({key: summary.get(key) for key in KEPT})
    return rate, runs


def better(objective: str) -> Callable[[float, float], bool]:
    if objective == "output_throughput":
        return lambda a, b: a > b
    return lambda a, b: a < b


def best_setting(runs: dict[str, list[dict]], names: list[str], objective: str) -> str:
    """The setting of ``names`` with the best median ``objective`` over seeds."""
    medians = {name: statistics.median(r[objective] for r in runs[name]) for name in names}
    wins = better(objective)
    best = names[0]
    for name in names[1:]:
        if wins(medians[name], medians[best]):
            best = name
    return best


def ratio_text(runs: dict[str, list[dict]], name: str, base: str, key: str) -> str:
    pairs = [(a.get(key), b.get(key)) for a, b in zip(runs[name], runs[base], strict=True)]
    values = [a / b for a, b in pairs if a is not None and b]
    return median_and_range(values, unit="x") if values else "-"


def cell_rows(cell: dict, feather: str = FEATHER) -> list[list[str]]:
    """One row per peer (its best setting): each figure over FCFS's, and ``feather``'s
    over the peer's; then ``feather``'s over FCFS's, and over the best peer's (by the
    objective).  ``cell``: its name, objective, runs (per name, per seed) and best (per
    peer, its setting's name in runs)."""
    runs, best = cell["runs"], cell["best"]
    top = best_setting(runs, list(best.values()), cell["objective"])
    rows = []
    for label, name in (*best.items(), (feather, feather)):
        base = top if name == feather else name
        rows.append([cell["name"], label, base if name == feather else name,
                     *(ratio_text(runs, name, FCFS, key) for key, _ in FIGURES),
                     *(ratio_text(runs, feather, base, key) for key, _ in FIGURES)])
    return rows


def peer_table(cells: list[dict], feather: str = FEATHER, name: str = "Feather") -> str:
    """``cell_rows`` of every cell under one header, ``feather`` called ``name`` there."""
    header = ["cell", "peer", f"best setting ({name}: the best peer's)",
              *(f"{label} / FCFS" for _, label in FIGURES),
              *(f"{name} / it: {label}" for _, label in FIGURES)]
    return markdown_table(header, [row for cell in cells for row in cell_rows(cell, feather)])


def markdown(cells: list[dict]) -> str:
    sweep = [[cell["name"], name,
              median_and_range([r["output_throughput"] for r in cell["runs"][name]], "{:,.0f}"),
              median_and_range([r["mean_ttft_ms"] for r in cell["runs"][name]], "{:,.1f}")]
             for cell in cells for name in SCHEDULERS]
    return (peer_table(cells) + "\n\nThe sweep (medians over seeds, range):\n\n"
            + markdown_table(["cell", "setting", "output tok/s", "mean TTFT ms"], sweep))


def tables(path: str) -> None:
    """Rewrite the tables of a recorded ``peers.json`` into the ``peers.md`` beside it."""
    cells = json.loads(Path(path).read_text())["cells"]
    Path(path).with_suffix(".md").write_text(markdown(cells) + "\n")


def main() -> None:
    arguments = parser(__doc__, seeds=3)
    arguments.add_argument("--cells", default="grid-8,grid-32,mooncake,sharegpt",
                           help=f"cells to run, of {', '.join(CELLS)}")
    arguments.add_argument("--tables", metavar="JSON", help="only rewrite JSON's tables")
    args = arguments.parse_args()
    if args.tables:
        return tables(args.tables)
    study = Study(__file__, set_name=args.set)
    cells = []
    for name in args.cells.split(","):
        make, load, objective = CELLS[name]
        rate, runs = run_cell(make, load, args.seeds)
        best = {peer: best_setting(runs, names, objective) for peer, names in KNOBS.items()}
        cells.append({"name": name, "hardware": HARDWARE, "rate_req_s": rate, "load": load,
                      "objective": objective, "best": best, "runs": runs})
        study.progress(f"{name}: {rate:.2f} req/s")
        study.write_json("peers", {"cells": cells})
    study.save("peers", {"cells": cells}, markdown(cells))


if __name__ == "__main__":
    sys.exit(main())
