"""Step-cost model: how long one engine step takes for a given batch, in batch order.

Why order matters: requests of a prefix group read the same physical prefix KV blocks.
When the batch keeps a group together, a later member re-reads the prefix while it is
still in L2; when groups are interleaved, other requests' KV evicts it first and the
re-read goes to HBM again. Feather keeps decode batches prefix-homogeneous for this.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from feather_sched.costmodel.hardware import (
    HardwareProfile,
    from_dict,
    is_number,
    require,
)
from feather_sched.costmodel.model_profiles import ModelProfile
from feather_sched.telemetry.files import read_json
from feather_sched.telemetry.steplog import BatchEntry

GRANULARITIES = ("layer", "layer-head")


@dataclass(frozen=True)
class CostParams:
    """The model's free parameters; ``calibrate.fit`` estimates them from measured steps.

    Defaults are plausible for a GPU serving engine: memory-bound kernels reach ~80% of
    peak HBM bandwidth and GEMMs ~60% of peak tensor throughput; a step costs a couple of
    milliseconds of launch and framework (scheduler, sampling) time.
    """

    bandwidth_efficiency: float = 0.8
    """Achieved / peak HBM bandwidth."""
    flops_efficiency: float = 0.6
    """Achieved / peak dense bf16 throughput."""
    l2_usable_fraction: float = 0.5
    """Share of L2 that reused prefix KV can occupy (the rest: weights, activations)."""
    step_overhead_s: float = 2e-3
    """Kernel launches and framework time per step."""
    request_overhead_s: float = 2e-6
    """Per-request bookkeeping (metadata, sampling) per step."""
    reuse_granularity: str = "layer"
    """Working set compared with L2: "layer" when the kernel walks the whole batch one
    layer at a time (GPU attention), "layer-head" when it walks it per (layer, KV head)
    (vLLM's CPU attention kernel)."""
    l2_bandwidth_efficiency: float = 1.0
    """Achieved / nominal L2 bandwidth; fitted by calibration, 1.0 means the estimate."""
    additive: bool = False
    """Step time = memory + compute instead of max(memory, compute). Calibrated profiles
    use this additive roofline, because the fit is a linear least-squares model."""

    def __post_init__(self) -> None:
        require(self, "reuse_granularity", self.reuse_granularity in GRANULARITIES,
                f"one of {GRANULARITIES}")
        require(self, "l2_usable_fraction", is_number(self.l2_usable_fraction) and
                0.0 <= self.l2_usable_fraction <= 1.0, "a number in [0, 1]")
        for name in ("bandwidth_efficiency", "flops_efficiency", "l2_bandwidth_efficiency"):
            value = getattr(self, name)
            require(self, name, is_number(value) and value > 0,
                    "a positive number (Infinity: the term is free)")
        for name in ("step_overhead_s", "request_overhead_s"):
            value = getattr(self, name)
            require(self, name, is_number(value) and math.isfinite(value) and value >= 0,
                    "a finite non-negative number of seconds")
        require(self, "additive", isinstance(self.additive, bool), "true or false")


@dataclass(frozen=True)
class StepCost:
    """Time and traffic of one step. ``hbm_bytes`` includes ``weight_bytes``."""

    seconds: float
    hbm_bytes: float
    l2_bytes: float
    weight_bytes: float
    flops: float
    memory_s: float = 0.0
    compute_s: float = 0.0

    @property
    def kv_bytes(self) -> float:
        """KV bytes read, from HBM and from L2."""
        return self.hbm_bytes - self.weight_bytes + self.l2_bytes

    @property
    def l2_hit_rate(self) -> float:
        """Share of KV bytes served from L2."""
        return self.l2_bytes / self.kv_bytes if self.kv_bytes else 0.0


_NO_TOKENS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class StepTraffic:
    """What a batch's cost depends on, independent of cache capacity and parameters.

    Summarising once lets calibration score many L2 capacities without re-walking batches.
    """

    requests: int = 0
    context_tokens: int = 0
    new_tokens: int = 0
    attention_tokens: int = 0
    """Sum over requests of new_tokens * context_tokens (attention work)."""
    shared_tokens: int = 0
    prefix_tokens: int = 0
    """Distinct prefix tokens: per group, the longest shared prefix in the step."""
    reuse_tokens: np.ndarray = field(default_factory=lambda: _NO_TOKENS)
    """Per re-read of a group's prefix: tokens an earlier member of the step already read."""
    reuse_distance: np.ndarray = field(default_factory=lambda: _NO_TOKENS)
    """Per re-read: KV tokens read since the previous reader finished the prefix."""


def summarize(batch: Sequence[BatchEntry]) -> StepTraffic:
    """Walk the batch in order once, in O(len(batch)), keeping per group the position
    (in cumulative KV tokens) where its last reader finished the prefix.

    The reuse distance of a re-read is the KV read in between: the previous reader's
    private part plus the whole context of every request between them. Where shared
    lengths differ within a group, only the part some earlier member read can be reused.
    """
    last: dict[Hashable, tuple[int, int]] = {}  # group -> (mark, longest prefix read)
    reuse: list[int] = []
    distance: list[int] = []
    read = new = attention = shared = 0
    for entry in batch:
        if entry.shared_tokens:
            seen = last.get(entry.group)
            longest = entry.shared_tokens
            if seen is not None:
                mark, longest = seen
                reuse.append(min(entry.shared_tokens, longest))
                distance.append(read - mark)
                longest = max(longest, entry.shared_tokens)
            last[entry.group] = (read + entry.shared_tokens, longest)
            shared += entry.shared_tokens
        read += entry.context_tokens
        new += entry.new_tokens
        attention += entry.new_tokens * entry.context_tokens
    return StepTraffic(
        requests=len(batch), context_tokens=read, new_tokens=new, attention_tokens=attention,
        shared_tokens=shared, prefix_tokens=sum(longest for _, longest in last.values()),
        reuse_tokens=np.array(reuse, dtype=np.int64),
        reuse_distance=np.array(distance, dtype=np.int64),
    )


class CostModel:
    """Roofline step time with on-chip reuse of shared-prefix KV.

    A step streams the weights once, each request's private KV from HBM, and each shared
    prefix from HBM for a group's first member and from L2 for a later one whose reuse
    distance and the prefix fit ``l2_usable_fraction * l2_bytes`` (``reuse_granularity``:
    per layer or per (layer, KV head)); with ``cascade=True`` each prefix is read once.
    Compute is ``2 * params`` FLOPs per new token plus attention's.  Time: max(memory,
    compute) (their sum if ``params.additive``), plus ``step_overhead_s`` and
    ``request_overhead_s`` per request; an empty batch costs nothing.  Each term, its
    efficiency factor and its source: docs/simulator.md, "The step-cost model".
    """

    def __init__(self, hardware: HardwareProfile, model: ModelProfile,
                 params: CostParams = CostParams(), cascade: bool = False) -> None:
        self.hardware = hardware
        self.model = model
        self.params = params
        self.cascade = cascade
        slices = model.layers * (model.kv_heads if params.reuse_granularity == "layer-head" else 1)
        capacity_bytes = params.l2_usable_fraction * hardware.l2_bytes
        self.capacity_tokens = capacity_bytes * slices / model.kv_bytes_per_token
        """Tokens of KV whose per-slice footprint fits the usable L2."""

    def step(self, batch: Sequence[BatchEntry]) -> StepCost:
        """Cost of one step, batch in execution order."""
        return self.cost(summarize(batch))

    def cost(self, traffic: StepTraffic) -> StepCost:
        """Cost of a step already summarised by :func:`summarize`."""
        if traffic.requests == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
        kv = self.model.kv_bytes_per_token
        l2_tokens = self.l2_tokens(traffic)
        hbm_kv_tokens = traffic.context_tokens - l2_tokens
        if self.cascade:
            hbm_kv_tokens -= traffic.shared_tokens - traffic.prefix_tokens
        weight_bytes = self.model.weight_bytes
        hbm_bytes = weight_bytes + hbm_kv_tokens * kv
        l2_bytes = float(l2_tokens * kv)
        flops = self.flops(traffic)
        memory_s = self._memory_seconds(hbm_bytes, l2_bytes)
        compute_s = flops / (self.hardware.bf16_flops * self.params.flops_efficiency)
        busy = memory_s + compute_s if self.params.additive else max(memory_s, compute_s)
        seconds = (busy + self.params.step_overhead_s
                   + self.params.request_overhead_s * traffic.requests)
        return StepCost(seconds, hbm_bytes, l2_bytes, weight_bytes, flops, memory_s, compute_s)

    def l2_tokens(self, traffic: StepTraffic) -> int:
        """Prefix KV tokens re-read from L2 (none under cascade: nothing is re-read)."""
        if self.cascade or not traffic.reuse_tokens.size:
            return 0
        capacity = self.capacity_tokens
        hits = (traffic.reuse_distance <= capacity) & (traffic.reuse_tokens <= capacity)
        return int(traffic.reuse_tokens[hits].sum())

    def flops(self, traffic: StepTraffic) -> float:
        m = self.model
        attention = 4 * m.layers * m.heads * m.head_dim * traffic.attention_tokens
        return 2 * m.params * traffic.new_tokens + attention

    def _memory_seconds(self, hbm_bytes: float, l2_bytes: float) -> float:
        hw, p = self.hardware, self.params
        hbm_s = hbm_bytes / (hw.hbm_bytes_per_s * p.bandwidth_efficiency)
        l2_s = l2_bytes / (hw.l2_bytes_per_s * p.l2_bandwidth_efficiency)
        return hbm_s + l2_s


def read_profile(path: str | Path) -> tuple[HardwareProfile, ModelProfile, CostParams]:
    """The hardware, model and parameters of a profile file (what ``feather calibrate``
    writes, ``calibrate.save_profile``), every field checked; ValueError naming the file
    and the field (OSError if it cannot be read)."""
    data = read_json(path)
    try:
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object with hardware, model and params")
        parts = ("hardware", HardwareProfile), ("model", ModelProfile), ("params", CostParams)
        missing = [name for name, _ in parts if name not in data]
        unknown = sorted(str(key) for key in data if key not in dict(parts))
        if missing or unknown:
            raise ValueError(f"missing {', '.join(missing)}" if missing else
                             f"unknown field(s) {', '.join(unknown)}")
        hardware, model, params = (from_dict(cls, data[name]) for name, cls in parts)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return hardware, model, params
