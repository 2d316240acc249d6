"""Feather's options, read the same way by every engine adapter.

Options come from the engine's own configuration channel when it reaches the scheduler
(vLLM: ``--additional-config '{"feather": {...}}'``), else from ``FEATHER_*`` environment
variables, else defaults.  Every value is validated when the scheduler starts, so a typo
fails the engine's start-up with a message naming the option instead of running silently
with a default.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from feather_sched.cht import DEFAULT_CHUNK_TOKENS
from feather_sched.fairness import DEFAULT_MAX_OVERTAKES
from feather_sched.gate import GATE_KINDS, Gate, make_gate
from feather_sched.queue import DEFAULT_MAX_WAIT_S, FeatherQueue

ENV_PREFIX = "FEATHER_"


class FeatherConfigError(ValueError):
    """A Feather option is unknown or has a bad value."""


@dataclass(frozen=True)
class FeatherConfig:
    gate: str = "bandit"
    """ADD/STOP policy: ``always`` (no gating), ``chunk-loss`` or ``bandit``."""
    gate_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the gate (see ``feather_sched.gate``)."""
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Chunk size; with engine block hashes, rounded to whole blocks (at least one)."""
    state_file: str | None = None
    """Bandit table to start from and to save to (warm start across restarts)."""
    max_overtakes: int | None = DEFAULT_MAX_OVERTAKES
    """Fairness bound: while a request waits, at most this many later arrivals are
    admitted before it (``fairness``); None turns it off."""
    max_wait_s: float | None = DEFAULT_MAX_WAIT_S
    """Starvation backstop: a request waiting longer is admitted whatever the gate says."""
    order_running: bool = True
    """Keep the running batch ordered by prefix group."""
    stats_file: str | None = None
    """Where the adapter writes its ``SchedulerStats`` (periodically and at shutdown)."""
    step_log: str | None = None
    """CSV to append each step's batch composition and time to (for ``feather calibrate``)."""

    def __post_init__(self) -> None:
        if self.gate not in GATE_KINDS:
            raise FeatherConfigError(
                f"feather option 'gate' must be one of {', '.join(GATE_KINDS)}, got {self.gate!r}"
            )
        if not isinstance(self.gate_options, dict):
            raise FeatherConfigError("feather option 'gate_options' must be a mapping")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens <= 0:
            raise FeatherConfigError(
                f"feather option 'chunk_tokens' must be a positive integer, "
                f"got {self.chunk_tokens!r}"
            )
        if self.max_overtakes is not None and (
                isinstance(self.max_overtakes, bool) or not isinstance(self.max_overtakes, int)
                or self.max_overtakes < 0):
            raise FeatherConfigError(
                f"feather option 'max_overtakes' must be a non-negative integer or null, "
                f"got {self.max_overtakes!r}")
        if self.max_wait_s is not None and not self.max_wait_s >= 0:
            raise FeatherConfigError(
                f"feather option 'max_wait_s' must be non-negative, got {self.max_wait_s!r}"
            )
        if self.state_file is not None and self.gate != "bandit":
            raise FeatherConfigError("feather option 'state_file' needs gate 'bandit'")
        self.make_gate()

    @classmethod
    def from_sources(
        cls, options: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
    ) -> FeatherConfig:
        """Options from the engine's config mapping, falling back to FEATHER_* variables."""
        values = dict(_from_environ(environ))
        values.update(options or {})
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            names = ", ".join(f.name for f in fields(cls))
            raise FeatherConfigError(f"unknown feather option(s) {unknown}; known: {names}")
        return cls(**values)

    def make_gate(self) -> Gate:
        options = dict(self.gate_options)
        if self.state_file is not None:
            options["state_file"] = self.state_file
        try:
            return make_gate(self.gate, **options)
        except ValueError as error:
            raise FeatherConfigError(f"feather gate options: {error}") from None

    def make_queue(self, clock: Callable[[], float] = time.monotonic) -> FeatherQueue:
        return FeatherQueue(self.make_gate(), max_overtakes=self.max_overtakes,
                            max_wait_s=self.max_wait_s, clock=clock)



def _from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    """FEATHER_GATE=bandit, FEATHER_GATE_OPTIONS='{"exploration": 100}', and so on."""
    parsers = {
        "gate": str,
        "gate_options": _json_object,
        "chunk_tokens": _integer,
        "max_overtakes": _optional_integer,
        "state_file": str,
        "max_wait_s": _seconds,
        "order_running": _boolean,
        "stats_file": str,
        "step_log": str,
    }
    values = {}
    for name, parse in parsers.items():
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            try:
                values[name] = parse(raw)
            except ValueError as error:
                raise FeatherConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: {error}") from None
    return values


def _json_object(raw: str) -> dict[str, Any]:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def _integer(raw: str) -> int:
    return int(raw)


def _optional_integer(raw: str) -> int | None:
    return None if raw.lower() in ("none", "off") else int(raw)


def _seconds(raw: str) -> float | None:
    if raw.lower() in ("none", "off", "inf"):
        return None
    value = float(raw)
    if math.isnan(value):
        raise ValueError("not a number")
    return value


def _boolean(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")
