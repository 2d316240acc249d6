"""The gate ablation, in the paper's form: FCFS and Feather with each gate, ordering on and
off, under the fairness bound (Feather's default) and without it; plus how fast the
learning gates learn (the first 100 steps, cold vs warm).

    .venv/bin/python benchmarks/gate/ablation.py [--seeds N] [--jobs J]

Llama-3-8B in the simulator, ``--seeds`` workload seeds per cell (arrivals, group sizes,
prompts; default 5): the seed moves the ordering-off cell's model / always-add between
about 1.1x and 1.4x, so the tables give the median and the range of per-seed ratios.
Cells: the issue's ordering-off cell (8 groups x 100, 10K prefixes at 100 req/s on RTX
6000 Ada, whose L2 holds a 10K prefix per layer); a large batch of one group with
singletons of new long-prefix groups arriving, with 10K-token prompts and with 16K-token
ones (longer than the L2 holds beside the group's prefix); many long-prefix groups under
KV-pool pressure (a pool of 16 prefixes for 32 groups); two of the sweep's shapes; and
two small bursts (4 x 40, 16 x 50).  "bandit (pretrained)" starts from a table
``feather pretrain`` wrote for the cell's GPU (kept in tables/); "model" starts from the
GPU's profile, "model (cold)" from nothing.  Writes ablation.json and ablation.md here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from feather_sched.costmodel.cost import CostModel
from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS
from feather_sched.results.summary import median_and_range, prefill_over_floor, summarize
from feather_sched.sim.engine import EngineConfig, SimEngine
from feather_sched.sim.policies import make_policy
from feather_sched.sim.runner import SimPlan, as_run_result, pretrain_bandit
from feather_sched.workloads.options import WorkloadArgs
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import minority_groups, shared_prefix_groups

HERE = Path(__file__).parent
MODEL = MODELS["llama-3-8b"]
GATES = ("always", "chunk-loss", "bandit", "bandit-pretrained", "model")
FIRST_STEPS = 100


def poisson(rate: float) -> ArrivalSpec:
    return ArrivalSpec(kind="poisson", rate=rate)


def groups(n: int, per: int, prefix: int, output: int, rate: float | None, seed: int = 0):
    return shared_prefix_groups(groups=n, prompts_per_group=per, prefix_len=prefix,
                                suffix_len=20, output_len=output,
                                arrival=None if rate is None else poisson(rate), seed=seed)


def singletons(seed: int, tokens: int = 10240):
    """400 requests of one 10K-prefix group and 40 singletons of ``tokens``-token prompts."""
    return minority_groups(majority=400, minorities=[1] * 40, prefix_len=10240,
                           minority_prefix_len=tokens, suffix_len=20, output_len=100,
                           arrival=poisson(60), seed=seed)


CELLS = {  # label -> (GPU, workload of a seed, engine limits; None: the GPU's defaults)
    "ordering-off cell (8x100, 10K, 100/s)": (
        "rtx6000-ada", lambda seed: groups(8, 100, 10240, 50, 100, seed), None),
    "singletons into one large group (400 + 40x1, 10K, 60/s)": (
        "rtx6000-ada", singletons, None),
    "16K-token singletons into one large group (400 + 40x1, 10K, 60/s)": (
        "rtx6000-ada", lambda seed: singletons(seed, 16384), None),
    "KV-pool pressure (32x16, 16K, pool of 256K tokens, 40/s)": (
        "h100-sxm", lambda seed: groups(32, 16, 16384, 100, 40, seed),
        EngineConfig(num_blocks=16384)),
    "sweep: 8x100, 5K, offline": (
        "h100-sxm", lambda seed: groups(8, 100, 5120, 50, None, seed), None),
    "sweep: 100x8, 1K, offline": (
        "rtx6000-ada", lambda seed: groups(100, 8, 1024, 50, None, seed), None),
    "small burst (4x40, 10K, 100/s)": (
        "rtx6000-ada", lambda seed: groups(4, 40, 10240, 50, 100, seed), None),
    "small burst (16x50, 10K, 100/s)": (
        "rtx6000-ada", lambda seed: groups(16, 50, 10240, 50, 100, seed), None),
}


def pretrained_table(hardware: str) -> Path:
    """``feather pretrain``'s table for this GPU (written once, then reused)."""
    path = HERE / "tables" / f"bandit-{hardware}-llama-3-8b.json"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        plan = SimPlan(workload=groups(1, 1, 16, 1, None), hardware=HARDWARE[hardware],
                       model=MODEL)

        def workload_of(n: int, per: int, prefix: int, output: int, seed: int):
            return WorkloadArgs(groups=n, prompts_per_group=per, prefix_len=prefix,
                                output_len=output, seed=seed).build()

        pretrain_bandit(plan, str(path), 2, workload_of)
    return path


def scheduler(gate: str, ordered: bool, bounded: bool) -> str:
    """The scheduler name of one ablation column."""
    return (f"feather-{gate.removesuffix('-pretrained')}" + ("" if ordered else "-noorder")
            + ("" if bounded else "-unbounded"))


def run(hardware: str, workload, engine: EngineConfig | None, name: str,
        options: dict) -> tuple[dict, float]:
    """One run: its summary and its scheduled requests per second over the first steps."""
    plan = SimPlan(workload=workload, hardware=HARDWARE[hardware], model=MODEL,
                   engine=engine)
    cost = CostModel(plan.hardware, plan.model, plan.params)
    sim = SimEngine(cost, plan.engine_config())
    policy = make_policy(name, options, sim)
    first: list[tuple[int, float]] = []
    end_step = policy.end_step

    def counted(step, batch_size, seconds, batch=None):
        if len(first) < FIRST_STEPS:
            first.append((batch_size, seconds))
        return end_step(step, batch_size, seconds, batch)

    policy.end_step = counted
    result = as_run_result(sim.run(workload, policy), policy, name)
    early = sum(b for b, _ in first) / sum(s for _, s in first)
    return {**summarize(result),
            "prefill_over_floor": prefill_over_floor(result.records, workload)}, early


def cell_rows(label: str, seed: int) -> list[dict]:
    """Every column of one cell for one workload seed."""
    hardware, workload_of, engine = CELLS[label]
    workload = workload_of(seed)
    rows = []
    table = pretrained_table(hardware)

    def record(column: str, ordered: bool | None, bounded: bool | None, name: str,
               options: dict) -> None:
        summary, early = run(hardware, workload, engine, name, options)
        rows.append({"cell": label, "seed": seed, "hardware": hardware, "column": column,
                     "ordered": ordered, "bounded": bounded, "scheduler": name,
                     "options": {k: str(v) for k, v in options.items()},
                     "first_steps_requests_per_s": early,
                     **{k: summary[k] for k in ("output_throughput", "mean_ttft_ms",
                                                "p99_ttft_ms", "mean_groups_per_step",
                                                "modelled_l2_hit_rate",
                                                "prefill_over_floor")}})

    record("fcfs", None, None, "fcfs", {})
    for bounded in (True, False):
        for ordered in (True, False):
            for gate in GATES:
                name = scheduler(gate, ordered, bounded)
                if gate == "bandit-pretrained":
                    with tempfile.TemporaryDirectory() as tmp:
                        state = Path(tmp) / "table.json"  # a run saves back to its table
                        shutil.copy(table, state)
                        record(gate, ordered, bounded, name, {"state_file": str(state)})
                else:
                    record(gate, ordered, bounded, name, {})
            record("model-cold", ordered, bounded, scheduler("model", ordered, bounded),
                   {"gate_options": {"prior": "none"}})
    return rows


def ratios(tput: dict[tuple, float], column: str, setting: tuple[bool, bool],
           over: str | None = None) -> list[float]:
    """Per seed, ``column``'s throughput over ``over``'s in ``setting`` (bounded, ordered);
    ``over`` None: over FCFS.  ``tput`` maps (seed, column, bounded, ordered) to tok/s."""
    below = (over, *setting) if over else ("fcfs", None, None)
    seeds = sorted({key[0] for key in tput})
    return [tput[(seed, column, *setting)] / tput[(seed, *below)] for seed in seeds]


def markdown(rows: list[dict]) -> str:
    """Per cell: each column's throughput over FCFS's, and the model gate's over always-add
    and chunk-loss, as medians (and ranges) of per-seed ratios."""
    columns = (*GATES, "model-cold")
    seeds = sorted({r["seed"] for r in rows})
    lines = [f"Medians over {len(seeds)} workload seeds (range in brackets).", ""]
    for label in dict.fromkeys(r["cell"] for r in rows):
        cell = [r for r in rows if r["cell"] == label]
        tput = {(r["seed"], r["column"], r["bounded"], r["ordered"]): r["output_throughput"]
                for r in cell}
        fcfs = [tput[seed, "fcfs", None, None] for seed in seeds]
        lines += [f"### {label} ({cell[0]['hardware']}; FCFS "
                  f"{median_and_range(fcfs, '{:,.0f}')} tok/s)", "",
                  "| bound | ordering | " + " | ".join(columns)
                  + " | model / always | model / chunk-loss |",
                  "|---|---|" + "---|" * (len(columns) + 2)]
        for bounded in (True, False):
            for ordered in (True, False):
                setting = (bounded, ordered)
                over_fcfs = [statistics.median(ratios(tput, c, setting)) for c in columns]
                model_over = [median_and_range(ratios(tput, "model", setting, over), "{:.3f}")
                              for over in ("always", "chunk-loss")]
                lines.append(f"| {'on' if bounded else 'off'} | {'on' if ordered else 'off'} | "
                             + " | ".join([*(f"{r:.2f}x" for r in over_fcfs), *model_over])
                             + " |")
        early = {column: [r["first_steps_requests_per_s"] for r in cell
                          if r["column"] == column and r["bounded"] is False
                          and r["ordered"] is False]
                 for column in ("bandit", "bandit-pretrained", "model", "model-cold")}
        floor = {column: [r["prefill_over_floor"] for r in cell if r["column"] == column
                          and r["bounded"] in (False, None) and r["ordered"] in (False, None)]
                 for column in ("fcfs", "always", "chunk-loss", "model")}
        lines += ["", "First 100 steps, scheduled requests/s (bound off, ordering off): "
                  + ", ".join(f"{column} {median_and_range(values, '{:,.0f}')}"
                              for column, values in early.items()), "",
                  "Prompt tokens computed over the floor (each group's prefix once; bound "
                  "off, ordering off): " + ", ".join(f"{column} {median_and_range(values)}"
                                                      for column, values in floor.items()),
                  ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="workload seeds per cell")
    parser.add_argument("--jobs", type=int, default=2, help="processes")
    args = parser.parse_args()
    started = time.perf_counter()
    for hardware in dict.fromkeys(hardware for hardware, _, _ in CELLS.values()):
        pretrained_table(hardware)  # once, before the processes read it
    tasks = [(label, seed) for label in CELLS for seed in range(args.seeds)]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = [row for cell in pool.map(cell_rows, *zip(*tasks, strict=True)) for row in cell]
    (HERE / "ablation.json").write_text(json.dumps(rows, indent=1))
    text = markdown(rows)
    (HERE / "ablation.md").write_text(text + "\n")
    print(text)
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
