"""How much a pass's CPU time costs on the CPU engine: vLLM's own scheduler with a busy
wait in every ``schedule()``, beside FCFS and Feather.

    .venv/bin/python benchmarks/traces/sched_delay.py [--delay-ms 0.2] [--rounds 3] [--set NAME]

Mooncake as ``mooncake-moderate.sh`` replays it (``step_phases.MOONCAKE``: the trace's
last 1,000 requests, hash blocks of 32 tokens, sped up 2.6x) on vLLM 0.32.0's CPU engine
(the embedded model, in vLLM's default multi-process mode), alternating ``fcfs``,
``fcfs-delayed`` and ``feather-model`` for ``rounds`` rounds, each run a fresh engine.
``fcfs-delayed`` is
the FCFS baseline (``InstrumentedScheduler``) with a busy wait of ``delay-ms`` before
each ``schedule()``: the same decisions, only more time on the engine core per pass, so
what it changes against ``fcfs`` is what that much scheduler time costs at this load,
whoever spends it.  Writes ``sched-delay.json`` and ``sched-delay.txt`` into the run set's
folder, ``results/NAME/`` (default: ``cpu-<commit>``); ``benchmarks/vllm/medians.py`` gives
the medians and per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from step_phases import MOONCAKE

from feather_sched.bench.study import Study, commit
from feather_sched.integrations.vllm.scheduler import (
    InstrumentedScheduler,
    InstrumentedSyncScheduler,
)

HERE = Path(__file__).resolve().parent
DELAYED = "fcfs-delayed"
DELAY_ENV = "FEATHER_BENCH_SCHEDULE_DELAY_S"
"""The busy wait, in seconds, handed to the engine-core process through its environment."""


def _busy_wait() -> None:
    until = time.perf_counter() + float(os.environ.get(DELAY_ENV, "0"))
    while time.perf_counter() < until:
        pass


class _Delayed:
    """Busy for the delay, then the scheduler's own pass."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        _busy_wait()
        return super().schedule(*args, **kwargs)


class DelayedSyncScheduler(_Delayed, InstrumentedSyncScheduler):
    """The FCFS baseline, synchronous (the CPU engine), busy for the delay first."""


class DelayedScheduler(_Delayed, InstrumentedScheduler):
    """The FCFS baseline busy for the delay before each pass (``sync_variant`` on CPU)."""

    sync_variant = DelayedSyncScheduler


def _spec_with_delayed(original: Any) -> Any:
    """``offline._spec`` that also knows ``fcfs-delayed`` (vLLM's attention, like fcfs)."""
    from feather_sched.bench import offline

    def spec(name: str, label: str, options: dict, classes: int) -> Any:
        if name == DELAYED:
            return offline.SchedulerSpec(label, f"sched_delay.{DelayedScheduler.__name__}",
                                         {"shared_prefix_attention": "off"})
        return original(name, label, options, classes)

    return spec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay-ms", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", help="run set: results/SET/ (default: cpu-<commit>)")
    args = parser.parse_args()
    if not args.delay_ms > 0 or args.rounds < 1:
        parser.error("--delay-ms must be > 0 and --rounds >= 1")
    from rich.console import Console

    from feather_sched.bench import offline
    from feather_sched.bench.serving import BenchPlan, bench_config, run_bench, save_outputs
    from feather_sched.workloads.options import WorkloadArgs

    os.environ[DELAY_ENV] = str(args.delay_ms / 1000)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))  # the engine core imports it
    offline._spec = _spec_with_delayed(offline._spec)
    workload = WorkloadArgs(trace=MOONCAKE["path"], start=MOONCAKE["start"],
                            max_requests=1000, token_scale=MOONCAKE["token_scale"],
                            trace_speed=MOONCAKE["speed"]).build()
    plan = BenchPlan(workload, schedulers=["fcfs", DELAYED, "feather-model"] * args.rounds,
                     engine_args=MOONCAKE["engine_args"])
    console = Console(record=True, width=150)
    runs, _ = run_bench(plan, console)
    config = bench_config(plan) | {"delay_ms": args.delay_ms}
    study = Study(__file__, set_name=args.set or f"cpu-{commit()}")
    save_outputs(runs, config | {"command": study.command}, study.path("sched-delay.json"),
                 None)
    study.path("sched-delay.txt").write_text(console.export_text())


if __name__ == "__main__":
    main()
