"""What a benchmark run observes, per request and per engine step, before any statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


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
