"""The shared-prefix attention self-check: on this device, at this engine's shapes, is
Feather's path exact and faster than the engine's own kernel, and from what prefix on?

An adapter describes its engine as a ``Subject``: the shapes (device, query and KV heads,
head size, dtype, block size, KV layout, the most rows a step holds), and a ``Trial`` per
cell of a grid (a decode step of ``groups`` x ``per_group`` rows sharing a ``prefix``-token
prefix on a random paged cache with permuted block ids) that runs the engine's kernel on
the whole batch and the shared-prefix path (the engine's kernel on the batch with the
grouped rows cut, then the groups).  ``check`` runs exactness first (every cell against the
engine's kernel; float64 where the trial has a reference), then times both paths over the
grid, and returns a ``Verdict``: on only where every cell is exact and the path is faster,
each group size grouped from its measured break-even.  ``cached_check`` keeps verdicts per
device, versions and shapes (one JSON file each), so a restart costs nothing.
Engine-agnostic: imports torch only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from feather_sched.attention.groups import NEVER, BySize, required_tokens
from feather_sched.telemetry.files import read_json, replace_atomically

logger = logging.getLogger("feather_sched")

FORMAT = "feather-attention-check"
VERSION = 2
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}
"""Largest relative difference (per row, L2) from the engine's kernel that counts as exact:
what rounding in the dtype allows, orders of magnitude under a wrong block or mask."""
MARGIN = 0.10
"""A cell counts as faster only at a speed-up of at least 1 + this: a shared host's timing
noise (at 5%, one check in three on an AMX Xeon turned on a cell the benchmark then
measured at 0.99x, benchmarks/attention/results/amx-4f044c6)."""


@dataclass(frozen=True)
class Shapes:
    """What the verdict holds for: the device, the engine's attention shapes, versions."""

    device: str
    q_heads: int
    """Query heads per rank."""
    kv_heads: int
    """KV heads per rank."""
    head_dim: int
    dtype: str
    block_size: int
    layout: str
    """The KV layout the path reads (e.g. vLLM's CPU "vec" or "amx")."""
    max_rows: int
    """The most rows a step holds (the engine's ``max_num_seqs``)."""
    max_context: int
    """The longest row (the engine's ``max_model_len``)."""
    versions: tuple[tuple[str, str], ...] = ()
    """(package, version) of what the kernels come from."""

    def key(self) -> str:
        """A file name for these shapes: a digest of every field."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def describe(self) -> str:
        return (f"{self.q_heads}q/{self.kv_heads}kv/d{self.head_dim} {self.dtype}, block "
                f"{self.block_size}, layout {self.layout}")


@dataclass(frozen=True)
class Cell:
    """One decode step of the grid: ``groups`` groups of ``per_group`` rows, each row a
    ``prefix``-token shared prefix and a ``suffix``-token suffix of its own."""

    prefix: int
    groups: int
    per_group: int
    suffix: int = 96

    @property
    def rows(self) -> int:
        return self.groups * self.per_group

    @property
    def length(self) -> int:
        """Tokens of each row's context, this step's included."""
        return self.prefix + self.suffix + 1

    def referenced(self, max_tokens: int) -> bool:
        """Whether a float64 reference is computed for this cell: at most ``max_tokens``
        rows x context and ``REFERENCE_CONTEXT`` tokens a row (its host memory grows with
        the context; it is slow)."""
        return self.rows * self.length <= max_tokens and self.length <= REFERENCE_CONTEXT

    @property
    def idle(self) -> bool:
        """Rows that share nothing (groups of one): the path cannot act."""
        return self.per_group == 1

    def describe(self) -> str:
        return f"{_tokens(self.prefix)} {self.groups}x{self.per_group}"


class Trial(Protocol):
    """One cell's batch on the device."""

    def engine(self) -> torch.Tensor:
        """The engine's kernel on the whole batch: the output, ``[rows, heads, dim]``."""

    def shared(self) -> torch.Tensor:
        """The shared-prefix path on the same batch: the output."""

    def reference(self) -> torch.Tensor | None:
        """A float64 reference output, where the trial has one (small cells)."""


class Subject(Protocol):
    """An engine's attention as the self-check sees it."""

    shapes: Shapes
    idle_cost: bool
    """Whether the path costs something on a step where nothing groups (``IDLE_CELL``)."""

    def trial(self, cell: Cell, seed: int) -> Trial: ...

    def seconds(self, run: Callable[[], object], reps: int) -> float:
        """Median seconds of ``run`` over ``reps`` calls (after a warm-up call), timed as
        the engine runs it: on a GPU a CUDA graph replay (``timing.GraphTimer``), else
        wall time. A subject may also have ``host_seconds`` (same signature): the host
        cost of an eager call, for steps the engine does not replay as one graph."""


REFERENCE_CONTEXT = 2048
"""The longest row a cell's float64 reference is computed over (``Cell.referenced``)."""
EXACTNESS_CELLS = (Cell(300, 3, 5, suffix=33), Cell(1024, 1, 2, suffix=1),
                   Cell(640, 2, 20, suffix=200))
"""Cells checked for exactness only: a prefix ending mid-block, the smallest group with a
suffix of one token, larger groups with long suffixes."""
GRID = tuple(Cell(prefix, groups, per_group) for prefix in (512, 1024, 2048, 4096, 8192)
             for groups, per_group in ((1, 4), (1, 16)))
"""The timed cells: prefix lengths from under to over a typical break-even, for a lone
group of each size: the least a step with such groups saves against the path's fixed
costs (the cut batch's pass, the merge), so each size's break-even holds for any number
of its groups."""
GRID_SIZES = tuple(sorted({cell.per_group for cell in GRID}))
"""The group sizes the grid measures: what tensor-parallel ranks vote on (``agreed``)."""
IDLE_CELL = Cell(1024, 16, 1)
"""A step whose rows share nothing (``Cell.idle``): what the path costs where it cannot act
(on a GPU, its launches with no work, captured in the engine's graphs), timed for subjects
that have such a cost (``Subject.idle_cost``)."""
IDLE_MARGIN = 0.05
"""The path is off where the idle step is slower than the engine's by more than this."""


@dataclass(frozen=True)
class CellResult:
    cell: Cell
    error: float
    """Largest per-row relative difference from the engine's kernel."""
    reference_error: float | None
    """Largest per-row relative difference of the path from float64 (where checked)."""
    engine_s: float | None = None
    shared_s: float | None = None
    """Seconds per call as the engine runs it (a graph replay where it replays graphs)."""
    engine_host_s: float | None = None
    shared_host_s: float | None = None
    """Host seconds to issue an eager call (steps the engine does not replay as a whole
    graph), where the subject measures it (``timing.GraphTimer.host_seconds``)."""

    @property
    def speedup(self) -> float | None:
        if self.engine_s is None or not self.shared_s:
            return None
        return self.engine_s / self.shared_s

    @property
    def extra_host_s(self) -> float | None:
        """What the path's eager launches add on the host, where measured."""
        if self.engine_host_s is None or self.shared_host_s is None:
            return None
        return self.shared_host_s - self.engine_host_s

    @property
    def faster(self) -> bool:
        """Faster by ``MARGIN``, and (where eager host time is measured) saving more
        device time than its launches add on the host: a step run eagerly pays both."""
        if self.speedup is None or self.speedup < 1 + MARGIN:
            return False
        extra = self.extra_host_s
        return extra is None or self.engine_s - self.shared_s >= extra


@dataclass(frozen=True)
class Verdict:
    """Whether the path acts on these shapes, why, and from what shared prefix."""

    on: bool
    reason: str
    """Why, in a few words (the figures are in ``line``)."""
    min_shared_tokens: int | None
    """The shortest prefix worth any group (the least of ``by_size``); None when off."""
    shapes: Shapes
    cells: tuple[CellResult, ...] = ()
    seconds: float = 0.0
    """How long the check took."""
    cached: bool = field(default=False, compare=False)
    """Read from the cache rather than measured now."""
    peak_device_bytes: int | None = None
    """The device memory the check allocated at its peak, where measured (a GPU:
    ``gpu_check.check_measuring_memory``), to compare with ``check_memory``'s plan."""
    peak_host_bytes: int | None = None
    """The check's process's own peak resident memory, where it ran in one
    (``isolation.run_isolated``)."""
    by_size: BySize = ()
    """The break-even per group size measured (``groups.BySize``: groups of at least so
    many rows from so many shared tokens, None where never); empty: ``min_shared_tokens``
    for every group."""

    @property
    def max_error(self) -> float:
        return max((c.error for c in self.cells), default=0.0)

    def groups(self, rows: int, shared_tokens: int) -> bool:
        """Whether ``auto`` under this verdict groups ``rows`` rows sharing
        ``shared_tokens`` tokens (``groups.worth_by_size``)."""
        if not self.on or shared_tokens < (self.min_shared_tokens or 0):
            return False
        return not self.by_size or \
            int(required_tokens(self.by_size, np.array([rows]))[0]) <= shared_tokens

    def required(self, sizes: Sequence[int]) -> list[int]:
        """The shared tokens this verdict asks of a group of each of ``sizes`` rows
        (``groups.NEVER`` where it groups none of that size, or none at all)."""
        if not self.on or self.min_shared_tokens is None:
            return [NEVER] * len(sizes)
        if not self.by_size:
            return [self.min_shared_tokens] * len(sizes)
        return required_tokens(self.by_size, np.array(sizes)).tolist()

    def line(self, *notes: str) -> str:
        """The engine log's line: the verdict with its figures (and ``notes``, such as the
        engine's CUDA-graph mode)."""
        timed = [c for c in self.cells if c.speedup is not None and not c.cell.idle]
        idle = [c for c in self.cells if c.speedup is not None and c.cell.idle]
        figures = [f"max error {self.max_error:.1e} vs the engine's kernel "
                   f"(tolerance {TOLERANCE.get(self.shapes.dtype, 0):.0e})"]
        if timed:
            best = max(timed, key=lambda c: c.speedup)
            worst = min(timed, key=lambda c: c.speedup)
            figures.append(f"{best.speedup:.2f}x at {best.cell.describe()}, "
                           f"{worst.speedup:.2f}x at {worst.cell.describe()}")
        if self.min_shared_tokens is not None:
            figures.append(f"groups from {self.min_shared_tokens} shared tokens")
        if len(self.by_size) > 1:
            figures.append("by size: " + ", ".join(
                f"{rows}+ rows from {'never' if tokens is None else tokens}"
                for rows, tokens in self.by_size))
        figures.extend(f"{c.speedup:.2f}x where nothing groups" for c in idle)
        extra = [c.extra_host_s for c in timed if c.extra_host_s is not None]
        if extra:
            figures.append(f"eager launches +{1e6 * max(extra):.0f} us on the host")
        if self.peak_device_bytes is not None:
            figures.append(f"peak device memory {self.peak_device_bytes / (1 << 20):.0f} MiB")
        if self.peak_host_bytes is not None:
            figures.append(f"its process's peak host memory "
                           f"{self.peak_host_bytes / (1 << 20):.0f} MiB")
        figures.extend(notes)
        how = "cached" if self.cached else f"{self.seconds:.1f} s"
        return (f"{'on' if self.on else 'off'} (self-check on {self.shapes.device}, "
                f"{self.shapes.describe()}: {self.reason}; {'; '.join(figures)}; {how})")

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> Verdict:
        """A verdict ``to_json`` wrote; ValueError for anything else."""
        def build(shapes: Shapes) -> Verdict:
            cells = tuple(CellResult(**{**c, "cell": Cell(**c["cell"])}) for c in data["cells"])
            return cls(on=bool(data["on"]), reason=str(data["reason"]),
                       min_shared_tokens=data["min_shared_tokens"], shapes=shapes,
                       cells=cells, seconds=float(data["seconds"]),
                       peak_device_bytes=data.get("peak_device_bytes"),
                       peak_host_bytes=data.get("peak_host_bytes"),
                       by_size=tuple((rows, tokens) for rows, tokens in data["by_size"]))

        return read_kept(data, FORMAT, VERSION, build)


def read_kept(data: Any, kind: str, version: int, build: Callable[[Shapes], Any]) -> Any:
    """``build(shapes)`` of a kept file's JSON ``data`` of format ``kind`` at ``version``
    (its ``shapes`` read back); ValueError for anything else or anything malformed."""
    if not isinstance(data, dict) or data.get("format") != kind or \
            data.get("version") != version:
        raise ValueError(f"not a {kind} version {version} file")
    try:
        shapes = data["shapes"]
        return build(Shapes(**{**shapes, "versions": tuple(map(tuple, shapes["versions"]))}))
    except (KeyError, TypeError) as error:
        raise ValueError(f"malformed {kind} file: {error}") from None


def relative_error(output: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest per-row (L2 over heads and dims) relative difference; inf for a NaN."""
    output, expected = output.double().flatten(1), expected.double().flatten(1)
    error = (output - expected).norm(dim=1) / expected.norm(dim=1).clamp_min(1e-30)
    worst = float(error.max()) if len(error) else 0.0
    return worst if math.isfinite(worst) else math.inf


def fitting(cells: Iterable[Cell], shapes: Shapes) -> list[Cell]:
    """The cells the engine can hold: at most ``max_rows`` rows of at most
    ``max_context`` tokens."""
    return [cell for cell in cells if cell.rows <= shapes.max_rows and
            cell.length <= shapes.max_context]


def check(subject: Subject, grid: Sequence[Cell] = GRID,
          exactness: Sequence[Cell] = EXACTNESS_CELLS, idle: Sequence[Cell] = (IDLE_CELL,),
          reps: int = 5) -> Verdict:
    """Exactness on every cell (``exactness``, ``grid`` and, for a subject with an
    ``idle_cost``, ``idle``), then the timed comparison over ``grid`` and ``idle``; the
    verdict (see the module docstring).  O(cells x reps) kernel runs."""
    started = time.perf_counter()
    shapes = subject.shapes
    tolerance = TOLERANCE.get(shapes.dtype, TOLERANCE["float32"])
    cells = cells_to_run(shapes, grid, exactness, idle, subject.idle_cost)
    if not any(cell in grid for cell in cells):
        return _verdict(shapes, False, "no cell of the grid fits this engine", (), [],
                        started)
    timed = {*grid, *idle}
    results = []
    for index, cell in enumerate(cells):
        result = _run_cell(subject, cell, index, cell in timed, reps)
        results.append(result)
        if result.error > tolerance or (result.reference_error or 0) > tolerance:
            return _verdict(shapes, False, f"not exact at {cell.describe()}", (), results,
                            started)
    return decide(shapes, results, started)


def cells_to_run(shapes: Shapes, grid: Sequence[Cell] = GRID,
                 exactness: Sequence[Cell] = EXACTNESS_CELLS,
                 idle: Sequence[Cell] = (IDLE_CELL,), idle_cost: bool = True) -> list[Cell]:
    """The cells ``check`` runs for these shapes, in order: the exactness cells, the grid
    and (``idle_cost``) the idle step, each where the engine can hold it; none where no
    grid cell fits."""
    grid = fitting(grid, shapes)
    if not grid:
        return []
    return [*fitting(exactness, shapes), *grid, *(fitting(idle, shapes) if idle_cost else [])]


def _run_cell(subject: Subject, cell: Cell, seed: int, timed: bool, reps: int) -> CellResult:
    """One cell's exactness (and timing, where ``timed``). Its trial lives only here: one
    cell's memory at a time, whatever the grid."""
    trial = subject.trial(cell, seed=seed)
    expected = trial.engine().clone()  # a trial may reuse one output buffer
    output = trial.shared().clone()
    error = relative_error(output, expected)
    reference = trial.reference()
    reference_error = None if reference is None else relative_error(output, reference)
    result = CellResult(cell, error, reference_error)
    tolerance = TOLERANCE.get(subject.shapes.dtype, TOLERANCE["float32"])
    if timed and error <= tolerance and (reference_error or 0) <= tolerance:
        result = replace(result, engine_s=subject.seconds(trial.engine, reps),
                         shared_s=subject.seconds(trial.shared, reps))
        host_seconds = getattr(subject, "host_seconds", None)
        if host_seconds is not None:
            result = replace(result, engine_host_s=host_seconds(trial.engine, reps),
                             shared_host_s=host_seconds(trial.shared, reps))
    return result


def decide(shapes: Shapes, results: Sequence[CellResult],
           started: float | None = None) -> Verdict:
    """The verdict from exact, timed cells: off where the idle step (if timed) is slower by
    more than ``IDLE_MARGIN``; else, per group size (``Cell.per_group``), the break-even:
    the shortest timed prefix from which every cell of that size, that prefix and longer,
    is faster by ``MARGIN`` (a larger size at most a smaller one's: more rows save more);
    on where any size has one, off where none does."""
    timed = [r for r in results if r.speedup is not None and not r.cell.idle]
    idle = [r for r in results if r.speedup is not None and r.cell.idle]
    slowest = min(idle, key=lambda r: r.speedup, default=None)
    if slowest is not None and slowest.speedup < 1 - IDLE_MARGIN:
        return _verdict(shapes, False, f"exact, but {slowest.speedup:.2f}x the engine's "
                        "kernel on a step where nothing groups", (), results, started)
    by_size: list[tuple[int, int | None]] = []
    for size in sorted({r.cell.per_group for r in timed}):
        tokens = break_even([r for r in timed if r.cell.per_group == size])
        smaller = by_size[-1][1] if by_size else None
        if smaller is not None and (tokens is None or tokens > smaller):
            tokens = smaller
        by_size.append((size, tokens))
    if any(tokens is not None for _, tokens in by_size):
        return _verdict(shapes, True, "exact, and faster from the break-even",
                        tuple(by_size), results, started)
    return _verdict(shapes, False, "exact, but not faster than the engine's kernel", (),
                    results, started)


def break_even(timed: Sequence[CellResult]) -> int | None:
    """The shortest prefix from which every one of ``timed``, that prefix and longer, is
    faster (``CellResult.faster``); None where none is."""
    for prefix in sorted({r.cell.prefix for r in timed}):
        if all(r.faster for r in timed if r.cell.prefix >= prefix):
            return prefix
    return None


def _verdict(shapes: Shapes, on: bool, reason: str, by_size: BySize,
             results: Sequence[CellResult], started: float | None) -> Verdict:
    seconds = 0.0 if started is None else time.perf_counter() - started
    least = min((tokens for _, tokens in by_size if tokens is not None), default=None)
    return Verdict(on, reason, least, shapes, tuple(results), seconds,
                   by_size=by_size if len(by_size) > 1 else ())


def checked(measure: Callable[[], Verdict],
            agree: Callable[[Verdict | None], Verdict | None] = lambda verdict: verdict
            ) -> tuple[Verdict | None, str | None]:
    """``measure()``'s verdict, passed through ``agree`` (the engine's tensor-parallel vote;
    None, a check that failed, votes off), and why ``auto`` stays off (None where on).  A
    measurement that raises is logged and votes off, never raised: an optional check never
    takes the engine down, and every rank votes, so none waits on another's failed check."""
    verdict, reason = None, None
    try:
        verdict = measure()
    except Exception as error:
        logger.warning("Feather's attention self-check failed", exc_info=error)
        reason = f"off: the self-check could not run ({error})"
    verdict = agree(verdict)
    if reason is None and verdict is not None and not verdict.on:
        reason = verdict.line()
    return verdict, reason


def agreed(verdict: Verdict | None, group: object | None) -> Verdict | None:
    """One verdict for every tensor-parallel rank of ``group`` (a ``torch.distributed``
    process group on the host, gloo: the engine's; None or one rank: ``verdict`` as it
    is). Each rank measured its own; None, a check that failed, votes off: on only if
    every rank is on, from the longest break-even any rank found for each group size
    (``GRID_SIZES``). The ranks must agree, or they would compute different batches'
    attention differently. The one place vLLM's and SGLang's adapters vote; every rank
    calls it, whatever its check did."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return verdict
    on = verdict is not None and verdict.on
    asked = verdict.required(GRID_SIZES) if on and verdict else [0] * len(GRID_SIZES)
    votes = torch.tensor([0 if on else 1, *asked], dtype=torch.int64)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    off, *tokens = (int(v) for v in votes)
    if verdict is None:
        return None
    if off and on:
        return replace(verdict, on=False, reason="another tensor-parallel rank found it off",
                       min_shared_tokens=None, by_size=())
    if not on:
        return verdict
    by_size = tuple((s, None if t == NEVER else t) for s, t in zip(GRID_SIZES, tokens,
                                                                     strict=True))
    return replace(verdict, min_shared_tokens=min(t for _, t in by_size if t is not None),
                   by_size=by_size)


def tp_vote(verdict: Verdict | None, parallel_state: Any) -> Verdict | None:
    """``agreed`` over an engine's tensor-parallel group: ``parallel_state`` is vLLM's
    ``vllm.distributed.parallel_state`` or SGLang's ``sglang.srt.distributed.
    parallel_state`` (both have ``model_parallel_is_initialized`` and ``get_tp_group().
    cpu_group``, the host-side group); before the engine's model parallelism is set up,
    ``verdict`` as it is. Both adapters vote through here, the same way: every rank runs
    its own check (in its own process, on its own GPU) and takes the one answer."""
    if not parallel_state.model_parallel_is_initialized():
        return verdict
    return agreed(verdict, parallel_state.get_tp_group().cpu_group)


def device_name(device: torch.device | str) -> str:
    """The GPU's name, or the CPU's model (``/proc/cpuinfo``; else what ``platform``
    says): what a verdict is kept per."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    models = [line.partition(":")[2].strip() for line in text.splitlines()
              if line.startswith("model name")]
    return models[0] if models else platform.processor() or platform.machine()


def device_facts(device: torch.device | str) -> tuple[tuple[str, str], ...]:
    """What else a verdict on ``device`` depends on, for its key: Triton's version (the
    kernels' compiler) and, on a GPU, its SM count (a MIG slice shares the GPU's name) and
    the driver's version."""
    facts = []
    try:
        import triton

        facts.append(("triton", triton.__version__))
    except ImportError:
        pass
    device = torch.device(device)
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        facts += [("sms", str(properties.multi_processor_count)),
                  ("driver", driver_version())]
    return tuple(facts)


def driver_version() -> str:
    """The CUDA driver's version (``cuDriverGetVersion``), or "unknown"."""
    import ctypes

    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return str(version.value)
    except OSError:
        pass
    return "unknown"


GPU_SOURCES = ("triton_kernels.py", "triton_jit.py", "gpu_decode.py", "groups.py")
CPU_SOURCES = ("cpu_prefix_kernel.cpp", "cpu_kernel.py", "groups.py", "partials.py")


def kernel_digest(sources: tuple[str, ...] = GPU_SOURCES) -> str:
    """A digest of a path's sources (files of ``feather_sched.attention``: the GPU path's by
    default, ``CPU_SOURCES`` for the CPU kernel's), so a changed kernel is checked again."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in sources:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """Where verdicts are kept: ``$FEATHER_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, then ``feather-sched/attention-check``."""
    root = os.environ.get("FEATHER_CACHE_DIR")
    if root:
        return Path(root) / "attention-check"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "feather-sched" / "attention-check"


_measured: dict[Path, Verdict] = {}
"""Verdicts this process measured or read, by their cache file (the cache directory and
the shapes): an engine that builds its attention builders twice at start (vLLM's Model
Runner V2) checks once, even where the directory cannot be written."""
_failed: dict[Path, Exception] = {}
"""Checks that raised in this process, by cache file: raised again, not run again."""


def cached_check(subject: Any, run: Callable[[Any], Verdict] = check) -> Verdict:
    """The verdict for ``subject``'s shapes (``subject``: anything with ``shapes``, e.g.
    an ``isolation.Recipe``, that ``run`` measures): this process's, else the cached
    one, else ``run(subject)``, kept for next time (a file that cannot be read is
    measured again; one that cannot be written is logged, never raised)."""
    path = cache_dir() / f"{subject.shapes.key()}.json"
    if path in _failed:
        raise _failed[path]
    if path in _measured and _measured[path].shapes == subject.shapes:
        return replace(_measured[path], cached=True)
    try:
        _measured[path] = verdict = _kept_or_run(subject, run, path)
    except Exception as error:  # failed once, failed for this process (no second hang)
        _failed[path] = error
        raise
    return verdict


def _kept_or_run(subject: Subject, run: Callable[[Subject], Verdict], path: Path) -> Verdict:
    try:
        verdict = Verdict.from_json(read_json(path))
        if verdict.shapes == subject.shapes:
            return replace(verdict, cached=True)
    except (OSError, ValueError):
        pass
    verdict = run(subject)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, json.dumps(verdict.to_json(), indent=1) + "\n")
    except OSError as error:
        logger.warning("Feather could not keep its attention self-check in %s: %s", path,
                       error)
    return verdict


def table(verdict: Verdict) -> str:
    """The grid as a markdown table: cell, error, timings, speed-up."""
    lines = ["| prefix | groups x rows | max error | float64 error | engine ms | "
             "shared ms | speed-up |", "|---|---|---|---|---|---|---|"]
    for r in verdict.cells:
        ms = [f"{1e3 * s:.3f}" if s is not None else "-" for s in (r.engine_s, r.shared_s)]
        lines.append(f"| {r.cell.prefix} | {r.cell.groups} x {r.cell.per_group} | "
                     f"{r.error:.1e} | "
                     f"{'-' if r.reference_error is None else f'{r.reference_error:.1e}'} | "
                     f"{ms[0]} | {ms[1]} | "
                     f"{'-' if r.speedup is None else f'{r.speedup:.2f}x'} |")
    return "\n".join(lines)


def median_seconds(run: Callable[[], object], reps: int,
                   sync: Callable[[], object] = lambda: None) -> float:
    """Median wall seconds of ``run`` (``sync`` after each: a device's queue drained)."""
    run()
    sync()
    times = []
    for _ in range(reps):
        begun = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - begun)
    return statistics.median(times)


def _tokens(count: int) -> str:
    return f"{count // 1024}K" if count % 1024 == 0 else str(count)
