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
