"""The simulator's cascade term against the CPU shared-prefix path (see cascade_check.sh).

    .venv/bin/python benchmarks/sim/cascade_check.py [--set NAME]

Reads the step logs and profiles cascade_check.sh wrote into results/NAME/ (default: the
recorded set, f4be89a), prints a markdown report: how
each profile predicts each set of measured steps (MAPE per step, and predicted over
measured total time), and the simulator's ratios for the real engine's 4 x 16 workload
next to the measured ones (``MEASURED``, benchmarks/vllm's shared-4x16 rounds).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from feather_sched.bench.study import load_rounds, markdown_table, parser, ratios, summaries
from feather_sched.costmodel.calibrate import Profile, load_profile
from feather_sched.sim.runner import SimPlan
from feather_sched.telemetry.steplog import read_steps
from feather_sched.workloads.synthetic import shared_prefix_groups

HERE = Path(__file__).parent
RECORDED = "f4be89a"
"""The recorded run set of cascade_check.sh."""
MEASURED = HERE.parent / "vllm" / "results" / "9cca4cc" / "shared-4x16.json"
PLAIN = "cpu-shared-off-profile.json"
PAIRS = (  # (engine's names, simulator's names): on the engine Feather's default is on
    (("fcfs-shared", "fcfs"), ("fcfs-shared", "fcfs")),
    (("feather-model", "fcfs"), ("feather-model-shared", "fcfs")),
    (("feather-model", "feather-model-noshared"), ("feather-model-shared", "feather-model")),
)


def prediction(profile: Profile, cascade: bool, steps) -> tuple[float, float]:
    """(MAPE per step, predicted / measured total time)."""
    model = profile.cost_model(cascade=cascade)
    predicted = np.array([model.step(batch).seconds for batch, _ in steps])
    measured = np.array([seconds for _, seconds in steps])
    return float(np.mean(np.abs(predicted / measured - 1))), predicted.sum() / measured.sum()


def simulated_ratios(path: Path) -> dict[tuple[str, str], float]:
    """The simulator's output-throughput ratios on the 4 x 16 workload with the profile at
    ``path``, engine limits as vLLM's CPU defaults (128-token blocks, 4 GiB of KV, 256
    sequences, 4096 tokens)."""
    workload = shared_prefix_groups(groups=4, prompts_per_group=16, prefix_len=8192,
                                    suffix_len=32, output_len=64, seed=0)
    plan = SimPlan.from_options(workload, profile=path, block_tokens=128, kv_cache_gib=4,
                                max_num_batched_tokens=4096)
    throughput = {name: summary["output_throughput"] for name, summary in summaries(
        plan, sorted({name for _, pair in PAIRS for name in pair})).items()}
    return {engine: throughput[a] / throughput[b] for engine, (a, b) in PAIRS}


def measured_ratios() -> dict[tuple[str, str], float]:
    """Median per-round ratios of the real engine's runs."""
    runs = load_rounds(MEASURED)
    return {(a, b): statistics.median(ratios(runs[a], runs[b], "output_throughput"))
            for (a, b), _ in PAIRS}


def main() -> None:
    arguments = parser(__doc__)
    arguments.set_defaults(set=RECORDED)
    folder = HERE / "results" / arguments.parse_args().set
    plain = load_profile(folder / PLAIN)
    cascade = load_profile(folder / "cpu-shared-on-profile.json")
    off_steps = read_steps(folder / "cpu-shared-off-steps.csv")
    on_steps = read_steps(folder / "cpu-shared-on-steps.csv")
    rows = []
    for label, profile, is_cascade, steps, which in (
            ("plain fit", plain, False, off_steps, "vLLM's attention (its fit)"),
            ("plain fit, cascade term", plain, True, on_steps, "shared-prefix attention"),
            ("plain fit, no cascade term", plain, False, on_steps, "shared-prefix attention"),
            ("cascade fit", cascade, True, on_steps, "shared-prefix attention (its fit)")):
        error, total = prediction(profile, is_cascade, steps)
        rows.append([label, f"{which}, {len(steps)}", f"{100 * error:.1f}%", f"{total:.2f}"])
    measured = measured_ratios()
    simulated = simulated_ratios(folder / PLAIN)
    print("\n".join([
        "## Step times", "",
        markdown_table(["profile", "steps", "MAPE per step", "predicted / measured total"],
                       rows),
        "", "## The make run workload (4 x 16, 8K prefixes), output tokens/s", "",
        markdown_table(["ratio", "measured (median of 3 rounds)",
                        "simulator, plain fit + cascade term"],
                       ([f"{pair[0]} / {pair[1]}", f"{measured[pair]:.2f}x",
                         f"{simulated[pair]:.2f}x"] for pair, _ in PAIRS))]))


if __name__ == "__main__":
    main()
