"""``FaultGuard``: containment of Feather's own exceptions inside one engine's scheduler.

Whatever Feather's tree, queue, gate, meter or metrics sink raises, the engine keeps
serving: the adapter hands the exception to the guard, serves the engine's own order for
the rest of the pass, and Feather rebuilds its picture before the next.  The guard owns
the one answer adapters ask before each piece of Feather's serving: ``serves``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from feather_sched.telemetry.stats import StepMeter

LOG_FAULTS_EVERY_S = 10.0
"""After the first fault (logged with its traceback), at most one line per this period."""

logger = logging.getLogger("feather_sched")

T = TypeVar("T")


class FaultGuard:
    """Contains exceptions of Feather's own code in one engine's scheduler.

    The adapter runs each piece of Feather's work through ``call`` or ``attempt``: an
    exception goes to ``fault``, which counts and logs it (the traceback the first time,
    then a line at most every ``LOG_FAULTS_EVERY_S``), empties Feather's picture
    (``reset``: one fault counts once) and runs the adapter's ``on_fault``, its fall-back
    to the engine's own order and admission.  While ``dirty`` the adapter rebuilds the
    picture from the engine's before the next pass.  ``limit`` faults in a row (no pass
    that decided admissions nor ``limit`` passes ``served`` between them) turn Feather off
    for good: ``active`` is then False.  O(1).

    ``open_pass`` as each engine pass starts; ``serves`` is the one predicate for "Feather
    serves this call", in the pass and between passes alike.  docs/vllm.md, "Faults of
    Feather's own code never reach the engine".
    """

    def __init__(self, name: str, limit: int, meter: StepMeter,
                 reset: Callable[[], None] | None = None,
                 on_fault: Callable[[str], None] | None = None) -> None:
        """``reset``: empties Feather's picture (``FeatherRuntime.drop``), run first
        after each fault, so until the rebuild every call finds it whole or empty;
        ``on_fault``: the adapter's fall-back, run last after each fault with its
        ``where``: what the engine serves instead for the rest of the pass."""
        self.name = name
        self.limit = limit
        self.meter = meter
        self.active = True
        self.dirty = False
        """A fault happened since Feather's picture was last rebuilt."""
        self.in_a_row = 0
        self._served = 0
        """Passes served without a fault since the last fault."""
        self._logged_at: float | None = None
        self.reset = reset
        self.on_fault = on_fault
        self._serves = True

    @property
    def serves(self) -> bool:
        """Whether Feather serves the engine's current call: it is on and no fault
        happened since the pass opened (``open_pass``); else the engine's own order and
        admission serve, to the next pass that opens without a fault."""
        return self._serves

    def open_pass(self) -> bool:
        """An engine pass starts: Feather serves it if it is on (a fault in the adapter's
        rebuild, which follows, leaves it to the engine); returns ``serves``."""
        self._serves = self.active
        return self._serves

    def call(self, where: str, action: Callable[..., T], *args: object,
             default: T | None = None) -> T | None:
        """``action(*args)``'s result; if Feather's code raises, the fault is contained
        (``fault``, labelled ``where``) and ``default`` returned.  Only ``Exception`` is
        contained: ``KeyboardInterrupt`` and ``SystemExit`` propagate."""
        try:
            return action(*args)
        except Exception as error:
            self.fault(where, error)
            return default

    def attempt(self, where: str, action: Callable[..., object], *args: object) -> bool:
        """Run ``action(*args)`` contained, as ``call``; True if it ran without a fault."""
        try:
            action(*args)
        except Exception as error:
            self.fault(where, error)
            return False
        return True

    def fault(self, where: str, error: Exception) -> None:
        """Feather's code raised ``error`` in ``where`` (a short label)."""
        stats = self.meter.stats
        stats.faults += 1
        self.in_a_row += 1
        self._served = 0
        self.dirty = True
        self._serves = False
        if self.reset is not None:
            with contextlib.suppress(Exception):  # the rebuild clears the queue again
                self.reset()
        if self.meter.sink is not None:
            with contextlib.suppress(Exception):  # the sink may be what fails: stats count
                self.meter.sink.fault(where)
        now = time.monotonic()
        if self._logged_at is None:
            logger.error("Feather: fault in %s (%s); this scheduling pass falls back to the "
                         "engine's own order, Feather resumes at the next", where, self.name,
                         exc_info=error)
            self._logged_at = now
        elif now - self._logged_at >= LOG_FAULTS_EVERY_S:
            logger.warning("Feather: %d faults in %s so far, the latest in %s: %r",
                           stats.faults, self.name, where, error)
            self._logged_at = now
        if self.active and self.in_a_row >= self.limit:
            self.active = False
            logger.error("Feather is off in %s after %d faults in a row (the latest in %s: "
                         "%r): the engine's own scheduling order from now on", self.name,
                         self.in_a_row, where, error)
        if self.on_fault is not None:
            self.on_fault(where)

    def served(self, decided: bool) -> None:
        """Feather's code served a pass to its end; ``decided``: it decided admissions."""
        self._served += 1
        if decided or self._served >= self.limit:
            self.in_a_row = 0
