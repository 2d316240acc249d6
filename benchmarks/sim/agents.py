"""Agent sessions in the simulator: job completion time of agent programs under vLLM's FCFS
with LRU, CacheTTL's TTL rule, SGLang's LPM, vLLM 0.34's cache-aware admission (window 16,
64, 256), SGLang's routing key (the program as its key), Feather without sessions and
Feather with them (issue 62).

    PYTHONPATH=src .venv/bin/python benchmarks/sim/agents.py [--name NAME] [--jobs 2]
        [--workload agents|bfcl]

Llama-3-8B on the H100 SXM profile, vLLM's GPU limits and the KV pool the H100 leaves
(26,674 blocks of 16 tokens), the scheduler's Python time not charged to the clock (the
figures are the policies' decisions alone, the same on any machine).  Workload: 240 agent
programs (``workloads.agents.agent_programs``, its default ``AgentShape``: about 9.7 turns
and an 11K-token final context each; ``--workload bfcl``: BFCL's multi-turn tasks,
``workloads.bfcl_programs``, about 10 turns and 11K tokens too) starting at 3.5/s (Poisson),
seeds 0, 1 and 2, closed loop (``sim.programs.run_programs``).  At this load the pool is
contended: FCFS preempts and its prefix-cache hit rate falls to about 0.56.  Per
scheduler: mean, p90 and p99 job completion time, first- and later-turn TTFT, output
tokens/s, prefix-cache hit rate, preemptions and the retention counters; medians over the
seeds with their range, and Feather-with-sessions' ratios to each baseline seed by seed.  Writes
agents.json (every run's figures) and agents.md into results/NAME/ (default: the commit;
``agents-bfcl.*`` for BFCL).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from feather_sched.results.summary import median_and_range, summarize
from feather_sched.sim import programs
from feather_sched.sim.engine import SimEngine
from feather_sched.sim.runner import SimPlan
from feather_sched.workloads.agents import agent_programs
from feather_sched.workloads.bfcl_programs import bfcl_programs
from feather_sched.workloads.spec import ArrivalSpec

HERE = Path(__file__).resolve().parent
PROGRAMS, RATE = 240, 3.5
SEEDS = (0, 1, 2)
GATE = "feather-model"
CACHE_AWARE = tuple(f"vllm-cache-aware-w{window}-t0" for window in (16, 64, 256))
"""vLLM 0.34's cache-aware admission, its window swept (threshold 0: its best on the
shared-prefix grid, benchmarks/sim/peers.py)."""
SCHEDULERS = ("fcfs", "ttl", "sglang-lpm", *CACHE_AWARE, "sglang-routing-key", GATE,
              f"{GATE}+sessions")
LABELS = {"fcfs": "vLLM FCFS + LRU", "ttl": "CacheTTL rule (program FCFS + TTL pins)",
          "sglang-lpm": "SGLang LPM + LRU",
          **{name: f"vLLM 0.34 cache-aware admission, window {name.split('-w')[1][:-3]}"
             for name in CACHE_AWARE},
          "sglang-routing-key": "SGLang routing-key (the program as its key) + LRU",
          GATE: "Feather, no sessions", f"{GATE}+sessions": "Feather + sessions"}
FIGURES = ("mean_jct_s", "p90_jct_s", "p99_jct_s", "mean_first_turn_ttft_ms",
           "mean_later_turn_ttft_ms", "output_throughput", "prefix_cache_hit_rate",
           "preemptions")
TARGETS = (("mean_jct_s", "fcfs", 0.5, "<="), ("mean_jct_s", "ttl", 0.9, "<="),
           ("p90_jct_s", "ttl", 1.0, "<="), ("output_throughput", "fcfs", 1.0, ">="),
           ("output_throughput", "ttl", 1.0, ">="))



WORKLOADS = {"agents": agent_programs, "bfcl": bfcl_programs}
"""``--workload``: generated agent programs, or BFCL's multi-turn tasks as programs."""


def run(scheduler: str, seed: int, workload: str = "agents") -> dict[str, Any]:
    """One scheduler on one seed's programs: its summary and retention counters."""
    agents = WORKLOADS[workload](programs=PROGRAMS, arrival=ArrivalSpec("poisson", RATE),
                                 seed=seed)
    plan = SimPlan.from_options(agents.open_loop(), charge_scheduler_time=False)
    engine = SimEngine(plan.cost_model("fcfs"), plan.engine_config())
    policy, retention = programs.serving(scheduler, engine, programs.Turns.of(agents))
    result = programs.run_programs(engine, policy, agents, retention)
    run_result = result.run_result()
    run_result.jobs = True
    summary = summarize(run_result)
    summary["preemptions"] = result.num_preemptions
    return {"scheduler": scheduler, "seed": seed, "summary": summary,
            "retention": retention.counts()}


def _run(args: tuple[str, int, str]) -> dict[str, Any]:
    return run(*args)


def table(runs: list[dict[str, Any]], column: str = "scheduler",
          rows: tuple[str, ...] = SCHEDULERS, labels: dict[str, str] = LABELS,
          figures: tuple[str, ...] = FIGURES) -> str:
    """Medians over the seeds with their range, one row per ``rows`` entry (the runs
    whose ``column`` names it, labelled by ``labels``)."""
    lines = [f"| {column} | " + " | ".join(figures) + " |",
             "|---" * (len(figures) + 1) + "|"]
    for row in rows:
        mine = [r["summary"] for r in runs if r[column] == row]
        cells = [median_and_range([float(s[f] or 0) for s in mine]) for f in figures]
        lines.append(f"| {labels[row]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(runs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Feather-with-sessions over each baseline seed by seed, against the issue's targets;
    then over the best cache-aware window and SGLang's routing key (no target)."""
    by = {(r["scheduler"], r["seed"]): r["summary"] for r in runs}
    ours = SCHEDULERS[-1]
    lines, verdicts = [], {}
    for figure, baseline, target, sense in TARGETS:
        values = [by[(ours, s)][figure] / by[(baseline, s)][figure] for s in SEEDS]
        met = all(v <= target if sense == "<=" else v >= target for v in values)
        verdicts[f"{figure}/{baseline}"] = {"ratios": values, "target": f"{sense} {target}",
                                            "met": met}
        lines.append(f"- {figure} Feather+sessions / {LABELS[baseline]}: "
                     f"{median_and_range(values, unit='x')}, target {sense} {target}: "
                     f"{'met' if met else 'NOT met'}")
    for baseline in (best_cache_aware(runs), "sglang-routing-key"):  # beside, no target
        for figure in ("mean_jct_s", "p90_jct_s"):
            values = [by[(ours, s)][figure] / by[(baseline, s)][figure] for s in SEEDS]
            lines.append(f"- {figure} Feather+sessions / {LABELS[baseline]}: "
                         f"{median_and_range(values, unit='x')}")
    return "\n".join(lines), verdicts


def best_cache_aware(runs: list[dict[str, Any]]) -> str:
    """The cache-aware window of the lowest median mean JCT over the seeds."""
    def median_jct(name: str) -> float:
        return statistics.median(r["summary"]["mean_jct_s"] for r in runs
                                 if r["scheduler"] == name)

    return min(CACHE_AWARE, key=median_jct)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default=None)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="agents")
    args = parser.parse_args()
    name = args.name or subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       capture_output=True, check=True).stdout.strip()
    cells = [(s, seed, args.workload) for seed in SEEDS for s in SCHEDULERS]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(_run, cells))
    text, verdicts = ratios(runs)
    retention = {r["scheduler"]: r["retention"] for r in runs if r["seed"] == SEEDS[0]}
    report = (f"# Agent sessions, simulated (H100 SXM, Llama-3-8B)\n\n{PROGRAMS} "
              f"{args.workload} programs at "
              f"{RATE}/s, seeds {list(SEEDS)}; medians (range).\n\n{table(runs)}\n\n{text}\n\n"
              f"Retention counters (seed {SEEDS[0]}): `{json.dumps(retention)}`\n")
    out, stem = HERE / "results" / name, "agents" if args.workload == "agents" else \
        f"agents-{args.workload}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"runs": runs, "targets": verdicts},
                                                 indent=1, default=float))
    (out / f"{stem}.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
