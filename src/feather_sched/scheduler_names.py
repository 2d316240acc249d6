"""Scheduler names of the benchmarks and the simulator, parsed and validated in one place.

``fcfs`` (``-nocache``: prefix caching off), ``priority`` (the engine's priority
policy), ``sglang-lpm``, ``sglang-dfs-weight`` (simulator only), ``vtc`` (fair share by
a virtual token counter: Feather's runtime in ``fairness: vtc``) and ``feather-<gate>``
with ``-noorder``, ``-unbounded``, ``-fair`` in that order; any name may end in
``-shared`` or ``-noshared`` (shared-prefix decode attention on or off for that run).
Where a workload has several priority classes, Feather names run under the engine's
priority policy too (``SchedulerName.priority_policy``); the others run FCFS with every
priority stripped to 0.  What each name means: docs/measuring.md, "Scheduler names".
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from feather_sched.gates import GATE_KINDS


class SchedulerKind(Enum):
    FCFS = "fcfs"
    FCFS_NOCACHE = "fcfs-nocache"
    PRIORITY = "priority"
    SGLANG_LPM = "sglang-lpm"
    SGLANG_DFS_WEIGHT = "sglang-dfs-weight"
    VTC = "vtc"
    FEATHER = "feather"


ENGINE_KINDS = frozenset({SchedulerKind.FCFS, SchedulerKind.FCFS_NOCACHE,
                          SchedulerKind.PRIORITY, SchedulerKind.VTC, SchedulerKind.FEATHER})
"""What ``feather bench`` runs on the real vLLM engine."""
SIM_KINDS = frozenset({SchedulerKind.FCFS, SchedulerKind.PRIORITY, SchedulerKind.SGLANG_LPM,
                       SchedulerKind.SGLANG_DFS_WEIGHT, SchedulerKind.VTC,
                       SchedulerKind.FEATHER})
"""What ``feather sim`` models."""

NOORDER = "-noorder"
UNBOUNDED = "-unbounded"
FAIR = "-fair"
SHARED, NOSHARED = "-shared", "-noshared"


@dataclass(frozen=True)
class SchedulerName:
    """A parsed scheduler name."""

    name: str
    kind: SchedulerKind
    gate: str | None = None
    order_running: bool = True
    bounded: bool = True
    fair: bool = False
    """Fair share between tenants (``-fair``)."""
    shared_prefix: bool | None = None
    """Shared-prefix attention on or off; None: the context's default."""

    def feather_options(self, base: Mapping[str, Any]) -> dict[str, Any]:
        """Feather's options for this name on top of the user's (Feather names, and
        ``vtc``: Feather's runtime in ``fairness: vtc``)."""
        if self.kind is SchedulerKind.VTC:
            return {**base, "fairness": "vtc"} | self.attention_options()
        if self.kind is not SchedulerKind.FEATHER:
            raise ValueError(f"{self.name!r} is not a Feather scheduler")
        options = {**base, "gate": self.gate, "order_running": self.order_running}
        if not self.bounded:
            options.update(max_overtakes=None, max_stops=None)
        if self.fair:
            options["fairness"] = "tenants"
        return options | self.attention_options()

    def priority_policy(self, classes: int) -> bool:
        """Whether this name runs under the engine's priority policy on a workload of
        ``classes`` priority classes: ``priority`` always, Feather where there are several;
        any other name runs first come first served, and its requests must then go with
        priority 0 (vLLM refuses any other under FCFS)."""
        return self.kind is SchedulerKind.PRIORITY or (
            self.kind is SchedulerKind.FEATHER and classes > 1)

    def attention_options(self) -> dict[str, Any]:
        """The engine's ``shared_prefix_attention`` option this name asks for, if any."""
        if self.shared_prefix is None:
            return {}
        return {"shared_prefix_attention": "on" if self.shared_prefix else "off"}


def parse_scheduler(name: str, allowed: Collection[SchedulerKind] = SIM_KINDS) -> SchedulerName:
    """Parse one name; ValueError naming the valid choices for this context."""
    name = name.strip()
    base, shared = _attention(name)
    kind = _kind(base)
    if kind is None or kind not in allowed:
        raise ValueError(f"unknown scheduler {name!r}: use {choices(allowed)}")
    if kind is not SchedulerKind.FEATHER:
        return SchedulerName(name, kind, shared_prefix=shared)
    gate, unfair = _strip(base.removeprefix("feather-"), FAIR)
    gate, bounded = _strip(gate, UNBOUNDED)
    gate, ordered = _strip(gate, NOORDER)
    return SchedulerName(name, kind, gate, ordered, bounded, not unfair, shared)


def parse_schedulers(names: str, allowed: Collection[SchedulerKind] = SIM_KINDS
                     ) -> list[SchedulerName]:
    """Parse a comma-separated list (empty items ignored); at least one name."""
    parsed = [parse_scheduler(n, allowed) for n in names.split(",") if n.strip()]
    if not parsed:
        raise ValueError(f"no scheduler given: use {choices(allowed)}")
    return parsed


def choices(allowed: Collection[SchedulerKind]) -> str:
    names = [kind.value for kind in SchedulerKind if kind in allowed and
             kind is not SchedulerKind.FEATHER]
    if SchedulerKind.FEATHER in allowed:
        names.append(f"feather-<{'|'.join(GATE_KINDS)}>[{NOORDER}][{UNBOUNDED}][{FAIR}]")
    return ", ".join(names) + f", each optionally ending in {SHARED} or {NOSHARED}"


def _strip(text: str, suffix: str) -> tuple[str, bool]:
    """``text`` without ``suffix``, and whether it did not end with it."""
    return text.removesuffix(suffix), not text.endswith(suffix)


def _attention(name: str) -> tuple[str, bool | None]:
    """The name without its shared-prefix suffix, and what that suffix asks for."""
    for suffix, value in ((NOSHARED, False), (SHARED, True)):
        if name.endswith(suffix):
            return name.removesuffix(suffix), value
    return name, None


def _kind(name: str) -> SchedulerKind | None:
    if name.startswith(SchedulerKind.FEATHER.value):
        gate = name.removeprefix("feather-")
        for suffix in (FAIR, UNBOUNDED, NOORDER):
            gate = _strip(gate, suffix)[0]
        return SchedulerKind.FEATHER if gate in GATE_KINDS else None
    try:
        return SchedulerKind(name)
    except ValueError:
        return None
