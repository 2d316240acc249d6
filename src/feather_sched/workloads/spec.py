"""What a workload is: requests in token ids, arrivals, priority classes, tenants, and the
checks every generator and loader applies to its parameters.

A scheduler only sees token ids, so workloads are built from random ids (never 0, so 0 stays
free as a padding/sentinel id) with a controlled prefix structure: shared-prefix groups, long
documents with many questions, multi-turn chats, and a no-sharing control. Any workload can be
given priority classes (``prioritized``) and tenants (``tenanted``). Workloads can be saved
to and loaded from JSON Lines traces, and Mooncake-style hash-id traces can be replayed.
"""

import math
import operator
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from feather_sched.core.tenants import DEFAULT_TENANT, parse_tenant

ArrivalKind = Literal["all_at_once", "poisson", "bursty"]

MAX_TOKEN = np.iinfo(np.int32).max


# --------------------------------------------------------------------------- datatypes


@dataclass(frozen=True)
class RequestSpec:
    """One request: a token prompt, how many tokens to generate, and when it arrives.

    ``group`` and ``shared_len`` describe the prefix structure the generator built in
    (``-1`` / ``0`` when the prompt shares nothing), so hit rates can be checked against
    ground truth. ``priority`` is the request's priority class, lower more urgent (vLLM's
    convention; any integer); ``tenant`` the client it is served for (an id as
    ``core.tenants.parse_tenant`` takes it; fair share between tenants counts work by
    it). The prompt is stored as a read-only contiguous int32 copy.
    """

    request_id: str
    prompt: np.ndarray
    output_len: int
    arrival_s: float
    group: int = -1
    shared_len: int = 0
    priority: int = 0
    tenant: str = DEFAULT_TENANT

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        prompt = _as_prompt(self.prompt)
        output_len = _as_int("output_len", self.output_len)
        group = _as_int("group", self.group)
        shared_len = _as_int("shared_len", self.shared_len)
        priority = _as_int("priority", self.priority)
        arrival_s = float(self.arrival_s)
        if output_len < 0:
            raise ValueError(f"output_len must be >= 0, got {output_len}")
        if group < -1:
            raise ValueError(f"group must be >= -1, got {group}")
        if not 0 <= shared_len <= prompt.size:
            raise ValueError(f"shared_len must be in [0, {prompt.size}], got {shared_len}")
        tenant = parse_tenant(self.tenant)
        if not (math.isfinite(arrival_s) and arrival_s >= 0):
            raise ValueError(f"arrival_s must be finite and >= 0, got {arrival_s}")
        for name, value in [
            ("prompt", prompt),
            ("output_len", output_len),
            ("group", group),
            ("shared_len", shared_len),
            ("priority", priority),
            ("arrival_s", arrival_s),
            ("tenant", tenant),
        ]:
            object.__setattr__(self, name, value)

    def _scalars(self) -> tuple[str, int, float, int, int, int, str]:
        return (self.request_id, self.output_len, self.arrival_s, self.group, self.shared_len,
                self.priority, self.tenant)

    def __eq__(self, other: object) -> bool:
        # The generated __eq__ would compare arrays with ``==`` and fail on truthiness.
        if not isinstance(other, RequestSpec):
            return NotImplemented
        return self._scalars() == other._scalars() and np.array_equal(self.prompt, other.prompt)

    def __hash__(self) -> int:
        return hash((self._scalars(), self.prompt.tobytes()))


def _as_prompt(prompt: Any) -> np.ndarray:
    """Validate token ids and return them as a read-only contiguous int32 copy."""
    raw = np.asarray(prompt)
    if raw.ndim != 1 or raw.size == 0:
        raise ValueError(f"prompt must be a non-empty 1-D sequence, got shape {raw.shape}")
    if not np.issubdtype(raw.dtype, np.integer):
        raise ValueError(f"prompt must hold integer token ids, got dtype {raw.dtype}")
    if raw.min() < 0 or raw.max() > MAX_TOKEN:
        raise ValueError(f"prompt token ids must be in [0, {MAX_TOKEN}]")
    tokens = np.array(raw, dtype=np.int32, order="C")
    tokens.flags.writeable = False
    return tokens


def _as_int(name: str, value: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


@dataclass
class Workload:
    """A named list of requests, sorted by arrival time on construction (ties keep order)."""

    name: str
    requests: list[RequestSpec]

    def __post_init__(self) -> None:
        self.requests = sorted(self.requests, key=lambda r: r.arrival_s)
        ids = Counter(r.request_id for r in self.requests)
        duplicates = sorted(i for i, count in ids.items() if count > 1)
        if duplicates:
            raise ValueError(f"duplicate request ids in workload {self.name!r}: {duplicates[:5]}")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[RequestSpec]:
        return iter(self.requests)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(r.prompt.size for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def priority_classes(self) -> dict[int, int]:
        """Requests per priority class, most urgent (lowest) first.  O(requests)."""
        return dict(sorted(Counter(r.priority for r in self.requests).items()))

    @property
    def tenants(self) -> dict[str, int]:
        """Requests per tenant, by name.  O(requests)."""
        return dict(sorted(Counter(r.tenant for r in self.requests).items()))

    def describe(self) -> str:
        """One-line summary: size, prefix structure, token totals and arrival span, and
        the priority classes and tenants when there are several."""
        n = len(self.requests)
        prompt_tokens = self.total_prompt_tokens
        shared = sum(r.shared_len for r in self.requests)
        groups = len({r.group for r in self.requests} - {-1})
        span = self.requests[-1].arrival_s if n else 0.0
        classes = self.priority_classes
        priorities = "" if len(classes) < 2 else ", priority classes " + ", ".join(
            f"{p}: {count}" for p, count in classes.items())
        return (
            f"{self.name}: {n} requests, {groups} prefix groups, "
            f"{prompt_tokens} prompt tokens (mean {prompt_tokens / max(n, 1):.1f}, "
            f"{shared / max(prompt_tokens, 1):.1%} in shared prefixes), "
            f"{self.total_output_tokens} output tokens, arrivals over {span:.3f}s{priorities}"
            + ("" if len(self.tenants) < 2 else f", {len(self.tenants)} tenants")
        )


# --------------------------------------------------------------------------- priorities


def prioritized(workload: Workload, high_share: float, seed: int = 0) -> Workload:
    """A copy of ``workload`` in two priority classes: a seeded random choice of
    ``high_share`` of its requests (rounded, at least one) in class 0, the rest in class 1;
    ``high_share`` 0 puts every request in class 0 (one class: priorities stripped).
    The choice ignores groups, so classes share prefixes.  O(requests + tokens)."""
    if not 0.0 <= high_share <= 1.0:
        raise ValueError(f"high_priority_share must be in [0, 1], got {high_share}")
    n = len(workload)
    high = np.zeros(n, dtype=bool)
    if high_share > 0 and n:
        count = max(1, round(high_share * n))
        high[np.random.default_rng(seed).choice(n, size=count, replace=False)] = True
    else:
        high[:] = True
    return Workload(workload.name, [replace(r, priority=0 if urgent else 1)
                                    for r, urgent in zip(workload, high, strict=True)])


def tenanted(workload: Workload, tenants: int) -> Workload:
    """A copy of ``workload`` spread over ``tenants`` tenants ``t0``, ``t1``, ...: prefix
    group ``g`` to tenant ``g mod tenants`` (a group stays in one tenant, as a customer's
    template does), requests sharing nothing round robin by arrival; 1 keeps the
    workload's own tenants.  O(requests + tokens)."""
    if isinstance(tenants, bool) or not isinstance(tenants, int) or tenants < 1:
        raise ValueError(f"tenants must be a positive integer, got {tenants!r}")
    if tenants == 1:
        return workload
    return Workload(workload.name, [
        replace(r, tenant=f"t{(r.group if r.group >= 0 else i) % tenants}")
        for i, r in enumerate(workload)])


# --------------------------------------------------------------------------- arrivals


@dataclass(frozen=True)
class ArrivalSpec:
    """How requests arrive: all at t=0, as a Poisson process, or in Poisson-spaced bursts.

    ``rate`` is the mean request rate (requests/s) for ``poisson`` and ``bursty``.
    """

    kind: ArrivalKind = "all_at_once"
    rate: float = 0.0
    burst_size: int = 32

    def __post_init__(self) -> None:
        check_choice("arrival kind", self.kind, ("all_at_once", "poisson", "bursty"))
        if self.kind != "all_at_once" and not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"{self.kind} arrivals need a finite rate > 0, got {self.rate}")
        check_positive(burst_size=self.burst_size)


def arrival_times(n: int, spec: ArrivalSpec | None, rng: np.random.Generator) -> np.ndarray:
    """Return ``n`` non-decreasing arrival times in seconds; ``None`` means all at once."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if spec is None or spec.kind == "all_at_once":
        return np.zeros(n)
    if spec.kind == "poisson":
        return np.cumsum(rng.exponential(1.0 / spec.rate, size=n))
    bursts = -(-n // spec.burst_size)
    starts = np.cumsum(rng.exponential(spec.burst_size / spec.rate, size=bursts))
    return np.repeat(starts, spec.burst_size)[:n]


# --------------------------------------------------------------------------- validation


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")


def check_jitter(jitter: float) -> None:
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")


def check_vocab(vocab_size: int) -> None:
    check_positive(vocab_size=vocab_size)
    if not 2 <= vocab_size <= MAX_TOKEN + 1:
        raise ValueError(f"vocab_size must be in [2, {MAX_TOKEN + 1}], got {vocab_size}")


def check_range(name: str, bounds: tuple[int, int]) -> None:
    low, high = bounds
    check_positive(**{f"{name}[0]": low, f"{name}[1]": high})
    if low > high:
        raise ValueError(f"{name} must satisfy low <= high, got {bounds}")




def random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    return rng.integers(1, vocab_size, size=n, dtype=np.int32)
