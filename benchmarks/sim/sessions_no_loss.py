"""No loss where there are no agent sessions: Feather with and without its session rule
(issue 62) on workloads of single requests.

    PYTHONPATH=src .venv/bin/python benchmarks/sim/sessions_no_loss.py [--set NAME] [--jobs 2]

Llama-3-8B on the H100 SXM profile, vLLM's GPU limits, the scheduler's Python time not
charged to the clock.  Two workloads, seeds 0, 1 and 2:

* ``shared-prefix``: 8 groups of 100 prompts sharing a 4,096-token prefix (32-token
  suffixes, 50 output tokens) at 100 requests/s, the H100's KV pool (the
  ``shared_prefix.py`` grid's first cell);
* ``mooncake``: the FAST'25 synthetic trace (``../shared/traces``), the window of 1,000
  requests from request 1,000 k, at 0.25x speed, in a 32 GiB KV pool (half the H100's:
  KV pressure, where a hold would cost most, yet room for its longest request, 191K
  tokens; requests that extend an earlier one are recognised as a session's turns, but
  none ends in a tool call).

Both schedulers run through the closed-loop driver (``sim.programs.run_programs``), each
request a program of one turn: ``feather-model`` with vLLM's LRU retention, and
``feather-model+sessions`` with Feather's session rule.  Per run: mean and p99 TTFT, mean
end-to-end latency, output tokens/s, prefix-cache hit rate and the session counters;
the ratios of the two seed by seed against the 2% no-loss bound.  Writes
sessions_no_loss.json and .md into results/NAME/ (default: the commit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from feather_sched.bench.study import Study, markdown_table, parallel, parser, sim_plan
from feather_sched.results.summary import median_and_range, summarize
from feather_sched.sim import programs
from feather_sched.sim.engine import SimEngine
from feather_sched.sim.policies import make_policy
from feather_sched.workloads.agents import AgentWorkload
from feather_sched.workloads.options import WorkloadArgs
from feather_sched.workloads.spec import ArrivalSpec, Workload
from feather_sched.workloads.synthetic import shared_prefix_groups

HERE = Path(__file__).resolve().parent
MOONCAKE = HERE.parents[2] / "shared" / "traces" / "mooncake-synthetic.jsonl"
WORKLOADS = {"shared-prefix": None, "mooncake": 32.0}
"""Each workload's KV pool in GiB (None: the H100's)."""
SEEDS = (0, 1, 2)
GATE = "feather-model"
SCHEDULERS = (GATE, f"{GATE}+sessions")
FIGURES = ("mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "output_throughput",
           "prefix_cache_hit_rate")
BOUND = 0.02


def workload(name: str, seed: int) -> Workload:
    if name == "shared-prefix":
        return shared_prefix_groups(groups=8, prompts_per_group=100, prefix_len=4096,
                                    suffix_len=32, output_len=50,
                                    arrival=ArrivalSpec("poisson", 100.0), seed=seed)
    return WorkloadArgs(trace=MOONCAKE, start=seed * 1000, max_requests=1000,
                        trace_speed=0.25).build()


def run(task: tuple[str, int, str]) -> dict[str, Any]:
    """One scheduler on one workload's seed: its figures and session counters."""
    name, seed, scheduler = task
    agents = AgentWorkload.single_turns(workload(name, seed))
    plan = sim_plan(agents.open_loop(), kv_cache_gib=WORKLOADS[name],
                    charge_scheduler_time=False)
    engine = SimEngine(plan.cost_model(GATE), plan.engine_config())
    turns = programs.Turns.of(agents)
    retention: programs.LruRetention
    if scheduler.endswith("+sessions"):
        reload_s = programs.reload_seconds(engine.cost_model,
                                           engine.config.max_num_batched_tokens)
        retention = programs.SessionRetention(engine, turns, reload_s)
        policy: Any = programs.feather_with_sessions(engine, retention, {"gate": "model"},
                                                     scheduler)
    else:
        retention = programs.LruRetention(engine, turns)
        policy = make_policy(scheduler, {}, engine)
    result = programs.run_programs(engine, policy, agents, retention)
    summary = summarize(result.run_result())
    return {"workload": name, "seed": seed, "scheduler": scheduler,
            **{figure: summary[figure] for figure in FIGURES},
            "retention": retention.counts()}


def table(records: list[dict[str, Any]]) -> tuple[str, bool]:
    """Per workload and figure: each scheduler's median (range), and sessions over plain
    seed by seed; whether every ratio is within ``BOUND`` (lower is better for times)."""
    rows, within = [], True
    for name in WORKLOADS:
        by = {(r["scheduler"], r["seed"]): r for r in records if r["workload"] == name}
        for figure in FIGURES:
            cells = [median_and_range([float(by[(s, seed)][figure] or 0) for seed in SEEDS])
                     for s in SCHEDULERS]
            ratios = [float(by[(SCHEDULERS[1], seed)][figure] or 0) /
                      float(by[(SCHEDULERS[0], seed)][figure] or 1) for seed in SEEDS]
            worse = [r - 1 if figure.endswith("_ms") else 1 - r for r in ratios]
            within &= max(worse) <= BOUND
            rows.append([name, figure, *cells, median_and_range(ratios, unit="x"),
                         f"{max(worse):+.1%}"])
    headers = ["workload", "figure", "Feather", "Feather + sessions", "ratio",
               "worst loss"]
    return markdown_table(headers, rows), within


def main() -> None:
    options = parser(__doc__, jobs=2).parse_args()
    study = Study(__file__, set_name=options.set)
    tasks = [(name, seed, s) for name in WORKLOADS for seed in SEEDS for s in SCHEDULERS]
    records = parallel(run, tasks, options.jobs)
    text, within = table(records)
    verdict = f"\n\nEvery figure within {BOUND:.0%} of Feather's: {'yes' if within else 'NO'}"
    study.save("sessions_no_loss", {"records": records, "within_bound": within},
               text + verdict)


if __name__ == "__main__":
    main()
