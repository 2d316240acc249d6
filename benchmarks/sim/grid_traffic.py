"""Where the saturated grid's time goes: how far any scheduler could take it past FCFS.

    PYTHONPATH=src .venv/bin/python benchmarks/sim/grid_traffic.py [--seeds 1] [--jobs 2]

Issue 63 asks Feather for 1.2x the best-tuned vLLM knob's throughput on ``peers.py``'s
shared-prefix grid. This study reads the simulator's own traffic counters on that grid's
two cells (8 or 32 groups x 480 requests on 4K-token prefixes, 120 cold requests), all at
once (the saturated limit), Llama-3-8B on the H100 SXM profile: per scheduler the run's
seconds, output tokens/s, and the KV bytes read from HBM and from L2 against the weights'.
``no-KV s`` is the run's time less all its KV reads from HBM at the profile's HBM rate: no
scheduler or kernel gets below it (the cold requests must read their own context), so
FCFS's time over it bounds any gain. Writes grid_traffic.json and .md into results/NAME/
(default: the commit).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from feather_sched.bench.study import Study, markdown_table, parallel, parser, sim_plan
from feather_sched.results.summary import median_and_range, summarize
from feather_sched.sim.engine import SimEngine
from feather_sched.sim.policies import make_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import SATURATED_BEST, grid

CELLS = (8, 32)
"""The grid's group counts."""
SCHEDULERS = ("fcfs", "fcfs-shared", "feather-model", "feather-model-shared",
              SATURATED_BEST["vllm-cache-aware"],
              SATURATED_BEST["vllm-active-cap"])
TB = 1e12


def run(task: tuple[int, int, str]) -> dict[str, Any]:
    """One scheduler on one cell's seed, all at once: its time, throughput and traffic."""
    groups, seed, scheduler = task
    plan = sim_plan(grid(groups, seed, None))
    engine = SimEngine(plan.cost_model(scheduler), plan.engine_config())
    result = engine.run(plan.workload, make_policy(scheduler, plan.feather_options, engine))
    costs = result.costs
    return {"groups": groups, "seed": seed, "scheduler": scheduler,
            "seconds": result.duration_s,
            "output_throughput": summarize(result.run_result())["output_throughput"],
            "kv_hbm_tb": (costs.hbm_bytes - costs.weight_bytes) / TB,
            "no_kv_seconds": result.duration_s - (costs.hbm_bytes - costs.weight_bytes)
            / plan.hardware.hbm_bytes_per_s,
            "kv_l2_tb": costs.l2_bytes / TB, "weights_tb": costs.weight_bytes / TB}


def table(records: list[dict[str, Any]], seeds: int) -> str:
    """Per cell and scheduler: medians (range) over seeds, and throughput over FCFS's."""
    by = {(r["groups"], r["seed"], r["scheduler"]): r for r in records}
    rows = []
    for groups in CELLS:
        for scheduler in SCHEDULERS:
            runs = [by[(groups, seed, scheduler)] for seed in range(seeds)]
            ratio = [r["output_throughput"] / by[(groups, r["seed"], "fcfs")]
                     ["output_throughput"] for r in runs]
            rows.append([f"grid-{groups}", scheduler,
                         *(median_and_range([r[key] for r in runs])
                           for key in ("seconds", "no_kv_seconds", "kv_hbm_tb", "kv_l2_tb",
                                     "weights_tb")),
                         median_and_range(ratio, unit="x")])
    return markdown_table(["cell", "scheduler", "seconds", "no-KV s", "KV from HBM (TB)",
                           "KV from L2 (TB)", "weights (TB)", "tok/s over FCFS"], rows)


def main() -> None:
    options = parser(__doc__, seeds=1, jobs=2).parse_args()
    study = Study(__file__, set_name=options.set)
    tasks = [(g, seed, s) for g in CELLS for seed in range(options.seeds) for s in SCHEDULERS]
    records = parallel(run, tasks, options.jobs)
    study.save("grid_traffic", {"records": records}, table(records, options.seeds))


if __name__ == "__main__":
    main()
