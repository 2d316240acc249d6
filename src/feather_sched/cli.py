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
