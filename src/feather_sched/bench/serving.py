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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from feather_sched.bench.records import RequestRecord
from feather_sched.bench.report import (
    VLLM_PERCENTILES,
    Percentiles,
    RunResult,
    format_ratio_table,
    format_result_block,
    plot,
    summarize,
    write_json,
)
from feather_sched.datasets import load_dataset
from feather_sched.models import TINY_LLAMA
from feather_sched.workloads import (
    ArrivalSpec,
    Replay,
    Workload,
    load_jsonl,
    load_mooncake,
    long_documents,
    minority_groups,
    multi_turn_chat,
    no_sharing,
    prioritized,
    shared_prefix_groups,
)

WORKLOADS = ("shared-prefix", "minority", "long-docs", "chat", "no-sharing")
KV_BLOCK_TOKENS = 128


@dataclass
class WorkloadArgs:
    """The generator knobs ``feather bench`` and ``feather sim`` expose."""

    kind: str = "shared-prefix"
    trace: Path | None = None
    groups: int = 4
    prompts_per_group: int = 16
    prefix_len: int = 8192
    suffix_len: int = 32
    output_len: int = 64
    jitter: float = 0.0
    order: str = "shuffled"
    request_rate: float | None = None
    burstiness: float = 1.0
    minority_size: int = 20
    """``minority``: requests of each small group (``groups - 1`` of them; the majority
    has ``prompts_per_group``)."""
    high_priority_share: float = 0.0
    """In [0, 1]: a seeded random share of the requests in priority class 0 and the rest
    in class 1 (``workloads.prioritized``); 0 keeps the workload's own classes (a trace's,
    else one class)."""
    seed: int = 0
    dataset_name: str | None = None
    """Real prompts (``datasets.DATASETS``) instead of a generator; they arrive at
    ``request_rate`` (Poisson), else all at once."""
    dataset_path: Path | None = None
    tokenizer: str | Path | None = None
    """The dataset's tokenizer (``datasets.load_tokenizer``)."""
    start: int = 0
    max_requests: int | None = None
    trace_speed: float = 1.0
    token_scale: float = 1.0
    dataset_output_len: int | None = None
    """Every output length of a trace or dataset (None: their own)."""

    def build(self) -> Workload:
        """The workload (ValueError for a bad knob)."""
        workload = self._generate()
        if self.dataset_output_len is not None:
            workload = Workload(workload.name, [replace(r, output_len=self.dataset_output_len)
                                                for r in workload])
        if self.high_priority_share == 0:
            return workload
        return prioritized(workload, self.high_priority_share, seed=self.seed)

    def _generate(self) -> Workload:
        replay = Replay(self.start, self.max_requests, self.trace_speed, self.token_scale)
        if self.trace is not None and self.dataset_name is not None:
            raise ValueError("give a trace or a dataset name, not both")
        if self.trace is not None:
            return load_trace(self.trace, replay)
        if self.dataset_name is not None:
            if replay.speed != 1 or replay.token_scale != 1:
                raise ValueError("trace speed and token scale are for traces; a dataset "
                                 "arrives at the request rate")
            return load_dataset(self.dataset_name, path=self.dataset_path,
                                tokenizer=self.tokenizer, start=self.start,
                                max_requests=self.max_requests,
                                arrival=self._arrival(), seed=self.seed)
        if replay != Replay() or self.dataset_path or self.dataset_output_len:
            raise ValueError("start, max requests, trace speed, token scale, dataset path and "
                             "dataset output length are for traces and datasets")
        arrival = self._arrival()
        common = {"output_len": self.output_len, "arrival": arrival, "seed": self.seed}
        if self.kind == "shared-prefix":
            return shared_prefix_groups(
                groups=self.groups, prompts_per_group=self.prompts_per_group,
                prefix_len=self.prefix_len, suffix_len=self.suffix_len, jitter=self.jitter,
                order=self.order, **common)
        if self.kind == "minority":
            return minority_groups(
                majority=self.prompts_per_group,
                minorities=[self.minority_size] * max(1, self.groups - 1),
                prefix_len=self.prefix_len, suffix_len=self.suffix_len, **common)
        if self.kind == "long-docs":
            return long_documents(
                documents=self.groups, questions_per_document=self.prompts_per_group,
                doc_len_range=(self.prefix_len, 2 * self.prefix_len), order=self.order,
                **common)
        if self.kind == "chat":
            return multi_turn_chat(
                conversations=self.groups, turns=self.prompts_per_group,
                system_prompt_len=self.prefix_len, user_turn_len=self.suffix_len,
                assistant_turn_len=self.output_len, **common)
        if self.kind == "no-sharing":
            return no_sharing(requests=self.groups * self.prompts_per_group,
                              prompt_len=self.prefix_len + self.suffix_len,
                              jitter=self.jitter, **common)
        raise ValueError(f"unknown workload {self.kind!r}; choose from {', '.join(WORKLOADS)}")

    def _arrival(self) -> ArrivalSpec | None:
        if self.request_rate is None:
            return None
        kind = "poisson" if self.burstiness == 1.0 else "bursty"
        return ArrivalSpec(kind=kind, rate=self.request_rate)


def load_trace(path: Path, replay: Replay | None = None) -> Workload:
    """A feather JSONL trace, or a Mooncake trace (recognised by its first line), with
    ``replay``'s window, speed and (Mooncake only) token scale."""
    replay = replay or Replay()
    with open(path) as handle:
        first = handle.readline()
    if '"hash_ids"' in first:
        return load_mooncake(path, replay=replay)
    return replay.apply(load_jsonl(path))


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
            "feather_options": plan.feather_options, "base_url": plan.base_url}


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
            on_done=advance, api=plan.api)
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
