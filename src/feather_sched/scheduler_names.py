"""Scheduler names of the benchmarks and the simulator, parsed and validated in one place.

``fcfs`` (``-nocache``: prefix caching off), ``priority`` (the engine's priority
policy), ``sglang-lpm``, ``sglang-dfs-weight``, ``sglang-hrrn``, ``sglang-routing-key``
(SGLang's policies, simulator only), ``vllm-cache-aware[-w<N>][-t<F>]`` (vLLM 0.34's
cache-aware admission, simulator only), ``vllm-active-cap[-<N>]`` (vLLM's
``max_num_active_seqs``), ``vtc`` (fair share by a virtual token counter: Feather's
runtime in ``fairness: vtc``) and ``feather-<gate>`` with ``-noorder``, ``-unbounded``,
``-fair`` in that order; any name may end in ``-shared`` or ``-noshared`` (shared-prefix
decode attention on or off for that run).
Where a workload has several priority classes, Feather names run under the engine's
priority policy too (``SchedulerName.priority_policy``); the others run FCFS with every
priority stripped to 0.  What each name means: docs/measuring.md, "Scheduler names".
"""

from __future__ import annotations

import re
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
    SGLANG_HRRN = "sglang-hrrn"
    SGLANG_ROUTING_KEY = "sglang-routing-key"
    VTC = "vtc"
    VLLM_CACHE_AWARE = "vllm-cache-aware"
    VLLM_ACTIVE_CAP = "vllm-active-cap"
    FEATHER = "feather"


ENGINE_KINDS = frozenset({SchedulerKind.FCFS, SchedulerKind.FCFS_NOCACHE,
                          SchedulerKind.PRIORITY, SchedulerKind.VTC, SchedulerKind.FEATHER,
                          SchedulerKind.VLLM_ACTIVE_CAP})
"""What ``feather bench`` runs on the real vLLM engine."""
SIM_KINDS = frozenset(SchedulerKind) - {SchedulerKind.FCFS_NOCACHE}
"""What ``feather sim`` models."""

NOORDER = "-noorder"
UNBOUNDED = "-unbounded"
FAIR = "-fair"
SHARED, NOSHARED = "-shared", "-noshared"
PEER_KNOBS: dict[SchedulerKind, dict[str, tuple[str, float]]] = {
    SchedulerKind.VLLM_CACHE_AWARE: {"window": ("-w", 256), "threshold": ("-t", 0.5)},
    SchedulerKind.VLLM_ACTIVE_CAP: {"cap": ("-", 64)},
}
"""Each peer knob of a name: its suffix in the name and its default."""


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
    knobs: tuple[tuple[str, float], ...] = ()
    """A peer's knobs (``PEER_KNOBS``), each given or its default."""

    def knob(self, name: str) -> float:
        return dict(self.knobs)[name]

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
    base, knobs = _knobs(base)
    kind = _kind(base)
    if kind is None or kind not in allowed:
        raise ValueError(f"unknown scheduler {name!r}: use {choices(allowed)}")
    if kind is not SchedulerKind.FEATHER:
        return SchedulerName(name, kind, shared_prefix=shared, knobs=knobs)
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
    for kind, knobs in PEER_KNOBS.items():
        if kind in allowed:
            names[names.index(kind.value)] += "".join(
                f"[{suffix}{name.upper()}]" for name, (suffix, _) in knobs.items())
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


def _knobs(name: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    """A peer's name without its knob suffixes, and every knob of it, given or default
    (ValueError for a knob that is not a number); other names as they are, with none."""
    for kind, knobs in PEER_KNOBS.items():
        if not name.startswith(kind.value):
            continue
        rest, values = name.removeprefix(kind.value), {}
        for knob, (suffix, default) in knobs.items():
            match = re.match(rf"{re.escape(suffix)}(\d+(?:\.\d+)?)", rest)
            values[knob] = float(match.group(1)) if match else default
            rest = rest[match.end():] if match else rest
        return kind.value + rest, tuple(values.items())
    return name, ()


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
