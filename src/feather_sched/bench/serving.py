"""``feather bench``: one workload, several schedulers, vLLM's metrics side by side.

Offline mode builds a fresh real vLLM engine per scheduler (``offline.run_offline``);
server mode measures whatever OpenAI-compatible server is at ``base_url`` (vLLM's or
SGLang's) with the async client.  Either way each run prints vLLM's "Serving Benchmark
Result" block plus Feather's lines, then a table of ratios against the first scheduler.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from feather_sched.bench.report import format_ratio_table, format_result_block, plot, write_json
from feather_sched.models import TINY_LLAMA
from feather_sched.results.records import RequestRecord, RunResult
from feather_sched.results.summary import VLLM_PERCENTILES, Percentiles, summarize
from feather_sched.workloads.spec import Workload

KV_BLOCK_TOKENS = 128


@dataclass
class BenchPlan:
    workload: Workload
    schedulers: list[str] = field(default_factory=lambda: ["fcfs", "feather-bandit"])
    feather_options: dict[str, Any] = field(default_factory=dict)
    model: str = str(TINY_LLAMA)
    engine_args: dict[str, Any] = field(default_factory=dict)
    kv_cache_gib: float = 4.0
    base_url: str | None = None
    label: str = "server"
    max_concurrency: int | None = None
    request_rate: float | None = None
    api: str = "openai"
    routing_keys: bool = False
    """Server mode: send each request's prefix group as SGLang's routing key."""
    percentiles: Percentiles = field(default_factory=Percentiles)


Runner = Callable[[Callable[[RequestRecord], None]], RunResult]
"""Runs one scheduler, calling its argument for every finished request."""


def run_bench(plan: BenchPlan, console: Console) -> tuple[list[RunResult], dict[str, dict]]:
    """Run every scheduler (or the server once), print each result and the ratios."""
    runs = report_runs(_runners(plan), plan.workload, console, plan.percentiles)
    for run in runs:
        run.request_rate, run.max_concurrency = plan.request_rate, plan.max_concurrency
    return runs, {run.name: summarize(run, plan.percentiles) for run in runs}


def report_runs(runners: list[tuple[str, Runner]], workload: Workload, console: Console,
                percentiles: Percentiles = VLLM_PERCENTILES) -> list[RunResult]:
    """Each run under a progress bar, its vLLM-style block, then the ratio table."""
    runs = []
    for name, runner in runners:
        with _progress(console, f"{name}: {workload.describe()}", len(workload)) as advance:
            run = runner(advance)
        runs.append(run)
        console.print(format_result_block(run, summarize(run, percentiles)), highlight=False)
    if len(runs) > 1:
        summaries = {run.name: summarize(run, percentiles) for run in runs}
        console.print(format_ratio_table(summaries, baseline=runs[0].name))
    return runs


def save_outputs(runs: list[RunResult], config: dict[str, Any], json_path: Path | None,
                 plot_path: Path | None, detailed: bool = False,
                 percentiles: Percentiles = VLLM_PERCENTILES) -> None:
    summaries = {run.name: summarize(run, percentiles) for run in runs}
    if json_path:
        write_json(json_path, runs, summaries, config, detailed=detailed)
    if plot_path:
        plot(summaries, plot_path)


def bench_config(plan: BenchPlan) -> dict[str, Any]:
    return {"workload": plan.workload.describe(), "schedulers": plan.schedulers,
            "model": plan.model, "engine_args": plan.engine_args,
            "feather_options": plan.feather_options, "base_url": plan.base_url,
            **({"routing_keys": True} if plan.routing_keys else {})}


def _runners(plan: BenchPlan) -> list[tuple[str, Runner]]:
    if plan.base_url:
        return [(plan.label, lambda advance: _server_run(plan, advance))]
    from feather_sched.bench.offline import run_offline, scheduler_specs

    engine_args = {**_default_engine_args(plan), **plan.engine_args}
    return [
        (spec.name, lambda advance, spec=spec: run_offline(
            plan.workload, spec, model=plan.model, engine_args=engine_args, on_done=advance))
        for spec in scheduler_specs(plan.schedulers, plan.feather_options,
                                    len(plan.workload.priority_classes))
    ]


def _default_engine_args(plan: BenchPlan) -> dict[str, Any]:
    """Room for the longest request and a KV cache of ``kv_cache_gib``."""
    longest = max(len(r.prompt) + r.output_len for r in plan.workload.requests)
    blocks = -(-longest // KV_BLOCK_TOKENS) + 1
    return {"max_model_len": blocks * KV_BLOCK_TOKENS,
            "kv_cache_memory_bytes": int(plan.kv_cache_gib * 2**30)}


def _server_run(plan: BenchPlan, advance: Callable[[RequestRecord], None]) -> RunResult:
    """The server's run; its preemptions are the rise of the server's counter over the run
    (None where it has none)."""
    from feather_sched.bench.client import run_against_server, server_preemptions

    base_url = plan.base_url
    assert base_url is not None

    async def measure() -> RunResult:
        before = await server_preemptions(base_url)
        records, duration = await run_against_server(
            plan.workload, base_url=base_url, max_concurrency=plan.max_concurrency,
            on_done=advance, api=plan.api, routing_keys=plan.routing_keys)
        after = await server_preemptions(base_url)
        preemptions = None if before is None or after is None else round(after - before)
        return RunResult(name=plan.label, records=records, duration_s=duration,
                         preemptions=preemptions)

    return asyncio.run(measure())


@contextmanager
def _progress(console: Console, title: str, total: int) -> Iterator[Callable]:
    """A progress bar over finished requests; yields the callback that advances it."""
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(title, total=total)
        yield lambda _record: bar.advance(task)
