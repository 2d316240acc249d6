"""Fault injection for the containment tests: exceptions from Feather's own code."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import pytest

from feather_sched.core import order
from feather_sched.core.cht import ChunkedHashTree
from feather_sched.core.record import Record
from feather_sched.core.tenants import TenantShare
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
    (order, "order_by_group", "order"),
)
"""(owner, attribute, label): the tree, the bandit gate, the meter, the metrics sink and
the running order, as the runtime reaches them."""

REBUILD: tuple[tuple[object, str, str], ...] = ((Record, "track", "rebuild"),)
"""The rebuild after a fault, at each request it tracks again (aimed at by
``Injector.next_pass(rebuilding=True)``); also a new request's tracking."""
SHARE: tuple[tuple[object, str, str], ...] = (
    (TenantShare, "charge", "share"),
    (TenantShare, "window", "share"),
    (TenantShare, "least_served", "share"),
)
"""Under fair share: the tenant share's charge and the tenants it admits."""


def fault_targets(fairness: str) -> tuple[tuple[object, str, str], ...]:
    """What a random fault test injects into under ``fairness``: Feather's code as the
    runtime reaches it in that mode (under ``vtc`` no gate is asked and the running
    order is the engine's), the rebuild, and the share under fair share."""
    if fairness == "off":
        return FEATHER_CODE + REBUILD
    reached = FEATHER_CODE if fairness == "tenants" else \
        tuple(t for t in FEATHER_CODE if t[2] not in ("gate", "order"))
    return reached + REBUILD + SHARE


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

    def next_pass(self, rebuilding: bool = False) -> None:
        """A new pass: maybe choose the next fault (one not met yet still waits);
        ``rebuilding`` (the pass starts with a rebuild after a fault): a fault
        chosen then is in the rebuild half of the time (at one of its first requests),
        where ``rebuild`` is a target."""
        rng = self.rng
        if not self.armed:
            self._pending = None
        elif self._pending is None and rng.random() < self.rate:
            label = "rebuild" if rebuilding and "rebuild" in self._labels and \
                rng.random() < 0.5 else rng.choice(self._labels)
            self._pending = (label, rng.randrange(3), rng.random() < 0.5)

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


SERVING = ("enter_waiting", "discard", "begin_pass", "reconcile", "decide", "candidate",
           "admit", "hold", "end_pass", "preempted", "passes_due", "rank_waiting", "order",
           "batch_order", "urgent_victims")
"""The runtime's members that serve a pass; its measurements (``served``, ``end_step``,
``describe_batch``) run whenever Feather is on, a pass it left included."""


class ServingSpy:
    """Watches an adapter ask ``faults.serves``: ``strays`` lists each call of a serving
    member of ``runtime`` made while its guard says Feather does not serve, and
    ``break_next(name, times)`` makes serving member ``name`` raise ``InjectedFault`` at
    its next ``times`` calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, runtime: object) -> None:
        self.strays: list[str] = []
        self._runtime = runtime
        self._breaking: dict[str, int] = {}
        for name in SERVING:
            original = getattr(runtime, name)
            monkeypatch.setattr(runtime, name, functools.wraps(original)(
                functools.partial(self._watched, name, original)))

    def _watched(self, name: str, original: Callable, *args, **kwargs):
        if not self._runtime.faults.serves:
            self.strays.append(name)
        if self._breaking.get(name):
            self._breaking[name] -= 1
            raise InjectedFault(name)
        return original(*args, **kwargs)

    def break_next(self, name: str, times: int = 1) -> None:
        assert name in SERVING
        self._breaking[name] = times
