"""What a gate can win on this project's CPU, in the simulator calibrated on its steps.

    .venv/bin/python benchmarks/gate/cpu_room.py [--seeds N]

On the real CPU engine with 16K-token prefixes, batch ordering shortens the decode step
to 0.74x (``benchmarks/vllm/gate-churn-16k.md``), yet the model gate takes no STOP there.
This asks the simulator, with the profile ``feather calibrate`` fitted to 144 steps of
that engine on 16K-token prefixes (``benchmarks/sim/cpu-16k-*``), what each gate would
win with ordering off, given that profile from its first step (``model-warm``) or not:
ordering's gain is the room; a STOP can take it only by keeping new groups out, and vLLM's
persistent batch then still puts the admitted ones into the holes finished requests
leave.  Writes cpu-room.json and cpu-room.md here (``--seeds`` workload seeds a cell,
default 3; medians and ranges of ratios to always-add without ordering).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from feather_sched.costmodel.calibrate import load_profile
from feather_sched.costmodel.cost import CostModel
from feather_sched.results.summary import median_and_range, summarize
from feather_sched.sim.engine import EngineConfig, SimEngine
from feather_sched.sim.policies import make_policy
from feather_sched.sim.runner import SimPlan, as_run_result
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import shared_prefix_groups

HERE = Path(__file__).parent
PROFILE = HERE.parent / "sim" / "cpu-16k-profile.json"
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
    profile = load_profile(PROFILE)
    plan = SimPlan(workload=workload, hardware=profile.hardware, model=profile.model,
                   params=profile.params)
    limits = plan.engine_config()
    engine = SimEngine(CostModel(profile.hardware, profile.model, profile.params),
                       EngineConfig(block_tokens=limits.block_tokens,
                                    num_blocks=limits.num_blocks, max_num_seqs=32))
    policy = make_policy(scheduler, options, engine)
    return summarize(as_run_result(engine.run(workload, policy), policy, scheduler))[
        "output_throughput"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    seeds = range(parser.parse_args().seeds)
    records = [{"cell": label, "seed": seed, "column": column,
                "output_throughput": throughput(cell, seed, *COLUMNS[column])}
               for label, cell in CELLS.items() for seed in seeds for column in COLUMNS]
    (HERE / "cpu-room.json").write_text(json.dumps({"profile": str(PROFILE.name),
                                                    "records": records}, indent=1) + "\n")
    tput = {(r["cell"], r["seed"], r["column"]): r["output_throughput"] for r in records}
    base = next(iter(COLUMNS))
    lines = ["| cell | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for label in CELLS:
        ratios = [median_and_range([tput[label, s, c] / tput[label, s, base] for s in seeds],
                                   "{:.3f}") for c in COLUMNS]
        lines.append(f"| {label} | " + " | ".join(ratios) + " |")
    table = "\n".join(lines) + "\n"
    (HERE / "cpu-room.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
