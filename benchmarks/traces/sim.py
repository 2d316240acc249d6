"""Public traces and real prompt text in the simulator: FCFS, SGLang's LPM and Feather.

    .venv/bin/python benchmarks/traces/sim.py [--set NAME]  # ~10 minutes on this 2-core machine
    .venv/bin/python benchmarks/traces/sim.py --overlap-scheduler   # sim-overlap.json
    .venv/bin/python benchmarks/traces/sim.py --feather-options JSON --set NAME  # an option

Llama-3-8B on the H100 SXM and H200 profiles, vLLM's GPU limits; three workloads:

* ``mooncake``: the Mooncake FAST'25 synthetic trace (``shared/traces``), seed k replaying
  its k-th third (``--start``, ``--max-requests``), stretched in time (``--trace-speed``);
* ``bfcl-tools``: BFCL's 1,053 tool-calling prompts, tool documentation first, in a
  seeded order, Poisson arrivals;
* ``sharegpt``: 1,000 ShareGPT conversations (vLLM's sampling), Poisson arrivals.

Two loads per workload and hardware, from FCFS's capacity (with every request of seed 0
at once, the requests finished by the time 90% are, over that time: the drain at the end
left out): *busy* offers 0.8x that rate, *saturated* 1.5x (a trace's speed is set so its
mean rate is that).  Prompts are tokenized with the embedded
model's tokenizer.  Each run is what ``feather sim`` prints for the same flags (the
cell's command is in ``sim.json``).  Writes ``sim.json`` into the run set's folder,
``results/NAME/`` (default: the commit); ``tables.py --sim-set NAME`` makes the tables.

The simulator adds each scheduler's Python time to its step by default (a synchronous
engine); ``--overlap-scheduler`` runs the same cells with that time overlapping the step
instead, as vLLM's async scheduling (its GPU default) and SGLang's overlap scheduler do,
into ``sim-overlap.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from feather_sched.bench.study import MODEL, Study, parser, sim_plan
from feather_sched.results.records import RunResult
from feather_sched.results.summary import summarize
from feather_sched.sim.runner import simulate
from feather_sched.workloads.options import WorkloadArgs

sys.path.insert(0, str(Path(__file__).parent))
from tables import FCFS, slim

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake-synthetic.jsonl"
TRACE_REQUESTS = 3993
WINDOW = TRACE_REQUESTS // 3
SEEDS = range(3)
HARDWARE_NAMES = ("h100-sxm", "h200")
LOADS = (("busy", 0.8), ("saturated", 1.5))
SCHEDULERS = (FCFS, "sglang-lpm", "feather-model")
SHAREGPT_REQUESTS = 1000


def workload_args(workload: str, seed: int, rate: float | None) -> WorkloadArgs:
    """A workload's seed at ``rate`` requests/s on average (None: all at once)."""
    if workload == "mooncake":
        return WorkloadArgs(trace=TRACE, start=seed * WINDOW, max_requests=WINDOW,
                            trace_speed=1e9 if rate is None else rate / trace_rate(seed),
                            seed=seed)
    requests = SHAREGPT_REQUESTS if workload == "sharegpt" else None
    return WorkloadArgs(dataset_name=workload, max_requests=requests, request_rate=rate,
                        seed=seed)


def trace_rate(seed: int) -> float:
    """The mean request rate of the trace's window of ``seed`` at speed 1."""
    workload = WorkloadArgs(trace=TRACE, start=seed * WINDOW, max_requests=WINDOW).build()
    return len(workload) / workload.requests[-1].arrival_s


def command(args: WorkloadArgs, hardware: str, overlap: bool, options: str = "{}") -> str:
    """The ``feather sim`` command of one run."""
    source = (f"--trace ../shared/traces/{TRACE.name} --start {args.start} "
              f"--max-requests {args.max_requests} --trace-speed {args.trace_speed:.4g}"
              if args.trace else
              f"--dataset-name {args.dataset_name} --request-rate {args.request_rate:.4g}"
              + (f" --max-requests {args.max_requests}" if args.max_requests else ""))
    return (f"feather sim {source} --seed {args.seed} --hardware {hardware} "
            f"--model {MODEL} --schedulers {','.join(SCHEDULERS)}"
            + (" --overlap-scheduler" if overlap else "")
            + (f" --feather-options '{options}'" if json.loads(options) else ""))


def run(args: WorkloadArgs, hardware: str, scheduler: str, overlap: bool,
        options: str = "{}") -> RunResult:
    """One simulated run; ``overlap``: the scheduler's time overlaps each step;
    ``options``: Feather's, as JSON."""
    plan = sim_plan(args.build(), hardware, schedulers=[scheduler], overlap_scheduler=overlap,
                    feather_options=json.loads(options))
    return simulate(plan, scheduler)


def capacity(workload: str, hardware: str, overlap: bool) -> float:
    """FCFS's requests/s with seed 0's requests all at once, until 90% have finished."""
    finished = sorted(r.finished_s or 0.0 for r in run(workload_args(workload, 0, None),
                                                         hardware, FCFS, overlap).records)
    done = int(0.9 * len(finished))
    return done / finished[done - 1]


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--overlap-scheduler", action="store_true",
                           help="overlap the scheduler's time with each step: sim-overlap.json")
    arguments.add_argument("--feather-options", default="{}",
                           help="Feather's options, JSON (with --set: the run set)")
    args = arguments.parse_args()
    options = args.feather_options
    overlap = args.overlap_scheduler
    study = Study(__file__, set_name=args.set)
    cells = []
    for workload in ("mooncake", "bfcl-tools", "sharegpt"):
        for hardware in HARDWARE_NAMES:
            rate = capacity(workload, hardware, overlap)
            for load, share in LOADS:
                started = time.perf_counter()
                runs: dict[str, list[dict]] = {name: [] for name in SCHEDULERS}
                for seed in SEEDS:
                    seeded = workload_args(workload, seed, share * rate)
                    for name in SCHEDULERS:
                        runs[name].append(slim(summarize(run(seeded, hardware, name,
                                                             overlap, options))))
                arrivals = f"{share * rate:.2f} req/s, {share}x FCFS's capacity"
                cells.append({"workload": workload, "hardware": hardware, "load": load,
                              "arrivals": arrivals, "capacity_req_s": rate,
                              "command": command(workload_args(workload, 0, share * rate),
                                                 hardware, overlap, options),
                              "runs": runs})
                print(f"{workload} {hardware} {load}: {arrivals}, "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
                study.write_json("sim-overlap" if overlap else "sim",
                                 {"cells": cells, "overlap_scheduler": overlap,
                                  "feather_options": json.loads(options)})


if __name__ == "__main__":
    main()
