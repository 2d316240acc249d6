"""The gate ablation, in the paper's form: FCFS and Feather with each gate, ordering on and
off, under the fairness bound (Feather's default) and without it; plus how fast the
learning gates learn (the first 100 steps, cold vs warm).

    .venv/bin/python benchmarks/gate/ablation.py

Llama-3-8B in the simulator.  Cells: the issue's ordering-off cell (8 groups x 100, 10K
prefixes at 100 req/s on RTX 6000 Ada, whose L2 holds a 10K prefix per layer); a large
batch of one group with singletons of new long-prefix groups arriving; many long-prefix
groups under KV-pool pressure (a pool of 16 prefixes for 32 groups); two of the sweep's
shapes; and two small bursts (4 x 40, 16 x 50).  "bandit (pretrained)" starts from a table
``feather pretrain`` wrote for the cell's GPU (kept in tables/); "model" starts from the
GPU's profile, "model (cold)" from nothing.  Writes ablation.json and ablation.md here.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from feather_sched.bench.report import summarize
from feather_sched.bench.serving import WorkloadArgs
from feather_sched.sim.cost import CostModel
from feather_sched.sim.engine import EngineConfig, SimEngine
from feather_sched.sim.hardware import HARDWARE
from feather_sched.sim.model_profiles import MODELS
from feather_sched.sim.policies import make_policy
from feather_sched.sim.runner import SimPlan, as_run_result, pretrain_bandit
from feather_sched.workloads import ArrivalSpec, minority_groups, shared_prefix_groups

HERE = Path(__file__).parent
MODEL = MODELS["llama-3-8b"]
GATES = ("always", "chunk-loss", "bandit", "bandit-pretrained", "model")
FIRST_STEPS = 100


def poisson(rate: float) -> ArrivalSpec:
    return ArrivalSpec(kind="poisson", rate=rate)


def groups(n: int, per: int, prefix: int, output: int, rate: float | None):
    return shared_prefix_groups(groups=n, prompts_per_group=per, prefix_len=prefix,
                                suffix_len=20, output_len=output,
                                arrival=None if rate is None else poisson(rate), seed=0)


CELLS = {
    "ordering-off cell (8x100, 10K, 100/s)": ("rtx6000-ada", groups(8, 100, 10240, 50, 100),
                                              None),
    "singletons into one large group (400 + 40x1, 10K, 60/s)": (
        "rtx6000-ada", minority_groups(majority=400, minorities=[1] * 40, prefix_len=10240,
                                       suffix_len=20, output_len=100, arrival=poisson(60),
                                       seed=0), None),
    "KV-pool pressure (32x16, 16K, pool of 256K tokens, 40/s)": (
        "h100-sxm", groups(32, 16, 16384, 100, 40), EngineConfig(num_blocks=16384)),
    "sweep: 8x100, 5K, offline": ("h100-sxm", groups(8, 100, 5120, 50, None), None),
    "sweep: 100x8, 1K, offline": ("rtx6000-ada", groups(100, 8, 1024, 50, None), None),
    "small burst (4x40, 10K, 100/s)": ("rtx6000-ada", groups(4, 40, 10240, 50, 100), None),
    "small burst (16x50, 10K, 100/s)": ("rtx6000-ada", groups(16, 50, 10240, 50, 100), None),
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
    return summarize(result), early


def cell_rows(label: str, hardware: str, workload, engine) -> list[dict]:
    rows = []
    table = pretrained_table(hardware)

    def record(column: str, ordered: bool | None, bounded: bool | None, name: str,
               options: dict) -> None:
        summary, early = run(hardware, workload, engine, name, options)
        rows.append({"cell": label, "hardware": hardware, "column": column,
                     "ordered": ordered, "bounded": bounded, "scheduler": name,
                     "options": {k: str(v) for k, v in options.items()},
                     "first_steps_requests_per_s": early,
                     **{k: summary[k] for k in ("output_throughput", "mean_ttft_ms",
                                                "p99_ttft_ms", "mean_groups_per_step",
                                                "modelled_l2_hit_rate")}})

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


def markdown(rows: list[dict]) -> str:
    columns = (*GATES, "model-cold")
    lines = []
    for label in dict.fromkeys(r["cell"] for r in rows):
        cell = [r for r in rows if r["cell"] == label]
        fcfs = next(r for r in cell if r["column"] == "fcfs")["output_throughput"]
        lines += [f"### {label} ({cell[0]['hardware']}; FCFS {fcfs:,.0f} tok/s)", "",
                  "| bound | ordering | " + " | ".join(columns)
                  + " | model / always | model / chunk-loss |",
                  "|---|---|" + "---|" * (len(columns) + 2)]
        for bounded in (True, False):
            for ordered in (True, False):
                by = {r["column"]: r["output_throughput"] for r in cell
                      if r["bounded"] is bounded and r["ordered"] is ordered}
                ratios = [f"{by[c] / fcfs:.2f}x" for c in columns]
                lines.append(f"| {'on' if bounded else 'off'} | {'on' if ordered else 'off'} | "
                             + " | ".join(ratios)
                             + f" | {by['model'] / by['always']:.3f} | "
                             f"{by['model'] / by['chunk-loss']:.3f} |")
        lines += ["", "First 100 steps, scheduled requests/s (bound off, ordering off): "
                  + ", ".join(f"{r['column']} {r['first_steps_requests_per_s']:,.0f}"
                              for r in cell if r["bounded"] is False and r["ordered"] is False
                              and r["column"] in ("bandit", "bandit-pretrained", "model",
                                                  "model-cold")), ""]
    return "\n".join(lines)


def main() -> None:
    started = time.perf_counter()
    rows = []
    for label, (hardware, workload, engine) in CELLS.items():
        rows += cell_rows(label, hardware, workload, engine)
        print(f"{label}: {time.perf_counter() - started:.0f} s", flush=True)
    (HERE / "ablation.json").write_text(json.dumps(rows, indent=1))
    text = markdown(rows)
    (HERE / "ablation.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
