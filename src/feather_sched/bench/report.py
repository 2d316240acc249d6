"""Turn benchmark runs into text, tables, JSON and plots: vLLM's "Serving Benchmark Result"
block with Feather's lines, the ratio table, the JSON a run writes, and ``feather report``
over saved runs.  The figures come from ``results.summary``."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.table import Table

from feather_sched.results.records import RunResult
from feather_sched.results.summary import GATE_KEYS, LATENCIES, Summary, chunk_gaps

WIDTH = 50
LINE = "{:<40} {:<10}"
NUMBER = "{:<40} {:<10.2f}"

RATIO_COLUMNS = (
    ("request_throughput", "Req/s"),
    ("output_throughput", "Output tok/s"),
    ("total_token_throughput", "Total tok/s"),
    ("mean_ttft_ms", "Mean TTFT ms"),
    ("p99_ttft_ms", "P99 TTFT ms"),
    ("mean_tpot_ms", "Mean TPOT ms"),
    ("mean_e2el_ms", "Mean E2EL ms"),
)
PREEMPTED = "Preempted (total / max / recomputed tok)"
"""The comparison table's preemption column, after ``PREEMPTED_AFTER``'s: beside TTFT, so
a thrash shows in every scheduler's row."""
PREEMPTED_AFTER = "p99_ttft_ms"


# ---- text block -------------------------------------------------------------------------


def format_result_block(run: RunResult, summary: Summary) -> str:
    """vLLM's result block for ``summary``, then a Feather section naming the scheduler."""
    lines = [_title(" Serving Benchmark Result ", "="), *_header_lines(run, summary)]
    for key, name, title in LATENCIES:
        lines.append(_title(title, "-"))
        lines.extend(_latency_lines(key, name, summary))
    lines.append(_title("TTFT per prefix group (mean / p99 ms)", "-"))
    lines.extend(_group_lines(summary))
    if summary["by_priority"] is not None:
        lines.append(_title("Per priority class (lower more urgent)", "-"))
        lines.extend(_priority_lines(summary))
    if summary.get("by_tenant") is not None:
        lines.append(_title("Per tenant", "-"))
        lines.extend(_tenant_lines(summary))
    if summary["preemptions_by_group"] and summary["preemptions"]:
        lines.append(_title("Preemptions per prefix group (total / max)", "-"))
        lines.extend(_preemption_lines(summary))
    lines.append(_title(" Feather ", "-"))
    lines.extend(_feather_lines(run, summary))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _title(text: str, fill: str) -> str:
    return "{s:{c}^{n}}".format(s=text, n=WIDTH, c=fill)


def _number(label: str, value: float | int | None) -> str:
    """A ``{:<10.2f}`` line as vLLM prints it, or ``n/a`` for a missing value."""
    return LINE.format(label, "n/a") if value is None else NUMBER.format(label, value)


def _header_lines(run: RunResult, summary: Summary) -> list[str]:
    lines = [
        LINE.format("Successful requests:", summary["completed"]),
        LINE.format("Failed requests:", summary["failed"]),
    ]
    if run.max_concurrency is not None:
        lines.append(LINE.format("Maximum request concurrency:", run.max_concurrency))
    if run.request_rate is not None and not math.isinf(run.request_rate):
        lines.append(NUMBER.format("Request rate configured (RPS):", run.request_rate))
    return [
        *lines,
        _number("Benchmark duration (s):", summary["duration"]),
        LINE.format("Total input tokens:", summary["total_input_tokens"]),
        LINE.format("Total generated tokens:", summary["total_output_tokens"]),
        _number("Request throughput (req/s):", summary["request_throughput"]),
        _number("Output token throughput (tok/s):", summary["output_throughput"]),
        _number("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]


def _latency_lines(key: str, name: str, summary: Summary) -> list[str]:
    """Mean, median and every percentile the summary holds for one metric."""
    lines = [
        _number(f"Mean {name} (ms):", summary[f"mean_{key}_ms"]),
        _number(f"Median {name} (ms):", summary[f"median_{key}_ms"]),
    ]
    pattern = re.compile(rf"p([0-9.]+)_{key}_ms")
    for summary_key, value in summary.items():
        if match := pattern.fullmatch(summary_key):
            lines.append(_number(f"P{match[1]} {name} (ms):", value))
    return lines


GROUP_LINES = 6
"""Groups printed in the block (the largest, then the worst); the JSON has them all."""


def _group_lines(summary: Summary) -> list[str]:
    groups: dict = summary["ttft_by_group"]  # type: ignore[assignment]
    shown = list(groups)[:GROUP_LINES]
    worst = max(groups, key=lambda g: groups[g]["mean_ttft_ms"], default=None)
    if worst is not None and worst not in shown:
        shown[-1] = worst
    lines = [LINE.format(f"Group {g} ({groups[g]['requests']} req):",
                         f"{groups[g]['mean_ttft_ms']:.2f} / {groups[g]['p99_ttft_ms']:.2f}")
             for g in shown]
    if len(groups) > len(shown):
        lines.append(LINE.format(f"({len(groups) - len(shown)} more groups)", ""))
    return [*lines,
            _number("Worst group mean TTFT (ms):", summary["worst_group_mean_ttft_ms"]),
            _number("Worst group P99 TTFT (ms):", summary["worst_group_p99_ttft_ms"]),
            _number("Cold requests P99 TTFT (ms):", summary.get("cold_p99_ttft_ms"))]


def _priority_lines(summary: Summary) -> list[str]:
    """The scheduling policy, then each class's counts, latencies and throughput."""
    policy = summary["scheduling_policy"]
    if policy == "fcfs":
        policy = "fcfs (priorities stripped to 0)"
    lines = [LINE.format("Scheduling policy:", policy or "n/a")]
    classes: dict = summary["by_priority"]  # type: ignore[assignment]
    for priority, c in classes.items():
        lines += _part_lines(f"Class {priority}", c)
    return lines


def _tenant_lines(summary: Summary) -> list[str]:
    """Each tenant's latencies, throughput and service, then the largest service gap."""
    lines = []
    for tenant, t in summary["by_tenant"].items():  # type: ignore[union-attr]
        lines += [*_part_lines(tenant, t),
                  _number(f"{tenant} service (weighted tokens):", t["service"])]
    return [*lines, _number("Largest service gap, all in (tokens):",
                            summary.get("max_service_gap"))]


def _part_lines(label: str, part: dict) -> list[str]:
    """One part of a run's requests (a class, a tenant): its count, TTFT and E2EL means and
    p99s, and output throughput."""
    return [LINE.format(f"{label} ({part['requests']} req) TTFT mean / p99 (ms):",
                        f"{part['mean_ttft_ms']:.2f} / {part['p99_ttft_ms']:.2f}"),
            LINE.format(f"{label} E2EL mean / p99 (ms):",
                        f"{part['mean_e2el_ms']:.2f} / {part['p99_e2el_ms']:.2f}"),
            _number(f"{label} output tok/s:", part["output_throughput"])]


def _preemption_lines(summary: Summary) -> list[str]:
    """The groups with the most preemptions (``GROUP_LINES`` of them)."""
    groups: dict = summary["preemptions_by_group"]  # type: ignore[assignment]
    ranked = sorted(groups, key=lambda g: -groups[g]["preemptions"])
    lines = [LINE.format(f"Group {g}:", f"{groups[g]['preemptions']} / "
                                        f"{groups[g]['max_per_request']}")
             for g in ranked[:GROUP_LINES]]
    if len(ranked) > GROUP_LINES:
        lines.append(LINE.format(f"({len(ranked) - GROUP_LINES} more groups)", ""))
    return lines


def _feather_lines(run: RunResult, summary: Summary) -> list[str]:
    rate = summary["prefix_cache_hit_rate"]
    gates = [summary[f"gate_{key}"] for key in GATE_KEYS]
    gate_text = "n/a" if all(g is None for g in gates) else " / ".join(map(_or_na, gates))
    return [
        LINE.format("Scheduler:", run.name),
        _number("Mean running batch size:", summary["mean_batch_size"]),
        _number("Prefix groups per step:", summary["mean_groups_per_step"]),
        _number("Prefix-cache hit rate (%):", None if rate is None else rate * 100),
        LINE.format("Gate ADD / STOP / forced:", gate_text),
        LINE.format("Preempted (total / max / recomp. tok):", preempted_text(summary)),
        LINE.format("Of them, for a more urgent request:", _or_na(summary["urgent_preemptions"])),
        _number("Scheduler time per step (ms):", summary["schedule_ms_per_call"]),
        _number("Engine step time (ms):", summary["engine_step_ms"]),
        *(_number(f"{key.replace('_', ' ').capitalize()}:", summary[key]) for key in run.extra),
    ]


def _or_na(value: float | int | None) -> str:
    return "n/a" if value is None else str(value)


def preempted_text(summary: Summary) -> str:
    """``total / max / recomputed`` of a run's preemptions (``n/a`` where unobserved; a
    summary saved before ``recomputed_tokens`` existed reads ``n/a``)."""
    recomputed = summary.get("recomputed_tokens")
    return " / ".join([_or_na(summary.get("preemptions")),
                     _or_na(summary.get("max_preemptions_per_request")),
                     "n/a" if recomputed is None else f"{recomputed:,}"])


# ---- comparison table -------------------------------------------------------------------


def format_ratio_table(summaries: dict[str, Summary], baseline: str) -> Table:
    """One row per scheduler: each metric's value and its ratio value / baseline value,
    and beside TTFT its preemptions (``PREEMPTED``, no ratio)."""
    if baseline not in summaries:
        raise KeyError(f"baseline {baseline!r} is not among {sorted(summaries)}")
    table = Table(title=f"Schedulers against {baseline} (ratio = value / {baseline})")
    table.add_column("Scheduler", no_wrap=True)  # a name cut short reads as another
    for key, label in RATIO_COLUMNS:
        table.add_column(f"{label} (x vs {baseline})", justify="right")
        if key == PREEMPTED_AFTER:  # its own line breaks, each figure on one line
            table.add_column(PREEMPTED.replace(" (", "\n(").replace("max / ", "max /\n"),
                             justify="right", no_wrap=True)
    base = summaries[baseline]
    for name, summary in summaries.items():
        cells = []
        for key, _ in RATIO_COLUMNS:
            cells.append(_ratio_cell(summary.get(key), base.get(key)))
            if key == PREEMPTED_AFTER:
                cells.append(preempted_text(summary))
        table.add_row(name, *cells)
    return table


def _ratio_cell(value: float | int | None, base: float | int | None) -> str:
    """``value (ratio x)``; ``n/a`` parts where a value is missing or the base is 0."""
    if value is None:
        return "n/a"
    ratio = f"{value / base:.2f}x" if base else "n/a"
    return f"{value:.2f} ({ratio})"


# ---- files ------------------------------------------------------------------------------


def write_json(
    path: str | Path,
    runs: list[RunResult],
    summaries: dict[str, Summary],
    extra: dict,
    detailed: bool = False,
) -> None:
    """Write ``{"runs": {name: summary}, "config": extra}`` in run order, making parents.

    ``summaries`` must hold exactly the runs' names, so no run is dropped or invented;
    values JSON cannot hold (paths, enums) in ``extra`` are written as strings.  With
    ``detailed`` each run also carries its per-request arrays (``details``).
    """
    names = [run.name for run in runs]
    if set(names) != set(summaries) or len(set(names)) != len(names):
        raise ValueError(f"runs {names} and summaries {sorted(summaries)} do not match")
    document = {"runs": {run.name: {**summaries[run.name], **(details(run) if detailed else {})}
                         for run in runs}, "config": extra}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2, default=str) + "\n")


def details(run: RunResult) -> dict[str, list]:
    """Per-request arrays as ``vllm bench serve --save-detailed`` writes them (seconds;
    ``itls`` one list of chunk gaps per request), plus each request's id, group, priority
    class and preemptions (None where unobserved)."""
    records = run.records
    return {
        "request_ids": [r.request_id for r in records],
        "groups": [r.group for r in records],
        "priorities": [r.priority for r in records],
        "preemptions": [r.preemptions for r in records],
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_len for r in records],
        "ttfts": [r.ttft_s if r.success else 0.0 for r in records],
        "itls": [chunk_gaps(r.token_times_s) for r in records],
        "errors": [r.error for r in records],
    }


def plot(summaries: dict[str, Summary], path: str | Path) -> None:
    """Throughput and latency bars per scheduler in one figure, saved by ``path``'s suffix.

    Uses the Agg canvas directly (no pyplot, no display, no global backend switch);
    matplotlib is imported here so the rest of the module works without it.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    throughput, latency = fig.subplots(1, 2)
    names = list(summaries)
    _grouped_bars(throughput, names, summaries,
                  {"Output tok/s": "output_throughput", "Total tok/s": "total_token_throughput"},
                  ylabel="tokens / s", title="Token throughput")
    _grouped_bars(latency, names, summaries,
                  {"Mean TTFT": "mean_ttft_ms", "P99 TTFT": "p99_ttft_ms",
                   "Mean TPOT": "mean_tpot_ms"},
                  ylabel="ms", title="Latency")
    fig.suptitle("Scheduler comparison")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def _grouped_bars(ax, names: list[str], summaries: dict[str, Summary],
                  series: dict[str, str], *, ylabel: str, title: str) -> None:
    """One group of bars per scheduler, one bar per series; missing values are left out."""
    width = 0.8 / len(series)
    positions = np.arange(len(names))
    for i, (label, key) in enumerate(series.items()):
        heights = [_or_nan(summaries[name].get(key)) for name in names]
        ax.bar(positions + (i - (len(series) - 1) / 2) * width, heights, width, label=label)
    ax.set_xticks(positions, names)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()


def _or_nan(value: float | int | None) -> float:
    return math.nan if value is None else float(value)


# ---- saved results: feather report ---------------------------------------------------


def load_runs(paths: Sequence[str | Path]) -> dict[str, Summary]:
    """Every run of ``--json`` result files, labelled ``file:run`` when several files."""
    runs: dict[str, Summary] = {}
    for path in paths:
        document = json.loads(Path(path).read_text())
        if not isinstance(document, dict) or not isinstance(document.get("runs"), dict):
            raise ValueError(f"{path}: not a feather bench or feather sim --json file")
        for name, summary in document["runs"].items():
            runs[f"{Path(path).stem}:{name}" if len(paths) > 1 else name] = summary
    return runs


def report_markdown(runs: dict[str, Summary]) -> str:
    """Per run: throughput, TTFT, preemptions (``PREEMPTED``) and TPOT; then TTFT per
    prefix group; then, where runs have several priority classes, each class's TTFT, E2E
    latency and throughput."""
    lines = [f"| run | out tok/s | mean TTFT ms | p99 TTFT ms | {PREEMPTED.lower()} | "
             "mean TPOT ms | worst group mean / p99 TTFT ms |", "|---" * 7 + "|"]
    for name, s in runs.items():
        lines.append(f"| {name} | {_fmt(s.get('output_throughput'))} | "
                     f"{_fmt(s.get('mean_ttft_ms'))} | {_fmt(s.get('p99_ttft_ms'))} | "
                     f"{preempted_text(s)} | "
                     f"{_fmt(s.get('mean_tpot_ms'))} | {_fmt(s.get('worst_group_mean_ttft_ms'))}"
                     f" / {_fmt(s.get('worst_group_p99_ttft_ms'))} |")
    lines += ["", "| run | group | requests | mean TTFT ms | p99 TTFT ms |",
              "|---|---|---|---|---|"]
    for name, s in runs.items():
        for group, g in (s.get("ttft_by_group") or {}).items():
            lines.append(f"| {name} | {group} | {g['requests']} | {g['mean_ttft_ms']:.1f} | "
                         f"{g['p99_ttft_ms']:.1f} |")
    if any(s.get("by_priority") for s in runs.values()):
        lines += ["", "| run | priority class | requests | mean / p99 TTFT ms | mean / p99 "
                  "E2EL ms | out tok/s |", "|---|---|---|---|---|---|"]
        for name, s in runs.items():
            for priority, c in (s.get("by_priority") or {}).items():
                lines.append(f"| {name} | {priority} | {c['requests']} | "
                             f"{_fmt(c['mean_ttft_ms'])} / {_fmt(c['p99_ttft_ms'])} | "
                             f"{_fmt(c['mean_e2el_ms'])} / {_fmt(c['p99_e2el_ms'])} | "
                             f"{_fmt(c['output_throughput'])} |")
    if any(s.get("by_tenant") for s in runs.values()):
        lines += ["", "| run | tenant | requests | mean / p99 TTFT ms | mean / p99 E2EL ms | "
                  "out tok/s | service | largest service gap |", "|---" * 8 + "|"]
        for name, s in runs.items():
            for tenant, t in (s.get("by_tenant") or {}).items():
                lines.append(f"| {name} | {tenant} | {t['requests']} | "
                             f"{_fmt(t['mean_ttft_ms'])} / {_fmt(t['p99_ttft_ms'])} | "
                             f"{_fmt(t['mean_e2el_ms'])} / {_fmt(t['p99_e2el_ms'])} | "
                             f"{_fmt(t['output_throughput'])} | {_fmt(t['service'])} | "
                             f"{_fmt(s.get('max_service_gap'))} |")
    return "\n".join(lines) + "\n"


def report_plot(runs: dict[str, Summary], path: str | Path) -> None:
    """Throughput, TTFT, TPOT per run, and mean TTFT per prefix group, in one figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    throughput, latency, groups = fig.subplots(1, 3)
    names = list(runs)
    _grouped_bars(throughput, names, runs, {"Output tok/s": "output_throughput"},
                  ylabel="tokens / s", title="Throughput")
    _grouped_bars(latency, names, runs, {"Mean TTFT": "mean_ttft_ms", "P99 TTFT": "p99_ttft_ms",
                                         "Mean TPOT": "mean_tpot_ms"},
                  ylabel="ms", title="Latency")
    by_group = {name: {f"group {g}": v["mean_ttft_ms"]
                       for g, v in (s.get("ttft_by_group") or {}).items()}
                for name, s in runs.items()}
    series = {label: label for label in dict.fromkeys(k for v in by_group.values() for k in v)}
    if series:
        _grouped_bars(groups, names, by_group, series, ylabel="ms",
                      title="Mean TTFT per prefix group")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def _fmt(value: float | int | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
