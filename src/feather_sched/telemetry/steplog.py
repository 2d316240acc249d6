"""The step log: each engine step's batch, in batch order, and its measured time.

One format for every producer and consumer (the vLLM adapter's ``step_log`` option, the
GPU decode kit, the simulator's tests; ``feather calibrate`` reads it): CSV, one row per
request of a step::

    step,position,group,shared_tokens,context_tokens,new_tokens,seconds

``position`` is the request's place in the batch, ``group`` its prefix group
(``core.prefix``), ``seconds`` the step's measured time (on every row of a step).  A step
is written in one piece: a last line without its newline is a write cut short, dropped
with the rows of its step.  One process writes a log (each rank its own,
``core.config.Placement``); ``read_logs`` merges several.  Only the standard library is
imported, so the GPU kit can use this module where nothing else is installed.
"""

from __future__ import annotations

import csv
import glob
import io
import logging
import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from feather_sched.telemetry.files import replace_atomically

COLUMNS = ("step", "position", "group", "shared_tokens", "context_tokens", "new_tokens",
           "seconds")
_INT_COLUMNS = ("step", "position", "shared_tokens", "context_tokens", "new_tokens")

logger = logging.getLogger("feather_sched")


@dataclass(frozen=True)
class BatchEntry:
    """One request in one engine step."""

    group: Hashable
    """Prefix group: requests of a group share physical prefix KV blocks."""
    shared_tokens: int
    """Tokens of this request's context that another request of the step also holds."""
    context_tokens: int
    """KV tokens attended: already computed plus computed this step."""
    new_tokens: int
    """Tokens computed this step (1 for decode, a chunk for prefill)."""

    def __post_init__(self) -> None:
        if self.new_tokens < 0 or not 0 <= self.shared_tokens <= self.context_tokens:
            raise ValueError(f"need 0 <= shared_tokens <= context_tokens and new_tokens >= 0: "
                             f"{self}")


Step = tuple[list[BatchEntry], float]
"""A step's batch in execution order and its measured seconds."""


def format_step(step: int, batch: Sequence[BatchEntry], seconds: float) -> str:
    """A step's rows as CSV text (groups written with ``str()``, bytes such as an engine's
    block hashes as their first 16 hex digits)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for position, entry in enumerate(batch):
        group = entry.group.hex()[:16] if isinstance(entry.group, bytes) else entry.group
        writer.writerow((step, position, group, entry.shared_tokens,
                         entry.context_tokens, entry.new_tokens, repr(float(seconds))))
    return buffer.getvalue()


def header() -> str:
    return ",".join(COLUMNS) + "\n"


def write_steps(path: str | Path, steps: Iterable[tuple[Sequence[BatchEntry], float]]) -> None:
    """Write a whole log at once, atomically (a temporary file renamed over ``path``).

    An empty step has no rows and does not survive a round trip.
    """
    text = header() + "".join(format_step(i, batch, seconds)
                              for i, (batch, seconds) in enumerate(steps))
    replace_atomically(path, text)


class StepLogWriter:
    """Appends steps to a log, one ``write`` and ``flush`` per step.

    A log that earlier engines appended to is continued: its step numbers go on, and a
    step cut short (an engine killed mid-write) is truncated away first.  A write
    that fails (disk full) is cut back to the last whole step before the error is
    raised, so the file always reads back whole.  Opening costs one pass over the file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.next_step = _continue_log(self.path)
        self._handle = open(self.path, "ab", buffering=0)  # noqa: SIM115 - engine-long
        if self._handle.tell() == 0:
            self._write(header())

    def append(self, batch: Sequence[BatchEntry], seconds: float) -> None:
        if batch:
            self._write(format_step(self.next_step, batch, seconds))
            self.next_step += 1

    def close(self) -> None:
        self._handle.close()

    def _write(self, text: str) -> None:
        handle = self._handle
        whole = handle.tell()
        data = memoryview(text.encode())
        try:
            while data:
                data = data[handle.write(data):]
        except OSError:
            handle.seek(whole)
            handle.truncate()
            raise


def read_steps(path: str | Path) -> list[Step]:
    """Read a log: steps ordered by step id, each batch ordered by position.

    A step cut short at the end of the file (``whole_steps_end``) is skipped with a
    warning.  Raises ValueError naming the line and column of the first problem
    elsewhere: a missing column, an empty or non-numeric value, a negative number, a
    repeated position, or a step whose rows disagree on ``seconds``.  One pass.
    """
    data = Path(path).read_bytes()
    end = whole_steps_end(data)
    if end < len(data):
        logger.warning("%s: its last step was cut short (a write interrupted): skipped "
                       "its %d line(s)", path, data[end:].count(b"\n") + 1)
        if not end:
            return []
    rows: dict[int, dict[int, BatchEntry]] = {}
    seconds: dict[int, float] = {}
    reader = csv.DictReader(io.StringIO(data[:end].decode(), newline=""))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise ValueError(f"{path}: line 1: missing column(s) {', '.join(missing)}")
    for row in reader:
        where = f"{path}: line {reader.line_num}"
        step, position, entry, measured = _parse_row(row, where)
        if step in seconds and not math.isclose(seconds[step], measured, rel_tol=1e-9):
            raise ValueError(f"{where}: column 'seconds': {measured!r} differs from "
                             f"{seconds[step]!r} on an earlier row of step {step}")
        if position in rows.setdefault(step, {}):
            raise ValueError(f"{where}: column 'position': {position} repeats in step {step}")
        seconds[step] = measured
        rows[step][position] = entry
    return [([batch[p] for p in sorted(batch)], seconds[s]) for s, batch in sorted(rows.items())]


def log_files(names: Iterable[str | Path]) -> list[Path]:
    """The step logs ``names`` stand for: a file as named, a directory's ``*.csv`` files,
    a glob pattern's matches (in sorted order).  ValueError for a name that stands for
    none."""
    files: list[Path] = []
    for name in map(str, names):
        if Path(name).is_dir():
            found = sorted(Path(name).glob("*.csv"))
        elif Path(name).exists():
            found = [Path(name)]
        else:
            found = sorted(map(Path, glob.glob(name)))
        if not found:
            raise ValueError(f"{name}: no step log there")
        files += found
    return files


def read_logs(names: Iterable[str | Path]) -> list[Step]:
    """Every step of the logs ``names`` stand for (``log_files``), merged (steps are
    independent records: a fit takes them one by one).  ValueError as ``read_steps``."""
    return [step for path in log_files(names) for step in read_steps(path)]


def whole_steps_end(data: bytes) -> int:
    """Where a log's whole steps end: before a last line without its newline and the rows
    of its step before it (a step is written in one piece).  O(rows of that step)."""
    end = data.rfind(b"\n") + 1
    if end == len(data):
        return end
    step, comma, _ = data[end:].partition(b",")
    first_row = data.find(b"\n") + 1
    while end > first_row:
        start = data.rfind(b"\n", 0, end - 1) + 1
        number = data[start:end].partition(b",")[0]
        if not (number == step if comma else number.startswith(step)):
            break
        end = start
    return end


def _continue_log(path: Path) -> int:
    """The next step number of an existing log; cuts a step cut short away."""
    try:
        with open(path, "rb+") as file:
            data = file.read()
            end = whole_steps_end(data)
            if end < len(data):
                file.truncate(end)
    except FileNotFoundError:
        return 0
    lines = data[:end].decode().splitlines()[1:]
    steps = [int(line.split(",", 1)[0]) for line in lines if line]
    return max(steps, default=-1) + 1


def _parse_row(row: dict[str, str | None], where: str) -> tuple[int, int, BatchEntry, float]:
    ints = {column: int(_number(row, column, where, int)) for column in _INT_COLUMNS}
    measured = _number(row, "seconds", where, float)
    group = row["group"]
    if not group:
        raise ValueError(f"{where}: column 'group': empty value")
    try:
        entry = BatchEntry(group, ints["shared_tokens"], ints["context_tokens"],
                           ints["new_tokens"])
    except ValueError as error:
        raise ValueError(f"{where}: column 'shared_tokens': {error}") from error
    return ints["step"], ints["position"], entry, measured


def _number(row: dict[str, str | None], column: str, where: str, kind: type) -> float:
    text = (row.get(column) or "").strip()
    try:
        value = kind(text)
    except ValueError:
        expected = "an integer" if kind is int else "a number"
        raise ValueError(f"{where}: column '{column}': expected {expected}, "
                         f"got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: column '{column}': expected a finite non-negative "
                         f"number, got {text!r}")
    return value
