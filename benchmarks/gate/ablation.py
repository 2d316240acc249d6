"""The gate ablation, in the paper's form: FCFS and Feather with each gate, ordering on and
off, under the fairness bound (Feather's default) and without it; plus how fast the
learning gates learn (the first 100 steps, cold vs warm).

    .venv/bin/python benchmarks/gate/ablation.py [--seeds N] [--jobs J] [--set NAME]

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
GPU's profile, "model (cold)" from nothing.  Writes ablation.json and ablation.md into
results/NAME/ (default: the commit).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from feather_sched.bench.study import (
    Study,
    markdown_table,
    parallel,
    parser,
    ratio,
    ratios,
    sim_plan,
)
from feather_sched.results.summary import median_and_range, prefill_over_floor, summarize
from feather_sched.sim.engine import SimEngine
from feather_sched.sim.policies import make_policy
from feather_sched.sim.runner import as_run_result, pretrain_bandit
from feather_sched.workloads.options import WorkloadArgs
from feather_sched.workloads.spec import ArrivalSpec
from feather_sched.workloads.synthetic import minority_groups, shared_prefix_groups

HERE = Path(__file__).parent
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


CELLS = {  # label -> (GPU, workload of a seed, engine limits beside the GPU's defaults)
    "ordering-off cell (8x100, 10K, 100/s)": (
        "rtx6000-ada", lambda seed: groups(8, 100, 10240, 50, 100, seed), {}),
    "singletons into one large group (400 + 40x1, 10K, 60/s)": (
        "rtx6000-ada", singletons, {}),
    "16K-token singletons into one large group (400 + 40x1, 10K, 60/s)": (
        "rtx6000-ada", lambda seed: singletons(seed, 16384), {}),
    "KV-pool pressure (32x16, 16K, pool of 256K tokens, 40/s)": (
        "h100-sxm", lambda seed: groups(32, 16, 16384, 100, 40, seed), {"num_blocks": 16384}),
    "sweep: 8x100, 5K, offline": (
        "h100-sxm", lambda seed: groups(8, 100, 5120, 50, None, seed), {}),
    "sweep: 100x8, 1K, offline": (
        "rtx6000-ada", lambda seed: groups(100, 8, 1024, 50, None, seed), {}),
    "small burst (4x40, 10K, 100/s)": (
        "rtx6000-ada", lambda seed: groups(4, 40, 10240, 50, 100, seed), {}),
    "small burst (16x50, 10K, 100/s)": (
        "rtx6000-ada", lambda seed: groups(16, 50, 10240, 50, 100, seed), {}),
}


def pretrained_table(hardware: str) -> Path:
    """``feather pretrain``'s table for this GPU (written once, then reused)."""
    path = HERE / "tables" / f"bandit-{hardware}-llama-3-8b.json"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        plan = sim_plan(groups(1, 1, 16, 1, None), hardware)

        def workload_of(n: int, per: int, prefix: int, output: int, seed: int):
            return WorkloadArgs(groups=n, prompts_per_group=per, prefix_len=prefix,
                                output_len=output, seed=seed).build()

        pretrain_bandit(plan, str(path), 2, workload_of)
    return path


def scheduler(gate: str, ordered: bool, bounded: bool) -> str:
    """The scheduler name of one ablation column."""
    return (f"feather-{gate.removesuffix('-pretrained')}" + ("" if ordered else "-noorder")
            + ("" if bounded else "-unbounded"))


def run(hardware: str, workload, engine: dict[str, Any], name: str,
        options: dict) -> tuple[dict, float]:
    """One run: its summary and its scheduled requests per second over the first steps."""
    plan = sim_plan(workload, hardware, **engine)
    sim = SimEngine(plan.cost_model(name), plan.engine_config())
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


def cell_task(task: tuple[str, int]) -> list[dict]:
    """``cell_rows`` of a (cell, seed) task, as the process pool maps them."""
    return cell_rows(*task)


def by_column(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(column, bounded, ordered) -> its row on each seed, in seed order."""
    runs: dict[tuple, list[dict]] = {}
    for row in sorted(rows, key=lambda row: row["seed"]):
        runs.setdefault((row["column"], row["bounded"], row["ordered"]), []).append(row)
    return runs


def markdown(rows: list[dict]) -> str:
    """Per cell: each column's throughput over FCFS's, and the model gate's over always-add
    and chunk-loss, as medians (and ranges) of per-seed ratios."""
    columns = (*GATES, "model-cold")
    seeds = sorted({r["seed"] for r in rows})
    lines = [f"Medians over {len(seeds)} workload seeds (range in brackets).", ""]
    tput = "output_throughput"
    for label in dict.fromkeys(r["cell"] for r in rows):
        cell = [r for r in rows if r["cell"] == label]
        runs = by_column(cell)
        fcfs = runs["fcfs", None, None]
        settings = []
        for bounded in (True, False):
            for ordered in (True, False):
                ours = {column: runs[column, bounded, ordered] for column in columns}
                settings.append([
                    "on" if bounded else "off", "on" if ordered else "off",
                    *(f"{statistics.median(ratios(ours[c], fcfs, tput)):.2f}x" for c in columns),
                    *(ratio(ours["model"], ours[over], tput, "{:.3f}", unit="")
                      for over in ("always", "chunk-loss"))])
        off = {column: runs[column, False, False]
               for column in ("always", "chunk-loss", "bandit", "bandit-pretrained", "model",
                              "model-cold")} | {"fcfs": fcfs}

        def spread(column: str, key: str, fmt: str = "{:.2f}", off: dict = off) -> str:
            return f"{column} {median_and_range([r[key] for r in off[column]], fmt)}"

        early = ", ".join(spread(column, "first_steps_requests_per_s", "{:,.0f}")
                          for column in ("bandit", "bandit-pretrained", "model", "model-cold"))
        floor = ", ".join(spread(column, "prefill_over_floor")
                          for column in ("fcfs", "always", "chunk-loss", "model"))
        lines += [f"### {label} ({cell[0]['hardware']}; FCFS "
                  f"{median_and_range([r[tput] for r in fcfs], '{:,.0f}')} tok/s)", "",
                  markdown_table(["bound", "ordering", *columns, "model / always",
                                  "model / chunk-loss"], settings),
                  "", "First 100 steps, scheduled requests/s (bound off, ordering off): "
                  + early, "",
                  "Prompt tokens computed over the floor (each group's prefix once; bound "
                  "off, ordering off): " + floor, ""]
    return "\n".join(lines)


def main() -> None:
    args = parser(__doc__, seeds=5, jobs=2).parse_args()
    study = Study(__file__, set_name=args.set)
    for hardware in dict.fromkeys(hardware for hardware, _, _ in CELLS.values()):
        pretrained_table(hardware)  # once, before the processes read it
    tasks = [(label, seed) for label in CELLS for seed in range(args.seeds)]
    rows = [row for cell in parallel(cell_task, tasks, args.jobs) for row in cell]
    study.save("ablation", {"rows": rows}, markdown(rows))
    print(f"{study.elapsed():.0f} s")


if __name__ == "__main__":
    main()
