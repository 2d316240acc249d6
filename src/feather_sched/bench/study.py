"""The benchmarks' harness: what the studies under ``benchmarks/`` share, written once.

A study declares its cells, its schedulers and its table's columns; this module does the
rest: **rounds** (``rounds`` groups the labels ``name#2``, ``name#3``, ... of a scheduler
run again into ``Runs``; a ratio is taken round by round, ``ratios``, before its median,
since round k of every scheduler ran minutes apart from round k + 1; a simulator study's
seeds play the same part); **figures and tables** (medians with their range, per-round
ratios, markdown tables, ``ratio_table``: medians and per-round ratios to a base
scheduler); **the simulator** (``sim_plan``: Llama-3-8B on a datasheet GPU with vLLM's
limits; ``summaries``, every scheduler's on one plan; ``offline_rate``, FCFS's offline
request rate that a study's loads are multiples of); **output** (``Study``: a run set's
folder ``benchmarks/<topic>/results/<set>/``, progress lines, each result as JSON with
the command that made it, and markdown).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from feather_sched.results.summary import (
    Summary,
    median_and_range,
    summarize,
    worst_group_ratios,
)
from feather_sched.sim.runner import SimPlan, simulate
from feather_sched.workloads.spec import Workload

T = TypeVar("T")
Runs = dict[str, list[Summary]]
"""Scheduler -> its summaries, one per round (or seed), in the same order for every one."""
Figure = str | Callable[[Mapping[str, Any]], float]
"""A summary's key, or a function of a summary (e.g. a priority class's throughput)."""
MODEL = "llama-3-8b"
"""The model every simulator study serves."""


# ---- rounds and figures -------------------------------------------------------------------


def rounds(labelled: Mapping[str, T]) -> dict[str, list[T]]:
    """``feather bench``'s labels (``name``, ``name#2``, ...) grouped by scheduler name, in
    the order the names first appear, each name's rounds in their order."""
    by_name: dict[str, list[T]] = {}
    for label, run in labelled.items():
        by_name.setdefault(label.split("#")[0], []).append(run)
    return by_name


def by_scheduler(per_seed: Iterable[Mapping[str, T]]) -> dict[str, list[T]]:
    """Seed by seed ``{scheduler: run}`` as ``Runs``: scheduler -> its run on each seed."""
    runs: dict[str, list[T]] = {}
    for seed in per_seed:
        for name, run in seed.items():
            runs.setdefault(name, []).append(run)
    return runs


def load_rounds(path: str | Path) -> Runs:
    """The rounds of a ``feather bench --json`` file."""
    return rounds(json.loads(Path(path).read_text())["runs"])


def value(run: Mapping[str, Any], figure: Figure) -> float:
    """``figure`` of one run's summary."""
    return run[figure] if isinstance(figure, str) else figure(run)


def median(runs: Iterable[Mapping[str, Any]], figure: Figure, fmt: str = "{:.2f}") -> str:
    """The median of ``figure`` over ``runs``, formatted (no range)."""
    return fmt.format(statistics.median(value(run, figure) for run in runs))


def ratios(ours: Sequence[Mapping[str, Any]], base: Sequence[Mapping[str, Any]],
           figure: Figure, *, strict: bool = True) -> list[float]:
    """Round by round, ``figure`` of ``ours`` over ``base``'s; rounds where the base's
    figure is 0 give no ratio.  ``strict``: both must have as many rounds (else the rounds
    both have)."""
    pairs = zip(ours, base, strict=strict)
    return [value(a, figure) / value(b, figure) for a, b in pairs if value(b, figure)]


def ratio(ours: Sequence[Mapping[str, Any]], base: Sequence[Mapping[str, Any]],
          figure: Figure, fmt: str = "{:.2f}", unit: str = "x", sep: str = "-",
          strict: bool = True) -> str:
    """The median (range) of the per-round ratios (``ratios``), e.g. ``1.12x (1.05-1.20)``:
    ``median_and_range``'s ``fmt``, ``unit`` and ``sep``."""
    return median_and_range(ratios(ours, base, figure, strict=strict), fmt, unit, sep)


def result_files(doc: str | None) -> list[tuple[Path, Runs]]:
    """A table script's arguments: the ``feather bench --json`` files named on its command
    line (``doc``'s first line its description), each with its rounds, in order."""
    arguments = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    arguments.add_argument("results", type=Path, nargs="+")
    return [(path, load_rounds(path)) for path in arguments.parse_args().results]


def pooled(sets: Iterable[Runs]) -> Runs:
    """The rounds of several sets as one: each set's rounds keep their pairs, so ratios
    are still taken round by round."""
    runs: Runs = {}
    for one in sets:
        for name, summaries_ in one.items():
            runs.setdefault(name, []).extend(summaries_)
    return runs


# ---- tables -------------------------------------------------------------------------------


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table (no trailing newline)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


Column = tuple[str, Callable[[T], str]]
"""A table column: its title and how one item gives its cell."""


def table(columns: Sequence[Column[T]], items: Iterable[T]) -> str:
    """A markdown table of ``items``, one row each, as ``columns`` declare."""
    return markdown_table([title for title, _ in columns],
                          ([cell(item) for _, cell in columns] for item in items))


FAIRNESS_TARGET = 1.25
"""Feather's fairness target: every prefix group's TTFT at most 1.25x its TTFT under FCFS."""


def fairness_cells(groups: Mapping[str, Mapping[str, float]],
                   fcfs: Mapping[str, Mapping[str, float]],
                   target: float = FAIRNESS_TARGET) -> list[str]:
    """Three cells of a run's groups (``summary["ttft_by_group"]``) against FCFS's: the
    majority's (group ``"0"``) mean / p99 TTFT in seconds, the worst minority's (the
    highest mean), and the worst ratio to FCFS over groups, mean / p99
    (``worst_group_ratios``), marked ``over`` past ``target``."""
    mean, p99 = worst_group_ratios(groups, fcfs)
    minority = max((g for k, g in groups.items() if k != "0"), key=lambda g: g["mean_ttft_ms"])
    verdict = "" if max(mean, p99) <= target else " over"

    def seconds(group: Mapping[str, float]) -> str:
        return f"{group['mean_ttft_ms'] / 1e3:.2f} / {group['p99_ttft_ms'] / 1e3:.2f}"

    return [seconds(groups["0"]), seconds(minority), f"{mean:.2f}x / {p99:.2f}x{verdict}"]


def ratio_table(runs: Runs, metric: str, base: str | None = None) -> str:
    """Per scheduler: its runs, the median ``metric`` with its range, the median (range)
    of its per-round ratio to ``base`` (default: the first scheduler), and its median
    preemptions (``preempted_medians``)."""
    base = base or next(iter(runs))
    if base not in runs:
        raise ValueError(f"no scheduler {base!r}: {', '.join(runs)}")
    header = ["scheduler", "runs", f"median {metric}", "min - max",
              f"median ratio to {base} (per round)", "ratio min - max",
              "median preempted (total / max / recomputed tok)"]
    rows = []
    for name, summaries_ in runs.items():
        values = [run[metric] for run in summaries_]
        per_round = ratios(summaries_, runs[base], metric, strict=False)
        rows.append([name, str(len(values)), f"{statistics.median(values):.1f}",
                     f"{min(values):.1f} - {max(values):.1f}",
                     f"{statistics.median(per_round):.3f}x",
                     f"{min(per_round):.3f} - {max(per_round):.3f}",
                     preempted_medians(summaries_)])
    return markdown_table(header, rows)


PREEMPTION_KEYS = ("preemptions", "max_preemptions_per_request", "recomputed_tokens")
"""A summary's preemption figures: total, the most on one request, tokens recomputed."""


def preempted_medians(runs: Sequence[Mapping[str, Any]]) -> str:
    """``total / max / recomputed`` of a scheduler's runs, each the median over them;
    ``n/a`` for a figure some run did not observe (or saved before it existed)."""
    parts = []
    for key in PREEMPTION_KEYS:
        values = [run.get(key) for run in runs]
        parts.append("n/a" if not values or None in values
                     else f"{statistics.median(values):,.0f}")
    return " / ".join(parts)


# ---- the simulator ------------------------------------------------------------------------


def sim_plan(workload: Workload, hardware: str = "h100-sxm", **options: Any) -> SimPlan:
    """``MODEL`` serving ``workload`` on ``hardware`` (a datasheet profile's name, or a
    hardware JSON) with vLLM's GPU limits and a KV pool of what the memory holds, unless
    ``options`` (``SimPlan.from_options``'s: ``num_blocks``, ``max_num_seqs``, ...) say
    otherwise."""
    return SimPlan.from_options(workload, hardware=hardware, model=MODEL, **options)


def summaries(plan: SimPlan, schedulers: Iterable[str]) -> dict[str, Summary]:
    """Each scheduler's summary on ``plan``, a fresh simulated engine each."""
    return {name: summarize(simulate(plan, name)) for name in schedulers}


def offline_rate(plan: SimPlan, scheduler: str = "fcfs") -> float:
    """Requests/s of ``scheduler`` on ``plan``'s workload (all at once, say): the capacity
    a study's loads are multiples of."""
    return summarize(simulate(plan, scheduler))["request_throughput"]


def parallel(task: Callable[[T], Any], tasks: Iterable[T], jobs: int) -> list[Any]:
    """``task`` of every item of ``tasks`` over ``jobs`` processes, results in order (a
    simulated run is single-threaded: cells in parallel use the cores)."""
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(task, tasks))


# ---- output -------------------------------------------------------------------------------


def parser(doc: str | None, *, seeds: int | None = None,
           jobs: int | None = None) -> argparse.ArgumentParser:
    """A study's argument parser: its docstring's first line, ``--set`` (the run set's
    name), and ``--seeds`` / ``--jobs`` with these defaults where given."""
    arguments = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    arguments.add_argument("--set", help="run set: results/SET/ beside the script "
                           "(default: the commit)")
    if seeds is not None:
        arguments.add_argument("--seeds", type=int, default=seeds,
                               help="workload seeds per cell")
    if jobs is not None:
        arguments.add_argument("--jobs", type=int, default=jobs, help="processes")
    return arguments


def command(script: str | Path, argv: Sequence[str] | None = None) -> str:
    """The command line that runs ``script`` (from the repository's root) with ``argv``
    (default: this process's arguments)."""
    path = Path(script).resolve()
    parts = path.parts
    where = (Path(*parts[parts.index("benchmarks"):]) if "benchmarks" in parts else path)
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join([where.as_posix(), *args])


def commit() -> str:
    """The repository's short commit (``unknown`` outside a git checkout), ``-dirty`` with
    uncommitted changes to tracked files: the default name of a run set."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no")
                       else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Study:
    """One run of a study: where its results go and how they are written.

    ``script`` is the study's file (``__file__``); its results go to ``folder``, by default
    ``results/<set>`` beside the script, ``set`` by default the commit (``commit()``).
    """

    def __init__(self, script: str | Path, folder: str | Path | None = None,
                 set_name: str | None = None, argv: Sequence[str] | None = None) -> None:
        here = Path(script).resolve().parent
        self.folder = Path(folder) if folder else here / "results" / (set_name or commit())
        self.command = command(script, argv)
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the study started."""
        return time.perf_counter() - self.started

    def progress(self, label: str) -> None:
        print(f"{label}: {self.elapsed():.0f} s", flush=True)

    def each(self, items: Iterable[T], label: Callable[[T], str] = str) -> Iterator[T]:
        """``items`` in turn, a progress line (with the time so far) after each."""
        for item in items:
            yield item
            self.progress(label(item))

    def path(self, name: str) -> Path:
        """A file of the run set (its folder made)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder / name

    def write_json(self, stem: str, document: Mapping[str, Any]) -> Path:
        """``STEM.json``: the command that made it, then ``document``."""
        path = self.path(f"{stem}.json")
        path.write_text(json.dumps({"command": self.command, **document}, indent=1) + "\n")
        return path

    def write_markdown(self, stem: str, text: str, *, echo: bool = True) -> Path:
        """``STEM.md`` (one newline at its end); ``echo``: print it too."""
        path = self.path(f"{stem}.md")
        path.write_text(text.rstrip("\n") + "\n")
        if echo:
            print(text.rstrip("\n"))
        return path

    def save(self, stem: str, document: Mapping[str, Any], text: str) -> None:
        """``STEM.json`` and ``STEM.md``, the table printed."""
        self.write_json(stem, document)
        self.write_markdown(stem, text)
