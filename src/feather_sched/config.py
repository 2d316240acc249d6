"""Feather's options, read and checked the same way by every engine adapter.

Options come from the engine's own configuration channel when it reaches the scheduler
(vLLM: ``--additional-config '{"feather": {...}}'``), else from ``FEATHER_*`` environment
variables, else defaults.  Every value goes through one validator per option, whichever
source it came from, so a typo or a wrong type fails start-up with a message naming the
option (``feather serve`` runs the same check before the engine starts).  The files
Feather will write are checked too: each must be a writable file in an existing
directory, and a saved bandit table must load.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from feather_sched.cht import DEFAULT_CHUNK_TOKENS
from feather_sched.fairness import DEFAULT_MAX_OVERTAKES, DEFAULT_MAX_STOPS
from feather_sched.gate import GATE_KINDS, Gate, UCBBanditGate, make_gate
from feather_sched.queue import DEFAULT_MAX_WAIT_S, FeatherQueue
from feather_sched.step_model import AUTO, EngineShape, StepPrior

ENV_PREFIX = "FEATHER_"
OFF = ("off", "none", "null")
"""Spellings that turn an optional bound off (also ``null`` in JSON)."""
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

logger = logging.getLogger("feather_sched")


class FeatherConfigError(ValueError):
    """A Feather option is unknown or has a bad value."""


@dataclass(frozen=True)
class FeatherConfig:
    gate: str = "model"
    """ADD/STOP policy: ``always`` (no gating), ``chunk-loss``, ``bandit`` (the paper's) or
    ``model`` (the default: with the batch ordered it admits as ``always`` and predicts
    nothing; with ordering off it is the best gate measured, ``benchmarks/gate``)."""
    gate_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the gate (see ``feather_sched.gate``)."""
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Chunk size; with engine block hashes, rounded to whole blocks (at least one)."""
    state_file: str | None = None
    """Bandit table to start from and to save to (warm start across restarts)."""
    max_overtakes: int | None = DEFAULT_MAX_OVERTAKES
    """Fairness bound: while a request waits, at most this many later arrivals are
    admitted before it (``fairness``); None (or "off") turns it off."""
    max_stops: int | None = DEFAULT_MAX_STOPS
    """Fairness bound: while a request waits, the gate ends at most this many scheduling
    passes early; None (or "off") turns it off."""
    max_wait_s: float | None = DEFAULT_MAX_WAIT_S
    """Starvation backstop: a request waiting longer is admitted whatever the gate says;
    None (or "off") turns it off."""
    order_running: bool = True
    """Keep the running batch ordered by prefix group."""
    stats_file: str | None = None
    """Where the adapter writes its ``SchedulerStats`` (periodically and at shutdown)."""
    step_log: str | None = None
    """CSV to append each step's batch composition and time to (for ``feather calibrate``)."""
    shared_prefix_attention: str = "auto"
    """Shared-prefix decode attention (each prefix group's KV read once per step):
    ``auto`` (on with Feather's scheduler where it can act), ``on`` (also under the
    engine's own scheduler) or ``off``."""

    def __post_init__(self) -> None:
        for option in fields(self):
            value = getattr(self, option.name)
            try:
                checked = VALIDATORS[option.name](value)
            except (ValueError, TypeError) as error:
                raise FeatherConfigError(f"feather option '{option.name}': {error}, "
                                         f"got {value!r}") from None
            object.__setattr__(self, option.name, checked)
        if self.state_file is not None and self.gate != "bandit":
            raise FeatherConfigError("feather option 'state_file' needs gate 'bandit'")
        for name in ("state_file", "stats_file", "step_log"):
            path = getattr(self, name)
            if path is not None:
                check_writable(name, path)
        self.make_gate(announce=False)  # the gate options and state file, checked once

    @classmethod
    def from_sources(
        cls, options: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
    ) -> FeatherConfig:
        """Options from the engine's config mapping, falling back to FEATHER_* variables."""
        if options is not None and not isinstance(options, Mapping):
            raise FeatherConfigError(f"feather options must be a JSON object, got {options!r}")
        values = dict(_from_environ(environ))
        values.update(options or {})
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            names = ", ".join(f.name for f in fields(cls))
            raise FeatherConfigError(f"unknown feather option(s) {unknown}; known: {names}")
        return cls(**values)

    def make_gate(self, *, announce: bool = True, engine: EngineShape | None = None) -> Gate:
        """The configured gate; a bandit warm-starts from ``state_file`` when it exists, a
        model gate with prior ``auto`` from ``engine``'s profile, where there is one
        (logged when ``announce``: once per gate put to use, not per validation)."""
        options = dict(self.gate_options)
        if self.gate == "model":
            options.setdefault("ordered", self.order_running)
            if options.get("prior", AUTO) == AUTO and engine is not None:
                options["prior"], note = StepPrior.for_engine(engine)
                if announce:
                    logger.info("Feather: model gate %s%s", note, "; it predicts only where "
                                "batch ordering cannot act" if options["ordered"] else "")
        try:
            gate = make_gate(self.gate, **options)
        except ValueError as error:
            raise FeatherConfigError(f"feather option 'gate_options': {error}") from None
        if self.state_file and Path(self.state_file).exists():
            assert isinstance(gate, UCBBanditGate)
            try:
                gate.load(self.state_file)
            except (OSError, ValueError) as error:
                raise FeatherConfigError(
                    f"feather option 'state_file' ({self.state_file}): {error}") from None
            if announce:
                logger.info("Feather: bandit table loaded from %s (%d learned decisions)",
                            self.state_file, gate.learned_decisions)
        return gate

    def make_queue(self, clock: Callable[[], float] = time.monotonic,
                   engine: EngineShape | None = None) -> FeatherQueue:
        """The queue with the configured gate and bounds (``engine``: see ``make_gate``)."""
        return FeatherQueue(self.make_gate(engine=engine), max_overtakes=self.max_overtakes,
                            max_stops=self.max_stops, max_wait_s=self.max_wait_s,
                            chunk_tokens=self.chunk_tokens, clock=clock)


def check_writable(option: str, path: str) -> None:
    """That Feather can create or replace ``path``; FeatherConfigError naming both if not."""
    target = Path(path)
    where = f"feather option '{option}' ({path})"
    if target.is_dir():
        raise FeatherConfigError(f"{where}: is a directory")
    directory = target.parent
    if not directory.is_dir():
        raise FeatherConfigError(f"{where}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise FeatherConfigError(f"{where}: cannot write in {directory}")
    if target.exists() and not os.access(target, os.W_OK):
        raise FeatherConfigError(f"{where}: the file is not writable")


# ---- one validator per option (JSON values and environment strings alike) -------------


def _gate(value: Any) -> str:
    if value not in GATE_KINDS:
        raise ValueError(f"must be one of {', '.join(GATE_KINDS)}")
    return value


def _mapping(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


def _positive_integer(value: Any) -> int:
    number = _integer(value)
    if number <= 0:
        raise ValueError("must be a positive integer")
    return number


def _optional_count(value: Any) -> int | None:
    if _is_off(value):
        return None
    number = _integer(value)
    if number < 0:
        raise ValueError("must be a non-negative integer or \"off\"")
    return number


def _optional_seconds(value: Any) -> float | None:
    if _is_off(value) or (isinstance(value, str) and value.strip().lower() == "inf"):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("must be a number of seconds or \"off\"")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError("must be a non-negative number of seconds or \"off\"")
    return number


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    raise ValueError(f"must be true or false (or one of {', '.join(TRUE + FALSE)})")


SHARED_PREFIX_MODES = ("auto", "on", "off")


def _shared_prefix_mode(value: Any) -> str:
    word = value.strip().lower() if isinstance(value, str) else value
    if word in SHARED_PREFIX_MODES:
        return word
    if isinstance(value, bool) or word in TRUE + FALSE:
        return "on" if value is True or word in TRUE else "off"
    raise ValueError(f"must be one of {', '.join(SHARED_PREFIX_MODES)} (or a boolean)")


def _optional_path(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise ValueError("must be a file path")
    return str(value)


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("must be an integer")
    return int(value)


def _is_off(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in OFF)


VALIDATORS: dict[str, Callable[[Any], Any]] = {
    "gate": _gate,
    "gate_options": _mapping,
    "chunk_tokens": _positive_integer,
    "state_file": _optional_path,
    "max_overtakes": _optional_count,
    "max_stops": _optional_count,
    "max_wait_s": _optional_seconds,
    "order_running": _boolean,
    "stats_file": _optional_path,
    "step_log": _optional_path,
    "shared_prefix_attention": _shared_prefix_mode,
}
"""Each option's validator: the checked value, or ValueError saying what it must be."""


def _from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    """FEATHER_GATE=bandit, FEATHER_GATE_OPTIONS='{"exploration": 100}', and so on."""
    values = {}
    for name, validate in VALIDATORS.items():
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            try:
                values[name] = validate(raw)
            except ValueError as error:
                raise FeatherConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: {error}") from None
    return values
