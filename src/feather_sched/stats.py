"""Counters an engine adapter keeps about its own scheduling, written to a JSON file.

``feather bench`` reads them after a run (the engine may live in another process), and
a server operator can watch the file: how long scheduling takes next to the steps it
schedules, and what the gate decided.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

WRITE_EVERY_STEPS = 512
"""How often an adapter writes its stats file (and a bandit's state file); also at exit."""


@dataclass
class SchedulerStats:
    scheduler: str = ""
    schedule_calls: int = 0
    schedule_s: float = 0.0
    """Wall time inside the engine's schedule() (Feather's queue included)."""
    steps: int = 0
    step_s: float = 0.0
    """Time from handing steps to the workers until their output came back."""
    batched_requests: int = 0
    gate_add: int = 0
    gate_stop: int = 0
    gate_forced: int = 0

    def record_step(self, batch_size: int, seconds: float) -> bool:
        """Count an executed step; True when the state files are due to be written."""
        self.steps += 1
        self.step_s += seconds
        self.batched_requests += batch_size
        return self.steps % WRITE_EVERY_STEPS == 0

    def copy_gate_counts(self, add: int, stop: int, forced: int) -> None:
        self.gate_add, self.gate_stop, self.gate_forced = add, stop, forced

    @property
    def schedule_ms_per_call(self) -> float:
        return 1e3 * self.schedule_s / self.schedule_calls if self.schedule_calls else 0.0

    @property
    def step_ms(self) -> float:
        return 1e3 * self.step_s / self.steps if self.steps else 0.0

    def write(self, path: str | Path) -> None:
        """Replace the file atomically, so a reader never sees half a file."""
        path = Path(path)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(asdict(self)))
        temporary.replace(path)

    @classmethod
    def read(cls, path: str | Path) -> SchedulerStats:
        return cls(**json.loads(Path(path).read_text()))
