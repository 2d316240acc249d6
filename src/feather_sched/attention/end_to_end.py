"""The end-to-end proof a GPU engine's ``auto`` waits for: the user's model run greedily
with the shared-prefix path on and off, over grouped and ungrouped batches, under the
engine's own CUDA-graph mode, its outputs compared token for token and both runs timed.

The kernel self-check (``selfcheck``) times the kernels alone; it cannot see a FULL
graph replaying stale work, the host mirror of the block tables, or anything else only a
whole engine does.  So on CUDA ``auto`` acts only where this proof passed on the machine
(``kept``, under the kernel check's key: the same device, versions and shapes).  How the
engine is run is the adapter's (``Runs``); the comparison, the verdict and where it is
kept are here.  Engine-agnostic: no engine is imported.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from feather_sched.attention.selfcheck import Shapes, cache_dir, read_kept
from feather_sched.telemetry.files import read_json, replace_atomically

logger = logging.getLogger(__name__)

FORMAT = "feather-end-to-end-check"
VERSION = 1

Outputs = list[list[int]]
"""Each prompt's generated token ids, in the prompts' order."""
Runs = Callable[[bool], tuple[Outputs, float]]
"""Runs the engine over the check's prompts with the path on (True) or off, greedily: the
outputs and the seconds the run took."""


@dataclass(frozen=True)
class EndToEnd:
    """Whether the path gave the engine's own tokens end to end, and the runs' times."""

    passed: bool
    reason: str
    shapes: Shapes
    tokens: int
    """Tokens compared (both runs', prompt by prompt)."""
    seconds_on: float
    seconds_off: float

    def line(self) -> str:
        """The figures, for the engine log and the command's output."""
        speed = self.seconds_off / self.seconds_on if self.seconds_on > 0 else float("nan")
        return (f"end-to-end check {'passed' if self.passed else 'failed'}: {self.reason} "
                f"({self.tokens} tokens; {self.seconds_on:.2f} s with the path, "
                f"{self.seconds_off:.2f} s without, {speed:.2f}x)")

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> EndToEnd:
        """A verdict ``to_json`` wrote; ValueError for anything else."""
        return read_kept(data, FORMAT, VERSION, lambda shapes: cls(
            bool(data["passed"]), str(data["reason"]), shapes, int(data["tokens"]),
            float(data["seconds_on"]), float(data["seconds_off"])))


def compare(shapes: Shapes, runs: Runs) -> EndToEnd:
    """Run the engine off, then on (``runs``), and compare: passed only where every
    prompt's tokens are the same, the first difference named otherwise."""
    expected, seconds_off = runs(False)
    outputs, seconds_on = runs(True)
    tokens = sum(len(o) for o in expected)
    reason = first_difference(expected, outputs) or "every token the engine's own"
    return EndToEnd(reason.startswith("every"), reason, shapes, tokens, seconds_on,
                    seconds_off)


def first_difference(expected: Sequence[Sequence[int]],
                     outputs: Sequence[Sequence[int]]) -> str | None:
    """Where ``outputs`` first leaves ``expected`` (a prompt, a token), or None."""
    if len(outputs) != len(expected):
        return f"{len(outputs)} outputs with the path, {len(expected)} without"
    for prompt, (want, got) in enumerate(zip(expected, outputs, strict=True)):
        for position, (a, b) in enumerate(zip(want, got, strict=False)):
            if a != b:
                return (f"prompt {prompt}, token {position}: {b} with the path, {a} "
                        "without")
        if len(want) != len(got):
            return f"prompt {prompt}: {len(got)} tokens with the path, {len(want)} without"
    return None


def path_of(shapes: Shapes) -> Path:
    """Where the verdict for ``shapes`` is kept: beside the kernel check's, same key."""
    return cache_dir() / f"{shapes.key()}.end-to-end.json"


def kept(shapes: Shapes) -> EndToEnd | None:
    """The end-to-end verdict kept for exactly ``shapes``, or None (none, unreadable, or
    for other shapes)."""
    try:
        verdict = EndToEnd.from_json(read_json(path_of(shapes)))
    except (OSError, ValueError):
        return None
    return verdict if verdict.shapes == shapes else None


def keep(verdict: EndToEnd) -> Path:
    """Keep ``verdict`` for its shapes; the file."""
    path = path_of(verdict.shapes)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, json.dumps(verdict.to_json(), indent=1) + "\n")
    return path
