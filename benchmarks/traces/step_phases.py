"""Where a CPU engine step's time goes, FCFS against Feather, on identical batches.

    .venv/bin/python benchmarks/traces/step_phases.py [--requests 100] [--gap 25] [--rounds 2]
    .venv/bin/python benchmarks/traces/step_phases.py --workload mooncake --requests 300 \
        --step-ms 13 --stem step_phases-mooncake

ShareGPT (or cpu.sh's Mooncake window: the trace's last 1,000 requests from the first,
hash blocks of 32 tokens, ``mooncake-moderate.sh``'s speed 2.6) on vLLM 0.32.0's CPU
engine (the embedded model), engine core and worker in one process, each run a fresh
process.  Arrivals are clocked by steps, not seconds: ShareGPT's request i enters before
step ``gap * i``, Mooncake's before step ``arrival / step-ms`` (its own burstiness at a
nominal step), so with the same admission order (ShareGPT shares nothing, and Feather's
order is then FCFS's; Mooncake's window fits the KV cache, where Feather keeps arrival
order) both schedulers run exactly the same batches (checked), and any difference in a
phase's time is that scheduler's own work, free of the feedback that a slower step
raises concurrency.  Per run, the seconds summed over all steps of:
``schedule`` and ``update_from_output`` (scheduler side; Feather's hooks inside them are
``before_schedule``, ``after_schedule`` and ``step_done``), ``execute_model`` and
``sample_tokens`` (worker side), and inside the worker Feather's batch-order plugin
(``order_by_schedule``) and attention planning (``_plan``).  The machine's speed drifts
between runs (compare a scheduler's phases with its own ``sample_tokens``, the same code
in both); Feather's own phases are what this measures.  Writes ``STEM.json`` (``--stem``,
default ``step_phases``) into the run set's folder, ``results/NAME/`` (``--set``, default
``cpu-<commit>``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from feather_sched.bench.study import Study, commit

HERE = Path(__file__).parent
PHASES = {"scheduler": ("schedule", "update_from_output"),
          "executor": ("execute_model", "sample_tokens"),
          "feather": ("before_schedule", "after_schedule", "step_done")}
KV_CACHE = {"kv_cache_memory_bytes": 4 * 2**30}
"""cpu.sh's 4 GiB KV cache; vLLM's CPU default sizes it from the NUMA node's memory and
refuses to start where the node is smaller than the machine (seen on a 2-core EPYC)."""
MOONCAKE = {"path": HERE.parents[2] / "shared" / "traces" / "mooncake-synthetic.jsonl",
            "start": 2993, "speed": 2.6, "token_scale": 0.0625,
            "engine_args": {"block_size": 32, **KV_CACHE}}
"""cpu.sh's Mooncake window at mooncake-moderate.sh's speed."""
WORKER = (("feather_sched.integrations.vllm.batch_order", None, "order_by_schedule"),
          ("feather_sched.integrations.vllm.attention", "SharedPrefixCPUMetadataBuilder",
           "_plan"))


def timed(owner: Any, name: str, totals: dict[str, float]) -> None:
    """Wrap ``owner.name`` so its seconds add up in ``totals[name]``."""
    call = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - started

    setattr(owner, name, wrapper)


def workload_steps(name: str, requests: int, gap: int, step_ms: float
                   ) -> tuple[Any, list[int], dict[str, Any]]:
    """The workload, the step before which each request enters, and its engine args."""
    from feather_sched.workloads.datasets import load_dataset
    from feather_sched.workloads.traces import Replay, load_mooncake

    if name == "sharegpt":
        workload = load_dataset("sharegpt", max_requests=requests)
        return workload, [gap * i for i in range(requests)], KV_CACHE
    replay = Replay(MOONCAKE["start"], requests, MOONCAKE["speed"], MOONCAKE["token_scale"])
    workload = load_mooncake(MOONCAKE["path"], replay=replay)
    entries = [int(r.arrival_s * 1000 / step_ms) for r in workload.requests]
    return workload, entries, MOONCAKE["engine_args"]


def one_run(scheduler: str, workload_name: str, requests: int, gap: int,
            step_ms: float) -> dict:
    """One scheduler's step-clocked run in this process."""
    import importlib

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from feather_sched.bench.offline import engine_kwargs, scheduler_specs
    from feather_sched.models import TINY_LLAMA

    workload, entries, engine_args = workload_steps(workload_name, requests, gap, step_ms)
    spec = scheduler_specs([scheduler], {})[0]
    totals: dict[str, float] = {}
    batches: list[tuple[int, int]] = []
    with tempfile.TemporaryDirectory() as scratch:
        llm = LLM(**engine_kwargs(spec, Path(scratch) / "stats.json", str(TINY_LLAMA),
                                  engine_args))
        engine = llm.llm_engine
        core = engine.engine_core.engine_core
        for name in ("add_request", *PHASES["scheduler"]):
            timed(core.scheduler, name, totals)
        for name in PHASES["executor"]:
            timed(core.model_executor, name, totals)
        for name in PHASES["feather"]:
            timed(core.scheduler.feather, name, totals)
        for module, owner, name in WORKER:
            target = importlib.import_module(module)
            timed(getattr(target, owner) if owner else target, name, totals)
        scheduled = core.scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            output = scheduled(*args, **kwargs)
            batches.append((len(output.num_scheduled_tokens),
                            output.total_num_scheduled_tokens))
            return output

        core.scheduler.schedule = schedule
        pending, step, started = list(zip(entries, workload.requests, strict=True)), 0, \
            time.perf_counter()
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= step:
                _, request = pending.pop(0)
                params = SamplingParams(max_tokens=request.output_len,
                                        min_tokens=request.output_len, ignore_eos=True,
                                        temperature=0.0)
                engine.add_request(request.request_id,
                                   TokensPrompt(prompt_token_ids=request.prompt.tolist()),
                                   params)
            if not engine.has_unfinished_requests():
                step = pending[0][0]
                continue
            engine.step()
            step += 1
        wall = time.perf_counter() - started
        engine.engine_core.shutdown()
    return {"scheduler": scheduler, "wall_s": wall, "steps": len(batches),
            "seconds": totals, "batches": batches}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--gap", type=int, default=25, help="steps between arrivals")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workload", choices=("sharegpt", "mooncake"), default="sharegpt")
    parser.add_argument("--step-ms", type=float, default=13.0,
                        help="Mooncake: the nominal step that clocks its arrivals")
    parser.add_argument("--schedulers", default="fcfs,feather-model")
    parser.add_argument("--set", help="run set: results/SET/ (default: cpu-<commit>)")
    parser.add_argument("--stem", default="step_phases", help="name of the .json written")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child run: its JSON on stdout
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.workload, args.requests, args.gap,
                                 args.step_ms)))
        return
    runs = []
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for _ in range(args.rounds):
        for scheduler in args.schedulers.split(","):
            child = subprocess.run(
                [sys.executable, __file__, "--one", scheduler, "--requests",
                 str(args.requests), "--gap", str(args.gap), "--workload", args.workload,
                 "--step-ms", str(args.step_ms)],
                env=env, capture_output=True, text=True, check=True)
            runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
            run = runs[-1]
            print(f"{scheduler:14s} wall {run['wall_s']:.2f} s, {run['steps']} steps: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in sorted(run["seconds"].items())),
                  flush=True)
    same = all(run["batches"] == runs[0]["batches"] for run in runs)
    print(f"identical batches in every run: {same}")
    Study(__file__, set_name=args.set or f"cpu-{commit()}").write_json(args.stem, {
        "workload": args.workload, "requests": args.requests, "gap": args.gap,
        "step_ms": args.step_ms, "identical_batches": same,
        "runs": [{k: v for k, v in run.items() if k != "batches"} for run in runs]})


if __name__ == "__main__":
    main()
