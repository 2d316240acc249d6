"""What a gate can win on this project's CPU, in the simulator calibrated on its steps.

    .venv/bin/python benchmarks/gate/cpu_room.py [--seeds N] [--set NAME]

On the real CPU engine with 16K-token prefixes, batch ordering shortens the decode step
to 0.74x (``benchmarks/vllm/results/2cf19a3/gate-churn-16k.md``), yet the model gate
takes no STOP there.  This asks the simulator, with the profile ``feather calibrate``
fitted to 144 steps of that engine on 16K-token prefixes
(``benchmarks/sim/results/3a9c2f2/cpu-16k-*``), what each gate would
win with ordering off, given that profile from its first step (``model-warm``) or not:
ordering's gain is the room; a STOP can take it only by keeping new groups out, and vLLM's
persistent batch then still puts the admitted ones into the holes finished requests
leave.  Writes cpu-room.json and cpu-room.md into results/NAME/ (default: the commit;
``--seeds`` workload seeds a cell, default 3; medians and ranges of ratios to always-add
without ordering).
"""

from __future__ import annotations

from pathlib import Path

from feather_sched.bench.study import Study, by_scheduler, markdown_table, parser, ratio
from feather_sched.results.summary import summarize
from feather_sched.sim.engine import SimEngine
from feather_sched.sim.policies import make_policy
from feather_sched.sim.runner import SimPlan, as_run_result
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import shared_prefix_groups

HERE = Path(__file__).parent
PROFILE = HERE.parent / "sim" / "results" / "3a9c2f2" / "cpu-16k-profile.json"
"""The profile `feather calibrate` fitted to 144 CPU-engine steps on 16K-token prefixes."""
STRICT = {"max_loss": 0, "max_loss_loaded": 0, "floor_start": 0, "floor_step": 0}
COLUMNS = {  # label -> (scheduler, Feather options)
    "always, no ordering": ("feather-always-noorder-unbounded", {}),
    "always, ordered": ("feather-always-unbounded", {}),
    "model (warm)": ("feather-model-noorder-unbounded", {"gate_options": {"prior": str(PROFILE)}}),
    "model (cold)": ("feather-model-noorder-unbounded", {"gate_options": {"prior": "none"}}),
    "chunk-loss": ("feather-chunk-loss-noorder-unbounded", {}),
    "chunk-loss, no loss allowed": ("feather-chunk-loss-noorder-unbounded",
                                    {"gate_options": STRICT}),
}
CELLS = {  # label -> (groups, per group, output tokens, Poisson rate or None: offline)
    "churn (gate.sh d): 16x8, 64 out, 8/s": (16, 8, 64, 8.0),
    "8x16, 256 out, 8/s": (8, 16, 256, 8.0),
    "8x16, 256 out, offline": (8, 16, 256, None),
    "8x16, 128 out, 2/s": (8, 16, 128, 2.0),
}


def throughput(cell: tuple, seed: int, scheduler: str, options: dict) -> float:
    """Output tokens per second of one simulated run: 16K-token prefixes, output lengths
    jittered by 0.9, at most 32 running (the engine settings of ``gate.sh``)."""
    groups, per, output, rate = cell
    workload = shared_prefix_groups(
        groups=groups, prompts_per_group=per, prefix_len=16384, suffix_len=32,
        output_len=output, jitter=0.9, seed=seed,
        arrival=None if rate is None else ArrivalSpec(kind="poisson", rate=rate))
    plan = SimPlan.from_options(workload, profile=PROFILE, max_num_seqs=32)
    engine = SimEngine(plan.cost_model(scheduler), plan.engine_config())
    policy = make_policy(scheduler, options, engine)
    return summarize(as_run_result(engine.run(workload, policy), policy, scheduler))[
        "output_throughput"]


def markdown(records: list[dict]) -> str:
    """Per cell: each column's throughput over the first column's, per seed, as the median
    (range)."""
    base = next(iter(COLUMNS))
    rows = []
    for label in CELLS:
        runs = by_scheduler({r["column"]: r for r in records
                             if r["cell"] == label and r["seed"] == seed}
                            for seed in sorted({r["seed"] for r in records}))
        rows.append([label, *(ratio(runs[c], runs[base], "output_throughput", "{:.3f}",
                                    unit="") for c in COLUMNS)])
    return markdown_table(["cell", *COLUMNS], rows)


def main() -> None:
    args = parser(__doc__, seeds=3).parse_args()
    study = Study(__file__, set_name=args.set)
    records = [{"cell": label, "seed": seed, "column": column,
                "output_throughput": throughput(cell, seed, *COLUMNS[column])}
               for label, cell in CELLS.items() for seed in range(args.seeds)
               for column in COLUMNS]
    study.save("cpu-room", {"profile": str(PROFILE.name), "records": records},
               markdown(records))


if __name__ == "__main__":
    main()
