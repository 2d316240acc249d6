"""Fault injection for the containment tests: exceptions from Feather's own code."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import pytest

from feather_sched.core import runtime
from feather_sched.core.cht import ChunkedHashTree
from feather_sched.gates.bandit import UCBBanditGate
from feather_sched.telemetry.prometheus import PrometheusSink
from feather_sched.telemetry.stats import StepMeter

FEATHER_CODE: tuple[tuple[object, str, str], ...] = (
    (ChunkedHashTree, "add", "tree"),
    (ChunkedHashTree, "admit", "tree"),
    (ChunkedHashTree, "best", "tree"),
    (UCBBanditGate, "decide", "gate"),
    (UCBBanditGate, "reward", "gate"),
    (StepMeter, "scheduled", "meter"),
    (StepMeter, "step", "meter"),
    (PrometheusSink, "pass_ended", "sink"),
    (PrometheusSink, "request_left", "sink"),
    (runtime, "order_by_group", "order"),
)
"""(owner, attribute, label): the tree, the bandit gate, the meter, the metrics sink and
the running order, as the runtime reaches them."""


class InjectedFault(RuntimeError):
    """Raised by ``Injector``, never by Feather itself."""


class Injector:
    """Makes methods of Feather's code raise ``InjectedFault`` at random passes (seeded):
    ``next_pass`` picks, with probability ``rate``, one target label to fail at one of
    its next few calls, half of the time before doing its work and half after it (an
    update done, then a raise); ``armed`` False clears it.  ``raised`` lists the label of
    every fault raised."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seed: int, rate: float) -> None:
        self.rng = random.Random(seed)
        self.rate = rate
        self.armed = True
        self.raised: list[str] = []
        self._labels: list[str] = []
        self._pending: tuple[str, int, bool] | None = None
        """The label to fail, the calls of it to let through first, and whether after."""
        self._monkeypatch = monkeypatch

    def target(self, owner: object, name: str, label: str) -> None:
        original: Callable = getattr(owner, name)
        self._labels.append(label)

        @functools.wraps(original)
        def faulty(*args, **kwargs):
            after = self._due(label)
            if after is False:
                self._raise(label)
            result = original(*args, **kwargs)
            if after:
                self._raise(label)
            return result

        self._monkeypatch.setattr(owner, name, faulty)

    def target_all(self, targets: tuple[tuple[object, str, str], ...] = FEATHER_CODE) -> None:
        for owner, name, label in targets:
            self.target(owner, name, label)

    def next_pass(self) -> None:
        """A new pass: maybe choose the next fault (one not met yet still waits)."""
        rng = self.rng
        if not self.armed:
            self._pending = None
        elif self._pending is None and rng.random() < self.rate:
            self._pending = (rng.choice(self._labels), rng.randrange(3), rng.random() < 0.5)

    def _due(self, label: str) -> bool | None:
        """None: no fault now; else whether it comes after the call's work."""
        if self._pending is None or self._pending[0] != label:
            return None
        _, skip, after = self._pending
        if skip:
            self._pending = (label, skip - 1, after)
            return None
        self._pending = None
        return after

    def _raise(self, label: str) -> None:
        self.raised.append(label)
        raise InjectedFault(label)
