"""What a run observes, per request and per engine step, before any statistics: the types
the simulator produces and the benchmarks read (``RequestRecord``, ``StepRecord``,
``RunResult``).  Imports only ``telemetry`` and the workload's ``DEFAULT_TENANT``."""

from __future__ import annotations

from dataclasses import dataclass, field

from feather_sched.telemetry.stats import SchedulerStats
from feather_sched.workloads.spec import DEFAULT_TENANT


@dataclass
class RequestRecord:
    """One request's life as the client saw it; times in seconds from the run's start."""

    request_id: str
    prompt_len: int
    group: int
    """The workload's prefix group (-1: shares nothing)."""
    submitted_s: float
    token_times_s: list[float] = field(default_factory=list)
    """When each output token arrived (a chunk of several tokens repeats its time)."""
    finished_s: float | None = None
    success: bool = False
    error: str = ""
    cached_tokens: int | None = None
    """Prompt tokens the engine served from its prefix cache, when it reports them."""
    priority: int = 0
    """The workload's priority class (lower more urgent), whether or not the run's
    scheduler acted on it."""
    preemptions: int | None = None
    """Times the engine preempted the request, when it reports them."""
    tenant: str = DEFAULT_TENANT
    """The workload's tenant (whom the request is served for)."""
    computed_tokens: int | None = None
    """Tokens the engine computed for the request, prompt and recomputation (prefix-cache
    hits excluded), when it reports them: the input side of the service it received."""
    counts_recompute: bool = True
    """Whether ``computed_tokens`` counts what preemptions made the engine compute again
    (the simulator's do); ``prefill_cached``, a client's first-prefill figure, clears it."""

    def prefill_cached(self, cached_tokens: int) -> None:
        """The engine served ``cached_tokens`` of the prompt from its prefix cache at its
        prefill, and computed the rest (all a client learns: a recomputation after a
        preemption is not reported, so ``counts_recompute`` is cleared)."""
        self.cached_tokens = cached_tokens
        self.computed_tokens = self.prompt_len - cached_tokens
        self.counts_recompute = False

    @property
    def output_len(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.submitted_s if self.token_times_s else None


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the scheduler saw it (offline runs only)."""

    batch_size: int
    groups: int
    """Distinct prefix groups among the step's requests."""


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
    jobs: bool = False
    """Each group is one job (an agent program's turns): the summary adds job completion
    times and per-turn TTFT (``summary.job_figures``)."""
