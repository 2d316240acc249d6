"""Agent sessions over replicas, simulated: does keeping a program's turns on the replica
holding its prefix pay, against load-only routing (issue 62, "Routing")?

    PYTHONPATH=src .venv/bin/python benchmarks/sim/agents_replicas.py [--replicas 2]
        [--programs 240] [--jobs 2] [--workload agents|bfcl] [--name NAME]

``--replicas`` engines (Llama-3-8B on the H100 SXM profile, each with the H100's pool of
26,674 blocks and its own retention), ``--programs`` agent programs per replica starting
at 3.5/s per replica (the one-engine benchmark's rate, ``agents.py``), closed loop over
the replicas (``sim.program_replicas``), each turn routed with its program as its session
id, seeds 0, 1, 2.  Pairs (router + what each replica runs): Feather's router on the
engines' KV events (``FeatherRouter`` over ``PreciseIndex``: sessions stick within the
load band) + Feather with sessions; power of two and round robin (load only, the session
id ignored) + Feather with sessions; power of two + vLLM FCFS/LRU; Feather's router +
vLLM FCFS/LRU.  Per pair: mean and p90 JCT, later-turn TTFT, output tokens/s, the share
of continuing turns routed to their predecessor's replica, the share of continuing
turns' prompt tokens found cached, hit rate, busy-time imbalance; medians over the seeds
with their range.  The scheduler's Python time is not charged to the clock.  Writes
agents-replicas-N{-bfcl}.json (every run) and .md into results/NAME/ (default: the commit).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from agents import GATE, RATE, SEEDS, WORKLOADS, table

from feather_sched.results.summary import median_and_range
from feather_sched.routing.baselines import make_router
from feather_sched.routing.feather import FeatherRouter
from feather_sched.routing.router import Router
from feather_sched.sim.program_replicas import program_replicas, run_program_replicas
from feather_sched.sim.replicas import precise_index
from feather_sched.sim.runner import SimPlan
from feather_sched.workloads.spec import ArrivalSpec

HERE = Path(__file__).resolve().parent
SESSIONS = f"{GATE}+sessions"
PAIRS = {"feather+sessions": ("feather", SESSIONS),
         "power-of-two+sessions": ("power-of-two", SESSIONS),
         "round-robin+sessions": ("round-robin", SESSIONS),
         "power-of-two+fcfs": ("power-of-two", "fcfs"),
         "feather+fcfs": ("feather", "fcfs")}
"""Label: (router, what each replica runs)."""
LABELS = {"feather+sessions": "Feather router (KV events) + Feather sessions",
          "power-of-two+sessions": "power of two + Feather sessions",
          "round-robin+sessions": "round robin + Feather sessions",
          "power-of-two+fcfs": "power of two + vLLM FCFS/LRU",
          "feather+fcfs": "Feather router (KV events) + vLLM FCFS/LRU"}
FIGURES = ("mean_jct_s", "p90_jct_s", "mean_later_turn_ttft_ms", "output_throughput",
           "stayed_share", "continuing_cached_share", "prefix_cache_hit_rate",
           "replica_imbalance")


def router_for(name: str, replicas: int, plan: SimPlan, seed: int) -> Router:
    """``feather``: FeatherRouter on the engines' KV events, default band; else a
    baseline of ``routing.baselines`` by name."""
    if name == "feather":
        return FeatherRouter(range(replicas), seed=seed,
                             index=precise_index(plan.engine_config()))
    return make_router(name, range(replicas), seed=seed)


def run(pair: str, seed: int, replicas: int, programs: int, workload: str) -> dict[str, Any]:
    """One pair on one seed's programs: its figures and each replica's retention counters."""
    agents = WORKLOADS[workload](programs=programs * replicas,
                                 arrival=ArrivalSpec("poisson", RATE * replicas), seed=seed)
    plan = SimPlan.from_options(agents.open_loop(), charge_scheduler_time=False)
    router_name, scheduler = PAIRS[pair]
    result = run_program_replicas(
        agents, router_for(router_name, replicas, plan, seed),
        program_replicas(plan, agents, list(range(replicas)), scheduler), pair)
    summary = result.replicas.summary()
    figures = {f: summary.get(f) for f in FIGURES}
    figures.update(stayed_share=result.stayed_share(),
                   continuing_cached_share=result.cached_share(),
                   preemptions=sum(r.preemptions for r in result.replicas.replicas),
                   requests_per_replica=summary["requests_per_replica"])
    return {"pair": pair, "seed": seed, "replicas": replicas, "workload": workload,
            "summary": figures, "retention": {str(r): c for r, c in result.retention.items()}}


def _run(args: tuple[str, int, int, int, str]) -> dict[str, Any]:
    return run(*args)


def ratios(runs: list[dict[str, Any]]) -> str:
    """Feather router + sessions over each other pair, seed by seed (mean and p90 JCT)."""
    by = {(r["pair"], r["seed"]): r["summary"] for r in runs}
    ours = next(iter(PAIRS))
    return "\n".join(
        f"- {figure} {LABELS[ours]} / {LABELS[pair]}: " + median_and_range(
            [by[(ours, s)][figure] / by[(pair, s)][figure] for s in SEEDS], unit="x")
        for pair in list(PAIRS)[1:] for figure in ("mean_jct_s", "p90_jct_s"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--programs", type=int, default=240, help="per replica")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="agents")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    name = args.name or subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       capture_output=True, check=True).stdout.strip()
    cells = [(pair, seed, args.replicas, args.programs, args.workload)
             for seed in SEEDS for pair in PAIRS]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(_run, cells))
    report = (f"# Agent sessions over {args.replicas} replicas, simulated (H100 SXM, "
              f"Llama-3-8B)\n\n{args.programs * args.replicas} {args.workload} programs at "
              f"{RATE * args.replicas}/s, seeds {list(SEEDS)}; medians (range).\n\n"
              f"{table(runs, 'pair', tuple(PAIRS), LABELS, FIGURES)}\n\n{ratios(runs)}\n")
    stem = f"agents-replicas-{args.replicas}" + \
        ("" if args.workload == "agents" else f"-{args.workload}")
    out = HERE / "results" / name
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"runs": runs}, indent=1, default=float))
    (out / f"{stem}.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
