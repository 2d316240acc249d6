"""Turn benchmark runs into vLLM-comparable numbers: summaries, text block, table, JSON, plot.

Metrics follow ``vllm bench serve`` (``vllm/benchmarks/serve.py``: ``calculate_metrics``
and the result dict) key for key, so a Feather run reads side by side with a vLLM one:
only successful requests count; TPOT is ``(e2el - ttft) / (output_len - 1)`` for
requests with more than one token; ITL holds one gap per streamed chunk, so ``k``
tokens that arrive together give one gap (what vLLM's client records); an empty sample
counts as 0 as in vLLM.  Our own keys (TTFT per prefix group, preemptions per run and per
group, figures per priority class, batch size, prefix groups, cache hit rate, gate counts)
come after vLLM's and are ``None`` when the run did not observe them.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import groupby, pairwise
from pathlib import Path

import numpy as np
from rich.table import Table

from feather_sched.bench.records import RequestRecord, StepRecord
from feather_sched.stats import SchedulerStats
from feather_sched.workloads import Workload

Summary = dict[str, float | int | None]

WIDTH = 50
LINE = "{:<40} {:<10}"
NUMBER = "{:<40} {:<10.2f}"

LATENCIES = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
"""vLLM's latency metrics: summary key stem, printed name, section title."""

GATE_KEYS = ("add", "stop", "forced")


@dataclass(frozen=True)
class Percentiles:
    """Which latencies get percentiles, and which: ``vllm bench serve``'s
    ``--percentile-metrics`` (default ttft,tpot,itl) and ``--metric-percentiles`` (99)."""

    metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    values: tuple[float, ...] = (99.0,)

    @classmethod
    def parse(cls, metrics: str, values: str) -> Percentiles:
        """From vLLM's comma-separated flags; ValueError naming what is wrong."""
        names = tuple(m.strip() for m in metrics.split(",") if m.strip())
        known = [key for key, _, _ in LATENCIES]
        unknown = [m for m in names if m not in known]
        if unknown:
            raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {known}")
        try:
            numbers = tuple(float(v) for v in values.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"--metric-percentiles: not numbers: {values!r}") from None
        if not numbers or not all(0 < p < 100 for p in numbers):
            raise ValueError(f"--metric-percentiles: need values in (0, 100), got {values!r}")
        return cls(names, numbers)

RATIO_COLUMNS = (
    ("request_throughput", "Req/s"),
    ("output_throughput", "Output tok/s"),
    ("total_token_throughput", "Total tok/s"),
    ("mean_ttft_ms", "Mean TTFT ms"),
    ("p99_ttft_ms", "P99 TTFT ms"),
    ("mean_tpot_ms", "Mean TPOT ms"),
    ("mean_e2el_ms", "Mean E2EL ms"),
)


@dataclass
class RunResult:
    """One scheduler's benchmark run, as recorded, before any statistics."""

    name: str
    """Scheduler label, e.g. ``fcfs`` or ``feather-bandit``."""
    records: list[RequestRecord]
    duration_s: float
    steps: list[StepRecord] | None = None
    gate_counts: dict[str, int] | None = None
    """Keys ``add``, ``stop``, ``forced``."""
    prefix_cache_hit_rate: float | None = None
    """Engine-reported fraction; when None, derived from the records' ``cached_tokens``."""
    request_rate: float | None = None
    max_concurrency: int | None = None
    scheduler_stats: SchedulerStats | None = None
    """The engine-side scheduler's own accounting, when the run could read it."""
    extra: dict[str, float | None] = field(default_factory=dict)
    """Further figures only some runs have (e.g. the simulator's modelled HBM traffic)."""
    preemptions: int | None = None
    """The run's preemptions as the engine totals them (the scheduler's stats file, a
    server's ``/metrics``); the records' own counts take precedence when all have one."""
    scheduling_policy: str | None = None
    """The engine's policy when the run chose it: ``priority``, or ``fcfs`` (the requests'
    priorities then went to the engine as 0)."""


# ---- summary ----------------------------------------------------------------------------


VLLM_PERCENTILES = Percentiles()
"""vLLM's defaults."""


def summarize(run: RunResult, percentiles: Percentiles = VLLM_PERCENTILES) -> Summary:
    """vLLM's ``bench serve`` result keys for ``run``, then Feather's own keys."""
    ok = [r for r in run.records if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    summary: Summary = {
        "duration": run.duration_s,
        "completed": len(ok),
        "failed": len(run.records) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": _per_second(len(ok), run.duration_s),
        "output_throughput": _per_second(output_tokens, run.duration_s),
        "total_token_throughput": _per_second(input_tokens + output_tokens, run.duration_s),
    }
    for key, values in _latency_samples(ok).items():
        wanted = percentiles.values if key in percentiles.metrics else ()
        summary.update(_latency_stats(key, values, wanted))
    summary.update(_group_keys(ok))
    summary.update(_preemption_keys(run))
    summary["scheduling_policy"] = run.scheduling_policy
    summary["by_priority"] = priority_classes(run, ok)
    summary.update(_feather_keys(run, ok))
    return summary


def median_and_range(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """Median and range of repeated runs' figures, e.g. ``1.12 (1.05-1.20)``; the value
    alone for one run.  ``fmt`` formats each number."""
    median = fmt.format(statistics.median(values))
    if len(values) == 1:
        return median
    return f"{median} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def prefill_over_floor(records: Sequence[RequestRecord], workload: Workload) -> float:
    """Prompt tokens an engine (or a set of replicas) computed for ``workload`` over the
    fewest it could: every group's shared prefix once (as the workload built it), every
    request's own tokens.  1.0 is the floor; what is above it is prefill that scheduling,
    routing or a bigger KV pool could still save.  O(records + requests)."""
    prefix = {spec.group: spec.shared_len for spec in workload.requests}
    computed = sum(r.prompt_len - (r.cached_tokens or 0) for r in records)
    members = Counter(r.group for r in records if r.group != -1)
    shared = sum((count - 1) * prefix[group] for group, count in members.items())
    return computed / (sum(r.prompt_len for r in records) - shared)


def group_ttfts(ok: list[RequestRecord]) -> dict[str, dict[str, float]]:
    """TTFT mean and p99 (ms) and the request count of each workload prefix group (key
    ``"-1"``: requests that share nothing), largest group first."""
    by_group = _by_group([r for r in ok if r.ttft_s is not None])
    return {group: {"requests": len(records),
                    **_mean_p99("ttft", [r.ttft_s or 0.0 for r in records])}
            for group, records in by_group.items()}


def _by_group(records: Iterable[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """Records per workload prefix group, largest group first (ties: lower group)."""
    by_group: dict[int, list[RequestRecord]] = {}
    for record in records:
        by_group.setdefault(record.group, []).append(record)
    ranked = sorted(by_group.items(), key=lambda item: (-len(item[1]), item[0]))
    return {str(group): members for group, members in ranked}


def _mean_p99(key: str, seconds: list[float]) -> dict[str, float]:
    """Mean and p99 of latencies in ms under vLLM's key names (an empty sample: 0)."""
    data = seconds or 0
    return {f"mean_{key}_ms": float(np.mean(data)) * 1000,
            f"p99_{key}_ms": float(np.percentile(data, 99)) * 1000}


def priority_classes(run: RunResult, ok: list[RequestRecord]) -> dict[str, dict] | None:
    """Per priority class of the workload (key: the class, most urgent first), when the
    run's requests are in several: requests completed, TTFT and E2E latency (mean and p99,
    ms), output tokens/s (the class's tokens over the run's duration) and preemptions
    (None where unobserved).  Classes are the workload's, whatever the run's scheduler
    made of them.  O(records)."""
    classes = sorted({r.priority for r in run.records})
    if len(classes) < 2:
        return None
    result = {}
    for priority in classes:
        mine = [r for r in ok if r.priority == priority]
        samples = _latency_samples(mine)
        counts = [r.preemptions for r in run.records if r.priority == priority]
        result[str(priority)] = {
            "requests": len(mine),
            **_mean_p99("ttft", samples["ttft"]),
            **_mean_p99("e2el", samples["e2el"]),
            "output_throughput": _per_second(sum(r.output_len for r in mine), run.duration_s),
            "preemptions": None if None in counts else sum(counts),  # type: ignore[arg-type]
        }
    return result


def _preemption_keys(run: RunResult) -> Summary:
    """Preemptions of the run and of each prefix group (total and the most any one
    request took), from the records where all have a count, else the run's total."""
    counts = [r.preemptions for r in run.records]
    if not counts or None in counts:
        return {"preemptions": run.preemptions, "max_preemptions_per_request": None,
                "preemptions_by_group": None}
    by_group = {group: [r.preemptions or 0 for r in records]
                for group, records in _by_group(run.records).items()}
    return {
        "preemptions": sum(c or 0 for c in counts),
        "max_preemptions_per_request": max(c or 0 for c in counts),
        "preemptions_by_group": {group: {"preemptions": sum(values),
                                         "max_per_request": max(values)}
                                 for group, values in by_group.items()},
    }


def worst_group_ratios(groups: dict[str, dict], baseline: dict[str, dict]) -> tuple[float, float]:
    """The largest ratio over groups of a run's TTFT to the same group's in ``baseline``
    (``ttft_by_group`` of both), for the mean and for p99."""
    mean = max(g["mean_ttft_ms"] / baseline[k]["mean_ttft_ms"] for k, g in groups.items())
    p99 = max(g["p99_ttft_ms"] / baseline[k]["p99_ttft_ms"] for k, g in groups.items())
    return mean, p99


def _group_keys(ok: list[RequestRecord]) -> Summary:
    """Per prefix group TTFT, and the worst group's: where starvation shows."""
    groups = group_ttfts(ok)
    worst_mean = max(groups, key=lambda g: groups[g]["mean_ttft_ms"], default=None)
    worst_p99 = max(groups, key=lambda g: groups[g]["p99_ttft_ms"], default=None)
    return {
        "worst_group_mean_ttft_ms": groups[worst_mean]["mean_ttft_ms"] if worst_mean else None,
        "worst_group_p99_ttft_ms": groups[worst_p99]["p99_ttft_ms"] if worst_p99 else None,
        "ttft_by_group": groups,
    }


def _per_second(count: int, duration_s: float) -> float | None:
    """A throughput; None when the run has no duration to divide by."""
    return count / duration_s if duration_s > 0 else None


def _latency_samples(ok: list[RequestRecord]) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT and E2EL and per-chunk ITL samples, in seconds."""
    samples: dict[str, list[float]] = {key: [] for key, _, _ in LATENCIES}
    for record in ok:
        e2el = _end_s(record) - record.submitted_s
        samples["e2el"].append(e2el)
        samples["itl"].extend(_chunk_gaps(record.token_times_s))
        ttft = record.ttft_s
        if ttft is None:
            continue
        samples["ttft"].append(ttft)
        if record.output_len > 1:
            samples["tpot"].append((e2el - ttft) / (record.output_len - 1))
    return samples


def _end_s(record: RequestRecord) -> float:
    """When the request finished; its last token (vLLM's end) if no finish was recorded."""
    if record.finished_s is not None:
        return record.finished_s
    return record.token_times_s[-1] if record.token_times_s else record.submitted_s


def _chunk_gaps(token_times_s: list[float]) -> list[float]:
    """Gaps between successive chunks: tokens sharing an arrival time are one chunk."""
    chunks = [t for t, _ in groupby(token_times_s)]
    return [b - a for a, b in pairwise(chunks)]


def _latency_stats(key: str, values: list[float], percentiles: Iterable[float]) -> Summary:
    """Mean, median, std and percentiles in ms, as vLLM names them (empty -> 0)."""
    data = values or 0
    stats: Summary = {
        f"mean_{key}_ms": float(np.mean(data)) * 1000,
        f"median_{key}_ms": float(np.median(data)) * 1000,
        f"std_{key}_ms": float(np.std(data)) * 1000,
    }
    for p in percentiles:
        stats[f"p{_percentile_word(p)}_{key}_ms"] = float(np.percentile(data, p)) * 1000
    return stats


def _percentile_word(p: float) -> str:
    """vLLM's spelling of a percentile: ``99`` for 99.0, ``99.9`` for 99.9."""
    return str(int(p)) if int(p) == p else str(p)


def _feather_keys(run: RunResult, ok: list[RequestRecord]) -> Summary:
    """Scheduler-side observations; None where the run did not record them."""
    steps = run.steps or []
    gates = run.gate_counts or {}
    stats = run.scheduler_stats
    return {
        "mean_batch_size": _mean([s.batch_size for s in steps]),
        "mean_groups_per_step": _mean([s.groups for s in steps]),
        "prefix_cache_hit_rate": _hit_rate(run, ok),
        **{f"gate_{key}": gates.get(key) for key in GATE_KEYS},
        "schedule_ms_per_call": stats.schedule_ms_per_call if stats else None,
        "engine_step_ms": stats.step_ms if stats else None,
        **run.extra,
    }


def _mean(values: list[int]) -> float | None:
    return float(np.mean(values)) if values else None


def _hit_rate(run: RunResult, ok: list[RequestRecord]) -> float | None:
    """The engine's hit rate, else cached / prompt tokens when every success reports it."""
    if run.prefix_cache_hit_rate is not None:
        return run.prefix_cache_hit_rate
    if not ok or any(r.cached_tokens is None for r in ok):
        return None
    prompt = sum(r.prompt_len for r in ok)
    return sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else None


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
            _number("Worst group P99 TTFT (ms):", summary["worst_group_p99_ttft_ms"])]


def _priority_lines(summary: Summary) -> list[str]:
    """The scheduling policy, then each class's counts, latencies and throughput."""
    policy = summary["scheduling_policy"]
    if policy == "fcfs":
        policy = "fcfs (priorities stripped to 0)"
    lines = [LINE.format("Scheduling policy:", policy or "n/a")]
    classes: dict = summary["by_priority"]  # type: ignore[assignment]
    for priority, c in classes.items():
        lines += [
            LINE.format(f"Class {priority} ({c['requests']} req) TTFT mean / p99 (ms):",
                        f"{c['mean_ttft_ms']:.2f} / {c['p99_ttft_ms']:.2f}"),
            LINE.format(f"Class {priority} E2EL mean / p99 (ms):",
                        f"{c['mean_e2el_ms']:.2f} / {c['p99_e2el_ms']:.2f}"),
            _number(f"Class {priority} output tok/s:", c["output_throughput"]),
        ]
    return lines


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
        LINE.format("Preemptions (total / max a request):",
                    f"{_or_na(summary['preemptions'])} / "
                    f"{_or_na(summary['max_preemptions_per_request'])}"),
        _number("Scheduler time per step (ms):", summary["schedule_ms_per_call"]),
        _number("Engine step time (ms):", summary["engine_step_ms"]),
        *(_number(f"{key.replace('_', ' ').capitalize()}:", summary[key]) for key in run.extra),
    ]


def _or_na(value: float | int | None) -> str:
    return "n/a" if value is None else str(value)


# ---- comparison table -------------------------------------------------------------------


def format_ratio_table(summaries: dict[str, Summary], baseline: str) -> Table:
    """One row per scheduler: each metric's value and its ratio value / baseline value."""
    if baseline not in summaries:
        raise KeyError(f"baseline {baseline!r} is not among {sorted(summaries)}")
    table = Table(title=f"Schedulers against {baseline} (ratio = value / {baseline})")
    table.add_column("Scheduler")
    for _, label in RATIO_COLUMNS:
        table.add_column(f"{label} (x vs {baseline})", justify="right")
    base = summaries[baseline]
    for name, summary in summaries.items():
        cells = [_ratio_cell(summary.get(key), base.get(key)) for key, _ in RATIO_COLUMNS]
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
        "itls": [_chunk_gaps(r.token_times_s) for r in records],
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
    """Per run: throughput, TTFT and TPOT; then TTFT per prefix group; then, where runs
    have several priority classes, each class's TTFT, E2E latency and throughput."""
    lines = ["| run | out tok/s | mean TTFT ms | p99 TTFT ms | mean TPOT ms | worst group "
             "mean / p99 TTFT ms |", "|---|---|---|---|---|---|"]
    for name, s in runs.items():
        lines.append(f"| {name} | {_fmt(s.get('output_throughput'))} | "
                     f"{_fmt(s.get('mean_ttft_ms'))} | {_fmt(s.get('p99_ttft_ms'))} | "
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
