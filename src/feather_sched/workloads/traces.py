"""Workloads from files: JSON Lines traces (``save_jsonl``/``load_jsonl``, priorities,
tenants and all), and Mooncake-style hash-id traces replayed in a window, faster or
slower, at a token scale (``Replay``, ``load_mooncake``)."""

import json
import math
import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from feather_sched.core.tenants import DEFAULT_TENANT, parse_tenant
from feather_sched.workloads.spec import (
    RequestSpec,
    Workload,
    check_positive,
    check_vocab,
    random_tokens,
)

TRACE_FORMAT = "feather-trace"
TRACE_VERSION = 1


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
                "tenant": r.tenant,
                "prompt": r.prompt.tolist(),
            }
            f.write(json.dumps(record) + "\n")


def _priority(obj: dict[str, Any]) -> int:
    """A trace record's optional ``priority`` field (0 when absent)."""
    return _field(obj, "priority", int) if "priority" in obj else 0


def _tenant(obj: dict[str, Any]) -> str:
    """A trace record's optional ``tenant`` field (``DEFAULT_TENANT`` when absent; an
    integer as its decimal string, ``parse_tenant``)."""
    return parse_tenant(obj["tenant"], "field 'tenant'") if "tenant" in obj else \
        DEFAULT_TENANT


def load_jsonl(path: str | Path) -> Workload:
    """Read a trace written by :func:`save_jsonl`, validating every line (``priority``
    and ``tenant`` are optional: 0 and ``DEFAULT_TENANT`` when absent)."""
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
                    tenant=_tenant(obj),
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
            check_positive(max_requests=self.max_requests)
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
    return random_tokens(np.random.default_rng([seed, hash_id]), block_tokens, vocab_size)


def _mooncake_record(obj: dict[str, Any],
                     block_tokens: int) -> tuple[float, int, int, list[int], int, str]:
    """Validate one Mooncake line: (timestamp, input_length, output_length, hash_ids,
    priority, tenant)."""
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
    return timestamp, input_length, output_length, hash_ids, _priority(obj), _tenant(obj)


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
    optional priority and tenant) of ``block_tokens``-token hash blocks.

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
    check_positive(block_tokens=block_tokens)
    check_vocab(vocab_size)
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
    for i, (timestamp, length, output_length, hash_ids, priority, tenant) in \
            enumerate(records):
        last = length - (len(hash_ids) - 1) * block_tokens
        length = (len(hash_ids) - 1) * scaled + -(-last * scaled // block_tokens)
        shared = _shared_block_tokens(trie, hash_ids, length, scaled)
        for h in hash_ids:
            if h not in blocks:
                blocks[h] = _block(seed, h, scaled, vocab_size)
        prompt = np.concatenate([blocks[h] for h in hash_ids])[:length]
        arrival = (timestamp - start) * time_scale / replay.speed
        requests.append(RequestSpec(f"{path.stem}-{i + replay.start}", prompt, output_length,
                                    arrival, hash_ids[0], shared, priority, tenant))
    return Workload(path.stem, requests)
