"""What a scheduler measures about itself, and the one object that records and saves it.

``StepMeter`` is shared by Feather and by the instrumented baselines, so both sides of
a comparison are measured alike: time inside ``schedule()``, each executed step's batch
size and time, admission counts, the step log, and (for a learning gate) its table.
Its files are written every ``WRITE_EVERY_STEPS`` steps or ``save_every_s`` seconds and
at shutdown, each replaced atomically; a write that fails is logged and retried at the
next interval, never raised into the engine.  ``feather bench`` reads the stats file
after a run (the engine may live in another process).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from feather_sched.telemetry.files import replace_atomically
from feather_sched.telemetry.steplog import BatchEntry, StepLogWriter

WRITE_EVERY_STEPS = 512
SAVE_EVERY_S = 10.0
"""The stats file (and a learning gate's state file) is written every ``WRITE_EVERY_STEPS``
steps or ``save_every_s`` seconds (this by default), whichever comes first, and at
shutdown (an engine killed without one loses at most that much)."""

logger = logging.getLogger("feather_sched")


@dataclass
class AdmissionCounts:
    """What Feather's admission decided, counted once per outcome.

    ``asked`` counts questions to the queue (one per candidate and pass, whether or not
    the engine could then admit it); ``add``, ``forced`` and ``stop`` count what
    happened: requests the gate admitted, requests a bound admitted over the gate, and
    passes the gate ended early.
    """

    asked: int = 0
    add: int = 0
    forced: int = 0
    stop: int = 0


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
    reordered_batches: int = 0
    """Running batches the adapter had to put back in Feather's order (SGLang)."""
    requests_entered: int = 0
    requests_left: int = 0
    """Requests Feather started tracking, and discarded (each exactly once)."""
    waiting: int = 0
    running: int = 0
    """Feather's waiting and running requests at the last scheduling pass."""
    preemptions: int = 0
    max_request_preemptions: int = 0
    """Preemptions (a running request's KV room taken back), and the most any one
    request suffered."""
    urgent_preemptions: int = 0
    """Of those, preemptions for a waiting request of a more urgent class (at most
    ``max_urgent_preemptions`` per request)."""
    faults: int = 0
    """Exceptions in Feather's own code, each contained by its scheduling pass falling
    back to the engine's own order (``core.faults.FaultGuard``)."""
    admissions: AdmissionCounts | None = None
    """Feather's counts; None for a scheduler without Feather."""

    @property
    def schedule_ms_per_call(self) -> float:
        return 1e3 * self.schedule_s / self.schedule_calls if self.schedule_calls else 0.0

    @property
    def step_ms(self) -> float:
        return 1e3 * self.step_s / self.steps if self.steps else 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def read(cls, path: str | Path) -> SchedulerStats:
        data = json.loads(Path(path).read_text())
        admissions = data.pop("admissions", None)
        return cls(**data, admissions=AdmissionCounts(**admissions) if admissions else None)


@dataclass
class StepMeter:
    """Records one scheduler's steps and writes its stats, step log and gate state."""

    name: str
    stats_file: str | None = None
    step_log: str | None = None
    state_file: str | None = None
    gate: Any = None
    """A gate with ``save(path)`` (the bandit), written to ``state_file``."""
    admissions: AdmissionCounts | None = None
    sink: Any = None
    """A ``telemetry.prometheus.PrometheusSink`` the measurements also go to, if any."""
    save_every_s: float = SAVE_EVERY_S
    """Seconds between saves while steps or passes go on (``FeatherConfig.save_every_s``)."""
    stats: SchedulerStats = field(init=False)
    _log: StepLogWriter | None = field(default=None, init=False)
    _failed: set[str] = field(default_factory=set, init=False)
    _saved_at: float = field(default_factory=time.monotonic, init=False)

    def __post_init__(self) -> None:
        self.stats = SchedulerStats(scheduler=self.name, admissions=self.admissions)
        if self.step_log:
            self._log = StepLogWriter(self.step_log)

    def scheduled(self, seconds: float) -> None:
        """One call of the engine's ``schedule()`` took ``seconds``; files saved when due
        (an engine that polls while idle so saves within ``save_every_s`` of its last step)."""
        self.stats.schedule_calls += 1
        self.stats.schedule_s += seconds
        if self.sink is not None:
            self.sink.scheduled(seconds)
        if time.monotonic() - self._saved_at >= self.save_every_s:
            self.save()

    def step(self, batch_size: int, seconds: float,
             batch: Sequence[BatchEntry] | None = None) -> None:
        """An executed step: counted, logged when a step log is on, files saved when due."""
        stats = self.stats
        stats.steps += 1
        stats.step_s += seconds
        stats.batched_requests += batch_size
        if self._log is not None and batch:
            self._guarded("step log", self.step_log, lambda: self._log.append(batch, seconds))
        if stats.steps % WRITE_EVERY_STEPS == 0 or \
                time.monotonic() - self._saved_at >= self.save_every_s:
            self.save()

    def preempted(self, request_preemptions: int, *, priority: int = 0,
                  group_size: int | None = None, urgent: bool = False) -> None:
        """A request was preempted, its ``request_preemptions``-th time; it was of class
        ``priority`` and one of ``group_size`` running requests of its prefix group;
        ``urgent``: for a waiting request of a more urgent class, not for KV room of a
        running one (counted in both ``preemptions`` and ``urgent_preemptions``)."""
        stats = self.stats
        stats.preemptions += 1
        stats.urgent_preemptions += int(urgent)
        stats.max_request_preemptions = max(stats.max_request_preemptions,
                                            request_preemptions)
        if self.sink is not None:
            self.sink.preempted(priority, group_size, urgent=urgent)

    def save(self) -> None:
        """Write the stats file and the gate's table (those configured); never raises."""
        self._saved_at = time.monotonic()
        if self.stats_file:
            self._guarded("stats file", self.stats_file,
                          lambda: replace_atomically(self.stats_file, self.stats.to_json()))
        if self.state_file and self.gate is not None:
            self._guarded("state file", self.state_file, lambda: self.gate.save(self.state_file))

    def close(self) -> None:
        """Save once more and close the step log (at engine shutdown)."""
        self.save()
        if self._log is not None:
            self._log.close()

    def _guarded(self, what: str, path: str | None, write: Any) -> None:
        """Run a write; log a failure once (and its recovery), keep the engine running."""
        try:
            write()
        except OSError as error:
            if what not in self._failed:
                logger.error("Feather could not write its %s %s: %s (retrying every %d "
                             "steps or %g s)", what, path, error, WRITE_EVERY_STEPS,
                             self.save_every_s)
            self._failed.add(what)
            return
        if what in self._failed:
            logger.warning("Feather wrote its %s %s again", what, path)
            self._failed.discard(what)
