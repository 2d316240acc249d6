"""The cost of finding a step's prefix groups in a block table, on the host.

Every decode step of an engine with shared-prefix attention on asks ``find_groups`` which
rows share leading blocks.  On a GPU its blocks are 16 tokens, so a row of 32K tokens has
2,048 columns; the cost must grow with the blocks rows share, not with their context.
Each cell is a batch of ``rows`` decode rows of ``context`` tokens in 16-token blocks,
block ids shuffled over the pool:

* ``half``: 8 groups, each row sharing the first half of its context with its group (the
  case measured against the first GPU review: 81 ms at 1,024 x 32K);
* ``nested``: every row shares a 1K-token system prompt, 8 documents of half the context
  below it;
* ``none``: rows share nothing (settled on the first blocks alone).

Two layouts: ``batch``, the table gathered in batch order (``[rows, context / 16]``, what
the CPU builder holds); ``slots``, the way the GPU builder calls it from the host mirror
of Model Runner V2's table (``integrations.vllm.host_tables``): a ``[1024 slots, 2048]``
table (max_num_seqs 1,024, max_model_len 32K), the batch's rows in random slots
(``req_idx``, passed as ``table_rows``), every other slot and column stale.

A timing is the median of ``--reps`` calls; every cell is timed in ``--rounds`` rounds,
one cell after another (so rounds are seconds apart), and the table gives the median of
the rounds with their range.  ``--against REV`` also times ``find_groups`` as it stands at
git revision REV on the ``batch`` layout, side by side in the same run, and checks both
find groups that save the same number of prefix reads or say which saves more.

    .venv/bin/python benchmarks/attention/grouping.py                    # ~10 s
    .venv/bin/python benchmarks/attention/grouping.py --against 19181e7  # beside the old

Targets (issue 42, for ``half``, either layout): 1,024 rows x 32K at most 1 ms, 256 x 4K
at most 0.2 ms.  Writes
grouping.json and grouping.md into results/SET/ (``--set``, default the commit).
"""

from __future__ import annotations

import importlib.util
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

from feather_sched.attention import groups as current
from feather_sched.bench.study import Study, markdown_table
from feather_sched.bench.study import parser as study_parser
from feather_sched.results.summary import median_and_range

BLOCK = 16
GROUPS = 8
SYSTEM_TOKENS = 1024
ROWS = (256, 1024)
CONTEXTS = (4096, 32768)
SHAPES = ("half", "nested", "none")
SLOTS, SLOT_WIDTH = 1024, 32768 // BLOCK
"""The ``slots`` layout's table: max_num_seqs x max_model_len / BLOCK."""
SLOT_SHAPES = ("half", "none")
TARGETS_MS = {(1024, 32768): 1.0, (256, 4096): 0.2}
"""Issue 42's targets, for the ``half`` shape."""
Cell = tuple[str, str, int, int]
"""(layout, shape, rows, context)."""


def batch(shape: str, rows: int, context: int, seed: int = 0
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block table, sequence lengths, query lengths) of one decode step."""
    rng = np.random.default_rng(seed)
    width = context // BLOCK
    ids = rng.permutation(rows * width * 2).astype(np.int32)
    table = ids[:rows * width].reshape(rows, width).copy()
    spare = iter(ids[rows * width:].reshape(-1, width))
    group = np.arange(rows) % GROUPS
    if shape in ("half", "nested"):
        documents = [next(spare) for _ in range(GROUPS)]
        for g in range(GROUPS):
            table[group == g, :width // 2] = documents[g][:width // 2]
    if shape == "nested":
        table[:, :SYSTEM_TOKENS // BLOCK] = next(spare)[:SYSTEM_TOKENS // BLOCK]
    seq_lens = np.full(rows, context, dtype=np.int32)
    return table, seq_lens, np.ones(rows, dtype=np.int32)


def in_slots(table: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``table``'s rows in random rows of a ``[SLOTS, SLOT_WIDTH]`` table of stale ids,
    and the row each batch row reads there (as ``req_idx``)."""
    rng = np.random.default_rng(seed + 1)
    slots = rng.permutation(SLOTS)[:len(table)]
    mirror = rng.integers(1, 1 << 20, (SLOTS, SLOT_WIDTH), dtype=np.int32)
    mirror[slots, :table.shape[1]] = table
    return mirror, slots


def timed_ms(find: Callable[[], object], reps: int) -> float:
    """Median milliseconds of one ``find()`` call (after one untimed call)."""
    find()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        find()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def finder(module: ModuleType, cell: Cell) -> Callable[[], current.Groups]:
    """``module.find_groups`` on the cell's step, as the cell's layout calls it."""
    layout, shape, rows, context = cell
    table, seq_lens, query_lens = batch(shape, rows, context)
    min_blocks = current.min_blocks(BLOCK)
    if layout == "batch":
        return lambda: module.find_groups(table, seq_lens, query_lens, BLOCK, min_blocks)
    mirror, slots = in_slots(table)
    return lambda: module.find_groups(mirror, seq_lens, query_lens, BLOCK, min_blocks,
                                      table_rows=slots)


def saved_reads(found: current.Groups) -> int:
    """Prefix block reads the groups save: (members - 1) x shared blocks, summed."""
    return int(((found.sizes() - 1) * found.shared).sum())


def at_revision(revision: str) -> ModuleType:
    """``attention/groups.py`` as it stands at git ``revision``, as a module."""
    source = subprocess.run(["git", "show", f"{revision}:src/feather_sched/attention/groups.py"],
                            capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parent).stdout
    path = Path(tempfile.mkdtemp()) / f"groups_{revision}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"groups_{revision}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def cells() -> list[Cell]:
    return [(layout, shape, rows, context)
            for layout, shapes in (("batch", SHAPES), ("slots", SLOT_SHAPES))
            for shape in shapes for rows in ROWS for context in CONTEXTS]


def main() -> None:
    arguments = study_parser(__doc__)
    arguments.add_argument("--reps", type=int, default=21)
    arguments.add_argument("--rounds", type=int, default=3)
    arguments.add_argument("--against", metavar="REV", help="also time find_groups at REV")
    args = arguments.parse_args()
    study = Study(__file__, set_name=args.set)
    old = at_revision(args.against) if args.against else None
    records = []
    for cell in cells():
        layout, shape, rows, context = cell
        found = finder(current, cell)()
        record = {"layout": layout, "shape": shape, "rows": rows, "context": context,
                  "ms": [], "groups": len(found), "saved_reads": saved_reads(found)}
        if old is not None and layout == "batch":
            record.update(old_ms=[], old_saved_reads=saved_reads(finder(old, cell)()))
        records.append(record)
    for round_ in range(args.rounds):
        for cell, record in zip(cells(), records, strict=True):
            record["ms"].append(timed_ms(finder(current, cell), args.reps))
            if "old_ms" in record:
                record["old_ms"].append(timed_ms(finder(old, cell), args.reps))
        study.progress(f"round {round_ + 1}")
    header = ["layout", "shape", "rows", "context", "groups", "ms", "target"]
    if old is not None:
        header += [f"at {args.against} ms", "speed-up", "reads saved (old)"]
    lines = []
    for r in records:
        ms = statistics.median(r["ms"])
        target = TARGETS_MS.get((r["rows"], r["context"])) if r["shape"] == "half" else None
        cells_ = [r["layout"], r["shape"], str(r["rows"]), str(r["context"]), str(r["groups"]),
                  median_and_range(r["ms"], "{:.3f}"), "-" if target is None else
                  f"<= {target} ms: {'met' if ms <= target else 'missed'}"]
        if old is not None:
            cells_ += ["-", "-", "-"] if "old_ms" not in r else [
                median_and_range(r["old_ms"], "{:.3f}"),
                f"{statistics.median(r['old_ms']) / ms:.1f}x",
                f"{r['saved_reads']} ({r['old_saved_reads']})"]
        lines.append(cells_)
    text = (f"find_groups on {platform.processor() or platform.machine()}, median of "
            f"{args.rounds} rounds (range), each the median of {args.reps} calls, "
            f"{BLOCK}-token blocks\n\n" + markdown_table(header, lines))
    study.save("grouping", {"block": BLOCK, "reps": args.reps, "rounds": args.rounds,
                            "slots": [SLOTS, SLOT_WIDTH], "against": args.against,
                            "records": records}, text)


if __name__ == "__main__":
    main()
