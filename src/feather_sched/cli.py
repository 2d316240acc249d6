"""The ``feather`` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="Feather: prefix-aware request scheduling for vLLM and SGLang.",
    no_args_is_help=True,
    add_completion=False,
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
    from feather_sched.bench.cht_bench import Scenario, result_rows, run_bench
    from feather_sched.bench.sglang_policy import sglang_available

    names = [s.strip() for s in structures.split(",") if s.strip()]
    missing_sglang = sglang_available()
    if missing_sglang and any(n.startswith("sglang-") for n in names):
        console.print(f"[yellow]skipping sglang-*: {missing_sglang}[/]")
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


@app.command()
def bench(
    workload: Annotated[str, typer.Option(help="shared-prefix, long-docs, chat, no-sharing.")]
    = "shared-prefix",
    trace: Annotated[Path | None, typer.Option(help="Replay a JSONL or Mooncake trace.")] = None,
    groups: Annotated[int, typer.Option(min=1, help="Prefix groups (docs, chats).")] = 4,
    prompts_per_group: Annotated[int, typer.Option(min=1, help="Requests a group.")] = 16,
    prefix_len: Annotated[int, typer.Option(min=1, help="Shared prefix tokens.")] = 8192,
    suffix_len: Annotated[int, typer.Option(min=1, help="Unique suffix tokens.")] = 32,
    output_len: Annotated[int, typer.Option(min=1, help="Output tokens a request.")] = 64,
    jitter: Annotated[float, typer.Option(help="Relative length jitter.")] = 0.0,
    order: Annotated[str, typer.Option(help="Arrival order: shuffled or grouped.")]
    = "shuffled",
    request_rate: Annotated[float | None, typer.Option(help="Poisson rate (req/s); "
                                                       "default: all at once.")] = None,
    burstiness: Annotated[float, typer.Option(help="1 = Poisson; other: bursty.")] = 1.0,
    max_concurrency: Annotated[int | None, typer.Option(help="Server mode cap.")] = None,
    schedulers: Annotated[str, typer.Option(help="fcfs, fcfs-nocache, feather-<always|"
                                            "chunk-loss|bandit>[-noorder].")]
    = "fcfs,feather-chunk-loss",
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
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")]
    = None,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="Draw a chart here.")]
    = None,
) -> None:
    """Feather vs the engine's own scheduler on the real vLLM engine (or any server)."""
    from feather_sched.bench.serving import BenchPlan, WorkloadArgs, run_bench, save_outputs
    from feather_sched.models import TINY_LLAMA

    try:
        built = WorkloadArgs(
            kind=workload, trace=trace, groups=groups, prompts_per_group=prompts_per_group,
            prefix_len=prefix_len, suffix_len=suffix_len, output_len=output_len,
            jitter=jitter, order=order, request_rate=request_rate, burstiness=burstiness,
            seed=seed).build()
        plan = BenchPlan(
            workload=built, schedulers=[s.strip() for s in schedulers.split(",") if s.strip()],
            feather_options=_json_option(feather_options, "--feather-options"),
            model=model or str(TINY_LLAMA), engine_args=_engine_args(engine_arg or []),
            kv_cache_gib=kv_cache_gib, base_url=base_url, label=label,
            max_concurrency=max_concurrency, request_rate=request_rate)
        if not base_url:
            from feather_sched.bench.offline import scheduler_specs

            scheduler_specs(plan.schedulers, plan.feather_options)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    runs, summaries = run_bench(plan, console)
    save_outputs(plan, runs, summaries, json_path, plot_path)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(help="Model dir or name (default: the embedded "
                                              "tiny Llama with random weights).")] = None,
    gate: Annotated[str | None, typer.Option(help="always, chunk-loss or bandit.")] = None,
    feather_options: Annotated[str, typer.Option(help="JSON Feather options.")] = "{}",
    kv_cache_gib: Annotated[float, typer.Option(help="CPU KV cache (sets "
                                                "VLLM_CPU_KVCACHE_SPACE if unset).")] = 4.0,
    dry_run: Annotated[bool, typer.Option(help="Print the command, do not run it.")] = False,
) -> None:
    """vLLM's OpenAI-compatible server with the Feather scheduler; other args pass through."""
    import os
    import shlex

    from feather_sched.serve import vllm_server_command

    options = _json_option(feather_options, "--feather-options")
    if gate:
        options["gate"] = gate
    try:
        command = vllm_server_command(model, options, list(ctx.args))
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
    if dry_run:
        console.print(shlex.join(command), highlight=False)
        return
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    app()
