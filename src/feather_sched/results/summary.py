"""A run's summary in vLLM's metrics: ``summarize`` and its parts, and the rounds statistic
(``median_and_range``).

Metrics follow ``vllm bench serve`` (``vllm/benchmarks/serve.py``: ``calculate_metrics``
and the result dict) key for key, so a Feather run reads side by side with a vLLM one:
only successful requests count; TPOT is ``(e2el - ttft) / (output_len - 1)`` for
requests with more than one token; ITL holds one gap per streamed chunk, so ``k``
tokens that arrive together give one gap (what vLLM's client records); an empty sample
counts as 0 as in vLLM.  Our own keys (TTFT per prefix group, preemptions per run and per
group and the tokens they recomputed, figures per priority class and per tenant with the
service each received and the largest service gap, batch size, prefix groups, cache hit
rate, gate counts) come after vLLM's and are ``None`` when the run did not observe them.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby, pairwise

import numpy as np

from feather_sched.core.tenants import INPUT_WEIGHT, OUTPUT_WEIGHT
from feather_sched.results.records import RequestRecord, RunResult
from feather_sched.workloads.spec import Workload

Summary = dict[str, float | int | None]

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
    summary["by_tenant"] = tenants(run, ok)
    summary["max_service_gap"] = service_gap(run)
    summary.update(_feather_keys(run, ok))
    if run.jobs:
        summary.update(job_figures(run.records))
    return summary


def job_figures(records: Sequence[RequestRecord]) -> Summary:
    """Per job (the records of one group: an agent program's turns), its job completion
    time: its first request's arrival to its last request's end, in seconds; a job with a
    failed request counts as failed.  TTFT (ms) of first turns and of later turns apart,
    and the mean TTFT of each turn by its index (``turn_ttft_ms``).  O(records)."""
    jobs = _by_group(records)
    done = {g: rs for g, rs in jobs.items() if all(r.success for r in rs)}
    jct = [max(_end_s(r) for r in rs) - min(r.submitted_s for r in rs) for rs in done.values()]
    turns: dict[int, list[float]] = {}
    for members in done.values():
        ordered = sorted(members, key=lambda r: r.submitted_s)
        for index, record in enumerate(ordered):
            if record.ttft_s is not None:
                turns.setdefault(index, []).append(record.ttft_s)
    later = [t for index, values in turns.items() if index for t in values]
    figures: Summary = {"jobs": len(jobs), "jobs_completed": len(done),
                        **_latency_stats("jct", jct, (90.0, 99.0), unit="s"),
                        **_latency_stats("first_turn_ttft", turns.get(0, []), (90.0,)),
                        **_latency_stats("later_turn_ttft", later, (90.0,))}
    figures["turn_ttft_ms"] = [float(np.mean(turns[i])) * 1000  # type: ignore[assignment]
                               for i in sorted(turns)]
    return figures


def median_and_range(values: Sequence[float], fmt: str | Callable[[float], str] = "{:.2f}",
                     unit: str = "", sep: str = "-") -> str:
    """Median and range of repeated runs' figures, e.g. ``1.12 (1.05-1.20)``; the value
    alone for one run.  ``fmt`` formats each number (a format string or a function),
    ``unit`` follows the median (``"x"``: ``1.12x (1.05-1.20)``), ``sep`` parts the range."""
    text = fmt.format if isinstance(fmt, str) else fmt
    median = text(statistics.median(values)) + unit
    if len(values) == 1:
        return median
    return f"{median} ({text(min(values))}{sep}{text(max(values))})"


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
    return {str(priority): _part_figures(run, ok, lambda r, p=priority: r.priority == p)
            for priority in classes}


def tenants(run: RunResult, ok: list[RequestRecord]) -> dict[str, dict] | None:
    """Per tenant of the workload (key: its name, in order), when the run's requests are
    of several: ``priority_classes``'s figures, and the service it received (VTC's
    weighted tokens: computed prompt tokens and generated ones; None where the engine
    did not report computed tokens).  O(records)."""
    names = sorted({r.tenant for r in run.records})
    if len(names) < 2:
        return None
    result = {}
    for name in names:
        figures = _part_figures(run, ok, lambda r, n=name: r.tenant == n)
        mine = [r for r in run.records if r.tenant == name]
        figures["service"] = None if any(r.computed_tokens is None for r in mine) else sum(
            map(_service, mine))
        result[name] = figures
    return result


def pool_tenants(by_tenant: dict[str, dict], prefix: str, label: str) -> dict[str, dict]:
    """``tenants``' figures with the tenants named ``prefix``... taken together as
    ``label`` (appended; none: unchanged): their requests, and their mean TTFT over all
    their requests.  For the tables of workloads of many light tenants.  O(tenants)."""
    pooled = {k: v for k, v in by_tenant.items() if k.startswith(prefix)}
    kept = {k: v for k, v in by_tenant.items() if k not in pooled}
    requests = sum(v["requests"] for v in pooled.values())
    if requests:
        kept[label] = {"requests": requests, "mean_ttft_ms": sum(
            v["requests"] * v["mean_ttft_ms"] for v in pooled.values()) / requests}
    return kept


def service_gap(run: RunResult) -> float | None:
    """The largest difference in service (``tenants``) between two tenants over the
    interval in which every tenant had a request in the engine (from the latest first
    arrival to the earliest last finish): a prompt's computed tokens count when its first
    token comes, each generated token when it comes.  None with one tenant, without
    computed tokens, or when the tenants were never in the engine together.
    O(records + tokens)."""
    by_tenant: dict[str, list[RequestRecord]] = {}
    for record in run.records:
        by_tenant.setdefault(record.tenant, []).append(record)
    if len(by_tenant) < 2 or any(r.computed_tokens is None for r in run.records):
        return None
    start = max(min(r.submitted_s for r in mine) for mine in by_tenant.values())
    end = min(max(_end_s(r) for r in mine) for mine in by_tenant.values())
    if end <= start:
        return None
    received = [sum(_service(r, start, end) for r in mine) for mine in by_tenant.values()]
    return max(received) - min(received)


def _service(record: RequestRecord, start: float = -math.inf, end: float = math.inf
             ) -> float:
    """A request's service (``TenantShare.charge``'s weights) received in [start, end]."""
    times = record.token_times_s
    prompt = INPUT_WEIGHT * (record.computed_tokens or 0) if times and \
        start <= times[0] <= end else 0.0
    return prompt + OUTPUT_WEIGHT * sum(1 for t in times if start <= t <= end)


def _part_figures(run: RunResult, ok: list[RequestRecord],
                  member: Callable[[RequestRecord], bool]) -> dict:
    """A part of the run's requests (a class, a tenant): requests completed, TTFT and E2E
    latency (mean and p99, ms), output tokens/s over the run's duration, preemptions
    (None where unobserved)."""
    mine = [r for r in ok if member(r)]
    samples = _latency_samples(mine)
    counts = [r.preemptions for r in run.records if member(r)]
    return {
        "requests": len(mine),
        **_mean_p99("ttft", samples["ttft"]),
        **_mean_p99("e2el", samples["e2el"]),
        "output_throughput": _per_second(sum(r.output_len for r in mine), run.duration_s),
        "preemptions": None if None in counts else sum(counts),  # type: ignore[arg-type]
    }


def _preemption_keys(run: RunResult) -> Summary:
    """Preemptions of the run and of each prefix group (total and the most any one
    request took), from the records where all have a count, else the run's total; and the
    tokens they made the engine compute again (``recomputed_tokens``)."""
    counts = [r.preemptions for r in run.records]
    recomputed = recomputed_tokens(run.records)
    if not counts or None in counts:
        return {"preemptions": run.preemptions, "max_preemptions_per_request": None,
                "recomputed_tokens": recomputed, "preemptions_by_group": None}
    by_group = {group: [r.preemptions or 0 for r in records]
                for group, records in _by_group(run.records).items()}
    return {
        "preemptions": sum(c or 0 for c in counts),
        "max_preemptions_per_request": max(c or 0 for c in counts),
        "recomputed_tokens": recomputed,
        "preemptions_by_group": {group: {"preemptions": sum(values),
                                         "max_per_request": max(values)}
                                 for group, values in by_group.items()},
    }


def recomputed_tokens(records: Iterable[RequestRecord]) -> int | None:
    """Tokens the engine computed again because of preemptions, summed over ``records``
    (failed ones too: the work was done): per request, what it computed beyond its first
    prefill, ``computed_tokens - (prompt_len - cached_tokens)`` (``cached_tokens``: at its
    first admission), at least 0; 0 for a request never preempted.  A preemption is by
    recompute (vLLM's), so each re-prefill counts whole: the prompt less what the prefix
    cache still held, plus every output so far, the last of which (not yet in the KV when
    preempted; a decode would have computed it) puts the figure above the work redone by
    at most one token a preemption.  None where a preempted request's recomputation was
    not observed (``counts_recompute`` false: a real engine's client sees the first
    prefill only; or no counts).  O(records)."""
    total = 0
    for record in records:
        if record.preemptions == 0:
            continue
        if not record.counts_recompute or record.computed_tokens is None or \
                record.cached_tokens is None:
            return None
        first = record.prompt_len - record.cached_tokens
        total += max(record.computed_tokens - first, 0)
    return total


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
        samples["itl"].extend(chunk_gaps(record.token_times_s))
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


def chunk_gaps(token_times_s: list[float]) -> list[float]:
    """Gaps between successive chunks: tokens sharing an arrival time are one chunk."""
    chunks = [t for t, _ in groupby(token_times_s)]
    return [b - a for a, b in pairwise(chunks)]


def _latency_stats(key: str, values: list[float], percentiles: Iterable[float],
                   unit: str = "ms") -> Summary:
    """Mean, median, std and percentiles in ms (``unit`` "s": seconds), as vLLM names
    them (empty -> 0)."""
    data, scale = values or 0, 1000 if unit == "ms" else 1
    stats: Summary = {
        f"mean_{key}_{unit}": float(np.mean(data)) * scale,
        f"median_{key}_{unit}": float(np.median(data)) * scale,
        f"std_{key}_{unit}": float(np.std(data)) * scale,
    }
    for p in percentiles:
        stats[f"p{_percentile_word(p)}_{key}_{unit}"] = float(np.percentile(data, p)) * scale
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
        "urgent_preemptions": stats.urgent_preemptions if stats else None,
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
