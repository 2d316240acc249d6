"""Seedable request workloads expressed directly in token ids.

A scheduler only sees token ids, so workloads are built from random ids (never 0, so 0 stays
free as a padding/sentinel id) with a controlled prefix structure: shared-prefix groups, long
documents with many questions, multi-turn chats, and a no-sharing control. Any workload can be
given priority classes (``prioritized``). Workloads can be saved to and loaded from JSON Lines
traces, and Mooncake-style hash-id traces can be replayed.
"""

import json
import math
import operator
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

ArrivalKind = Literal["all_at_once", "poisson", "bursty"]
Order = Literal["shuffled", "grouped"]
Popularity = Literal["uniform", "zipf"]

TRACE_FORMAT = "feather-trace"
TRACE_VERSION = 1
_MAX_TOKEN = np.iinfo(np.int32).max


# --------------------------------------------------------------------------- datatypes


@dataclass(frozen=True)
class RequestSpec:
    """One request: a token prompt, how many tokens to generate, and when it arrives.

    ``group`` and ``shared_len`` describe the prefix structure the generator built in
    (``-1`` / ``0`` when the prompt shares nothing), so hit rates can be checked against
    ground truth. ``priority`` is the request's priority class, lower more urgent (vLLM's
    convention; any integer). The prompt is stored as a read-only contiguous int32 copy.
    """

    request_id: str
    prompt: np.ndarray
    output_len: int
    arrival_s: float
    group: int = -1
    shared_len: int = 0
    priority: int = 0

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
        if not (math.isfinite(arrival_s) and arrival_s >= 0):
            raise ValueError(f"arrival_s must be finite and >= 0, got {arrival_s}")
        for name, value in [
            ("prompt", prompt),
            ("output_len", output_len),
            ("group", group),
            ("shared_len", shared_len),
            ("priority", priority),
            ("arrival_s", arrival_s),
        ]:
            object.__setattr__(self, name, value)

    def _scalars(self) -> tuple[str, int, float, int, int, int]:
        return (self.request_id, self.output_len, self.arrival_s, self.group, self.shared_len,
                self.priority)

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
    if raw.min() < 0 or raw.max() > _MAX_TOKEN:
        raise ValueError(f"prompt token ids must be in [0, {_MAX_TOKEN}]")
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

    def describe(self) -> str:
        """One-line summary: size, prefix structure, token totals and arrival span, and
        the priority classes when there are several."""
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
        _check_choice("arrival kind", self.kind, ("all_at_once", "poisson", "bursty"))
        if self.kind != "all_at_once" and not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"{self.kind} arrivals need a finite rate > 0, got {self.rate}")
        _check_positive(burst_size=self.burst_size)


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


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")


def _check_jitter(jitter: float) -> None:
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")


def _check_vocab(vocab_size: int) -> None:
    _check_positive(vocab_size=vocab_size)
    if not 2 <= vocab_size <= _MAX_TOKEN + 1:
        raise ValueError(f"vocab_size must be in [2, {_MAX_TOKEN + 1}], got {vocab_size}")


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    low, high = bounds
    _check_positive(**{f"{name}[0]": low, f"{name}[1]": high})
    if low > high:
        raise ValueError(f"{name} must satisfy low <= high, got {bounds}")


# --------------------------------------------------------------------------- token helpers


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    return rng.integers(1, vocab_size, size=n, dtype=np.int32)


def _distinct_sequences(
    rng: np.random.Generator, lengths: Sequence[int], vocab_size: int
) -> list[np.ndarray]:
    """Draw one random sequence per length, redrawing repeats so that all are distinct.

    Guarantees e.g. that no two suffixes collide even when they are a single token long.
    """
    for length, count in Counter(int(n) for n in lengths).items():
        # (vocab-1)**64 already exceeds any feasible count unless vocab_size == 2.
        if count > (vocab_size - 1) ** min(length, 64):
            raise ValueError(
                f"cannot draw {count} distinct {length}-token sequences from "
                f"{vocab_size - 1} token ids; raise vocab_size or the length"
            )
    seen: set[bytes] = set()
    sequences = []
    for length in lengths:
        seq = _tokens(rng, int(length), vocab_size)
        while seq.tobytes() in seen:
            seq = _tokens(rng, int(length), vocab_size)
        seen.add(seq.tobytes())
        sequences.append(seq)
    return sequences


def _jittered(rng: np.random.Generator, base: int, jitter: float, n: int) -> np.ndarray:
    """Integers drawn uniformly from [base*(1-jitter), base*(1+jitter)], each at least 1."""
    eps = 1e-9  # keep e.g. 10*(1-0.3) from rounding up to 8 through float error
    low = max(1, math.ceil(base * (1 - jitter) - eps))
    high = math.floor(base * (1 + jitter) + eps)
    return rng.integers(low, high, size=n, endpoint=True)


def _arrange(rng: np.random.Generator, labels: np.ndarray, order: Order) -> np.ndarray:
    """Keep grouped labels in order, or shuffle them."""
    return labels if order == "grouped" else rng.permutation(labels)


def _build(
    name: str,
    parts: Sequence[tuple[np.ndarray, int, int, int]],
    arrivals: np.ndarray,
) -> Workload:
    """Turn (prompt, output_len, group, shared_len) tuples plus arrival times into a workload."""
    requests = [
        RequestSpec(f"{name}-{i}", prompt, int(out), float(t), int(group), int(shared))
        for i, ((prompt, out, group, shared), t) in enumerate(zip(parts, arrivals, strict=True))
    ]
    return Workload(name, requests)


# --------------------------------------------------------------------------- generators


def shared_prefix_groups(
    *,
    groups: int,
    prompts_per_group: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    jitter: float = 0.0,
    order: Order = "shuffled",
    popularity: Popularity = "uniform",
    zipf_s: float = 1.1,
    arrival: ArrivalSpec | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """Groups of prompts that share a per-group prefix and differ in a unique suffix.

    The core prefix-caching scenario (few-shot templates, shared system prompts). With
    ``popularity="zipf"`` the same total of ``groups * prompts_per_group`` prompts is spread
    over groups with weight ``1/rank**zipf_s`` (each group keeps at least one), which
    models a skewed mix of hot and cold prefixes.
    """
    _check_positive(
        groups=groups,
        prompts_per_group=prompts_per_group,
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        output_len=output_len,
    )
    _check_jitter(jitter)
    _check_choice("order", order, ("shuffled", "grouped"))
    _check_choice("popularity", popularity, ("uniform", "zipf"))
    if not (math.isfinite(zipf_s) and zipf_s > 0):
        raise ValueError(f"zipf_s must be finite and > 0, got {zipf_s}")
    _check_vocab(vocab_size)

    rng = np.random.default_rng(seed)
    total = groups * prompts_per_group
    if popularity == "uniform":
        sizes = np.full(groups, prompts_per_group)
    else:
        weights = 1.0 / np.arange(1, groups + 1) ** zipf_s
        extra = rng.choice(groups, size=total - groups, p=weights / weights.sum())
        sizes = 1 + np.bincount(extra, minlength=groups)
    return _prefix_groups("shared-prefix", rng, sizes, [prefix_len] * groups, suffix_len,
                          output_len, jitter, order, arrival, vocab_size)


def minority_groups(
    *,
    majority: int,
    minorities: Sequence[int],
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    arrival: ArrivalSpec | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
    minority_prefix_len: int | None = None,
) -> Workload:
    """One large prefix group and small ones, shuffled together: where prefix-first order
    starves the minority (group 0 is the majority, groups 1.. the minorities, whose
    prefixes are ``minority_prefix_len`` long; default ``prefix_len``)."""
    minority_prefix_len = prefix_len if minority_prefix_len is None else minority_prefix_len
    _check_positive(majority=majority, prefix_len=prefix_len, suffix_len=suffix_len,
                    output_len=output_len, minority_prefix_len=minority_prefix_len)
    if not minorities or min(minorities) <= 0:
        raise ValueError(f"minorities must be positive group sizes, got {list(minorities)}")
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    sizes = np.array([majority, *minorities])
    prefix_lens = [prefix_len] + [minority_prefix_len] * len(minorities)
    return _prefix_groups("minority", rng, sizes, prefix_lens, suffix_len, output_len, 0.0,
                          "shuffled", arrival, vocab_size)


def singleton_before_a_stream(
    *,
    stream: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    singleton_output_len: int,
    arrival: ArrivalSpec,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """A singleton (its own prefix) that arrives first, then a stream of ``stream``
    requests of one prefix group: where preempting the end of a group-ordered batch makes
    the oldest request pay (group 0 is the stream, the singleton has no group)."""
    _check_positive(stream=stream, prefix_len=prefix_len, suffix_len=suffix_len,
                    output_len=output_len, singleton_output_len=singleton_output_len)
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    singleton = _tokens(rng, prefix_len + suffix_len, vocab_size)
    prefix = _tokens(rng, prefix_len, vocab_size)
    parts = [(singleton, singleton_output_len, -1, 0)]
    parts += [(np.concatenate([prefix, _tokens(rng, suffix_len, vocab_size)]), output_len, 0,
               prefix_len) for _ in range(stream)]
    later = arrival_times(stream, arrival, rng) + 1e-3  # strictly after the singleton
    return _build("singleton-before-a-stream", parts, np.concatenate([[0.0], later]))


def _prefix_groups(kind: str, rng: np.random.Generator, sizes: np.ndarray,
                   prefix_lens: Sequence[int], suffix_len: int, output_len: int,
                   jitter: float, order: Order, arrival: ArrivalSpec | None,
                   vocab_size: int) -> Workload:
    """Group ``g`` of ``sizes[g]`` prompts: a shared prefix of ``prefix_lens[g]`` tokens,
    then a unique suffix."""
    total = int(sizes.sum())
    members = _arrange(rng, np.repeat(np.arange(len(sizes)), sizes), order)
    prefixes = _distinct_sequences(rng, prefix_lens, vocab_size)
    suffixes = _distinct_sequences(rng, _jittered(rng, suffix_len, jitter, total), vocab_size)
    outputs = _jittered(rng, output_len, jitter, total)
    parts = [
        (np.concatenate([prefixes[g], suffix]), out, g, prefix_lens[g])
        for g, suffix, out in zip(members, suffixes, outputs, strict=True)
    ]
    return _build(kind, parts, arrival_times(total, arrival, rng))


def long_documents(
    *,
    documents: int,
    questions_per_document: int,
    doc_len_range: tuple[int, int] = (4096, 16384),
    question_len: tuple[int, int] = (16, 64),
    output_len: int,
    order: Order = "shuffled",
    arrival: ArrivalSpec | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """Several questions about each long document (LongBench / L-Eval style).

    Each prompt is a document followed by a question; the document is the shared prefix,
    so a cache hit saves thousands of prefill tokens. Both length ranges are inclusive.
    """
    _check_positive(
        documents=documents,
        questions_per_document=questions_per_document,
        output_len=output_len,
    )
    _check_range("doc_len_range", doc_len_range)
    _check_range("question_len", question_len)
    _check_choice("order", order, ("shuffled", "grouped"))
    _check_vocab(vocab_size)

    rng = np.random.default_rng(seed)
    total = documents * questions_per_document
    doc_lens = rng.integers(doc_len_range[0], doc_len_range[1], size=documents, endpoint=True)
    docs = _distinct_sequences(rng, doc_lens, vocab_size)
    members = _arrange(rng, np.repeat(np.arange(documents), questions_per_document), order)
    q_lens = rng.integers(question_len[0], question_len[1], size=total, endpoint=True)
    questions = _distinct_sequences(rng, q_lens, vocab_size)
    parts = [
        (np.concatenate([docs[d], question]), output_len, d, docs[d].size)
        for d, question in zip(members, questions, strict=True)
    ]
    return _build("long-docs", parts, arrival_times(total, arrival, rng))


def multi_turn_chat(
    *,
    conversations: int,
    turns: int,
    system_prompt_len: int,
    user_turn_len: int,
    assistant_turn_len: int,
    output_len: int,
    think_s: float = 1.0,
    arrival: ArrivalSpec | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """Conversations whose every turn resends the whole history plus a new user message.

    All conversations start with one common system prompt; turn ``t`` of a conversation is
    its turn ``t-1`` prompt + an assistant reply (``assistant_turn_len`` random tokens) + a
    new user message, so ``shared_len`` is everything before the new user message and
    ``group`` is the conversation index. With ``arrival=None`` every request arrives at 0
    (turn-major order: all first turns, then all second turns, ...); otherwise ``arrival``
    sets the conversation start times and turn ``t`` arrives ``t * think_s`` later.
    """
    _check_positive(
        conversations=conversations,
        turns=turns,
        system_prompt_len=system_prompt_len,
        user_turn_len=user_turn_len,
        assistant_turn_len=assistant_turn_len,
        output_len=output_len,
    )
    if not (math.isfinite(think_s) and think_s > 0):
        raise ValueError(f"think_s must be finite and > 0, got {think_s}")
    _check_vocab(vocab_size)

    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_prompt_len, vocab_size)
    contexts = [system] * conversations
    parts = []
    for _ in range(turns):
        for c in range(conversations):
            prompt = np.concatenate([contexts[c], _tokens(rng, user_turn_len, vocab_size)])
            parts.append((prompt, output_len, c, contexts[c].size))
            contexts[c] = np.concatenate([prompt, _tokens(rng, assistant_turn_len, vocab_size)])
    starts = arrival_times(conversations, arrival, rng)
    turn_offsets = np.arange(turns)[:, None] * (0.0 if arrival is None else think_s)
    return _build("chat", parts, (starts[None, :] + turn_offsets).ravel())


def no_sharing(
    *,
    requests: int,
    prompt_len: int,
    output_len: int,
    jitter: float = 0.0,
    arrival: ArrivalSpec | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """Control workload: independent random prompts, so prefix caching cannot help."""
    _check_positive(requests=requests, prompt_len=prompt_len, output_len=output_len)
    _check_jitter(jitter)
    _check_vocab(vocab_size)

    rng = np.random.default_rng(seed)
    prompts = _distinct_sequences(rng, _jittered(rng, prompt_len, jitter, requests), vocab_size)
    outputs = _jittered(rng, output_len, jitter, requests)
    parts = [(prompt, out, -1, 0) for prompt, out in zip(prompts, outputs, strict=True)]
    return _build("no-sharing", parts, arrival_times(requests, arrival, rng))


# --------------------------------------------------------------------------- traces


@contextmanager
def _at_line(path: Path, lineno: int) -> Iterator[None]:
    """Re-raise ValueError (JSON errors included) prefixed with the file and line number."""
    try:
        yield
    except ValueError as err:
        raise ValueError(f"{path}, line {lineno}: {err}") from err


def _json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) for each non-blank line; every line must be a JSON object."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            with _at_line(path, lineno):
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """Return ``obj[key]`` after checking it exists and has the given JSON type."""
    if key not in obj:
        raise ValueError(f"missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"field {key!r} has the wrong type: {value!r}")
    return value


def save_jsonl(workload: Workload, path: str | Path) -> None:
    """Write a workload as a JSON Lines trace: a header line, then one request per line."""
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "name": workload.name}
    with Path(path).open("w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for r in workload:
            record = {
                "request_id": r.request_id,
                "arrival_s": r.arrival_s,
                "output_len": r.output_len,
                "group": r.group,
                "shared_len": r.shared_len,
                "priority": r.priority,
                "prompt": r.prompt.tolist(),
            }
            f.write(json.dumps(record) + "\n")


def _priority(obj: dict[str, Any]) -> int:
    """A trace record's optional ``priority`` field (0 when absent)."""
    return _field(obj, "priority", int) if "priority" in obj else 0


def load_jsonl(path: str | Path) -> Workload:
    """Read a trace written by :func:`save_jsonl`, validating every line (``priority``
    is optional, 0 when absent)."""
    path = Path(path)
    lines = _json_lines(path)
    first = next(lines, None)
    if first is None:
        raise ValueError(f"{path}, line 1: empty trace, expected a {TRACE_FORMAT!r} header")
    lineno, header = first
    with _at_line(path, lineno):
        if header.get("format") != TRACE_FORMAT or header.get("version") != TRACE_VERSION:
            raise ValueError(f"expected a {TRACE_FORMAT!r} version {TRACE_VERSION} header")
        name = _field(header, "name", str)
    requests = []
    for lineno, obj in lines:
        with _at_line(path, lineno):
            requests.append(
                RequestSpec(
                    request_id=_field(obj, "request_id", str),
                    prompt=_field(obj, "prompt", list),
                    output_len=_field(obj, "output_len", int),
                    arrival_s=_field(obj, "arrival_s", (int, float)),
                    group=_field(obj, "group", int),
                    shared_len=_field(obj, "shared_len", int),
                    priority=_priority(obj),
                )
            )
    return Workload(name, requests)


@dataclass(frozen=True)
class Replay:
    """Which part of a trace to replay, how fast, and at what token scale.

    ``start`` skips that many requests and ``max_requests`` keeps at most that many (in
    arrival order; None: all the rest); the window's first arrival becomes time 0.
    ``speed`` divides the gaps between arrivals (0.25 stretches the trace 4x in time).
    ``token_scale`` scales a hash-id trace's blocks (0.25: each 512-token hash block
    becomes 128 tokens, so every request keeps its blocks and which requests share what,
    at a quarter of the tokens); it must turn the trace's block into whole tokens, and
    traces of token ids only take 1.
    """

    start: int = 0
    max_requests: int | None = None
    speed: float = 1.0
    token_scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"start must be an integer >= 0, got {self.start!r}")
        if self.max_requests is not None:
            _check_positive(max_requests=self.max_requests)
        for name in ("speed", "token_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")

    def window(self, n: int) -> slice:
        """The requests kept of ``n`` in arrival order."""
        stop = n if self.max_requests is None else min(n, self.start + self.max_requests)
        if self.start >= n:
            raise ValueError(f"start {self.start} leaves none of the trace's {n} requests")
        return slice(self.start, stop)

    def scaled_block(self, block_tokens: int) -> int:
        """Tokens a ``block_tokens``-token hash block becomes (ValueError unless whole)."""
        scaled = block_tokens * self.token_scale
        if abs(scaled - round(scaled)) > 1e-9 or round(scaled) < 1:
            raise ValueError(f"token_scale {self.token_scale} turns {block_tokens}-token "
                             f"blocks into {scaled:g} tokens; choose a scale giving whole "
                             "tokens")
        return round(scaled)

    def apply(self, workload: Workload) -> Workload:
        """The window of a workload of token ids, its time rebased and divided by
        ``speed`` (``token_scale`` must be 1: token ids cannot be rescaled).  O(requests)."""
        if self.token_scale != 1:
            raise ValueError("token_scale is for hash-id (Mooncake) traces; this one holds "
                             "token ids")
        kept = workload.requests[self.window(len(workload))]
        origin = kept[0].arrival_s
        return Workload(workload.name, [replace(r, arrival_s=(r.arrival_s - origin) / self.speed)
                                        for r in kept])


def _shared_block_tokens(
    trie: dict[int, list[Any]], hash_ids: Sequence[int], input_length: int, block_tokens: int
) -> int:
    """Count leading tokens shared with any earlier request, then record this request.

    ``trie`` maps a hash id to ``[most tokens of that block any request used, child trie]``,
    so a partially filled last block is not over-counted. Once the match falls short the
    rest of the walk only meets fresh nodes (only last blocks are partial, and they have no
    children), which add nothing, so no early exit is needed.
    """
    shared, node = 0, trie
    for i, h in enumerate(hash_ids):
        covered = min(block_tokens, input_length - i * block_tokens)
        entry = node.setdefault(h, [0, {}])
        shared += min(covered, entry[0])
        entry[0] = max(entry[0], covered)
        node = entry[1]
    return shared


def _block(seed: int, hash_id: int, block_tokens: int, vocab_size: int) -> np.ndarray:
    """The token block a hash id stands for: a pure function of (seed, hash_id)."""
    return _tokens(np.random.default_rng([seed, hash_id]), block_tokens, vocab_size)


def _mooncake_record(obj: dict[str, Any],
                     block_tokens: int) -> tuple[float, int, int, list[int], int]:
    """Validate one Mooncake line: (timestamp, input_length, output_length, hash_ids,
    priority)."""
    timestamp = _field(obj, "timestamp", (int, float))
    input_length = _field(obj, "input_length", int)
    output_length = _field(obj, "output_length", int)
    hash_ids = _field(obj, "hash_ids", list)
    if output_length < 0:
        raise ValueError(f"output_length must be >= 0, got {output_length}")
    if not hash_ids or any(
        isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in hash_ids
    ):
        raise ValueError("hash_ids must be a non-empty list of non-negative integers")
    n = len(hash_ids)
    if not (n - 1) * block_tokens < input_length <= n * block_tokens:
        raise ValueError(
            f"input_length {input_length} does not fit {n} hash ids of {block_tokens} tokens "
            f"(need {(n - 1) * block_tokens} < input_length <= {n * block_tokens})"
        )
    return timestamp, input_length, output_length, hash_ids, _priority(obj)


def load_mooncake(
    path: str | Path,
    *,
    replay: Replay | None = None,
    block_tokens: int = 512,
    seed: int = 0,
    vocab_size: int = 32000,
    time_scale: float = 1e-3,
) -> Workload:
    """Replay a Mooncake-style trace (timestamp, input_length, output_length, hash_ids,
    and an optional priority, 0 when absent) of ``block_tokens``-token hash blocks.

    Every line is validated; then ``replay`` picks the window (in timestamp order), its
    speed and token scale.  Each hash id stands for one block of ``block_tokens *
    token_scale`` tokens, a fixed random block that depends only on ``(seed, hash id)``,
    so equal leading hash ids give identical token prefixes and an engine's prefix cache
    sees exactly the trace's sharing; a partial last block keeps its share of the block
    (rounded up).  ``group`` is the first hash id, ``shared_len`` the leading tokens
    shared with any earlier request of the window, and ``arrival_s`` is ``(timestamp -
    the window's first timestamp) * time_scale / speed`` (timestamps in ms by default).
    The workload is named after the file.  Cost: one JSON parse per line, then numpy
    work for the window's blocks and prompts only (the 3,993-request Mooncake trace,
    61M tokens, loads whole in about a second).
    """
    replay = replay or Replay()
    _check_positive(block_tokens=block_tokens)
    _check_vocab(vocab_size)
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be finite and > 0, got {time_scale}")
    path = Path(path)
    scaled = replay.scaled_block(block_tokens)
    records = []
    for lineno, obj in _json_lines(path):
        with _at_line(path, lineno):
            records.append(_mooncake_record(obj, block_tokens))
    records.sort(key=operator.itemgetter(0))
    records = records[replay.window(len(records))]
    start = records[0][0]
    trie: dict[int, list[Any]] = {}
    blocks: dict[int, np.ndarray] = {}
    requests = []
    for i, (timestamp, length, output_length, hash_ids, priority) in enumerate(records):
        last = length - (len(hash_ids) - 1) * block_tokens
        length = (len(hash_ids) - 1) * scaled + -(-last * scaled // block_tokens)
        shared = _shared_block_tokens(trie, hash_ids, length, scaled)
        for h in hash_ids:
            if h not in blocks:
                blocks[h] = _block(seed, h, scaled, vocab_size)
        prompt = np.concatenate([blocks[h] for h in hash_ids])[:length]
        arrival = (timestamp - start) * time_scale / replay.speed
        requests.append(RequestSpec(f"{path.stem}-{i + replay.start}", prompt, output_length,
                                    arrival, hash_ids[0], shared, priority))
    return Workload(path.stem, requests)
