"""A step-time model fitted online from the engine's own steps.

The step-cost model (``costmodel.cost``), made linear and learned while serving: a step's
time is ``theta . features`` over six features of its batch in execution order
(``costmodel.cost.summarize``: 1, requests, KV tokens read from HBM, KV tokens re-read
from L2, new tokens, attention tokens).  The L2 capacity enters non-linearly, so a grid of
capacities each keeps its own normal equations and the best-fitting one is used.  A
prior (a hardware profile's coefficients and capacity) acts as a ridge of
``prior_steps`` pseudo-steps, so measured steps take over within tens of steps; old
steps fade (``forgetting`` per step), so the fit follows a machine that drifts.

Costs: ``observe`` O(batch + grid); ``predict`` O(batch); a refit (every
``refit_every`` steps) solves one 6x6 system per grid point.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from feather_sched.costmodel.cost import CostModel, StepTraffic, summarize
from feather_sched.telemetry.steplog import BatchEntry

FEATURES = ("step", "requests", "hbm_kv_tokens", "l2_kv_tokens", "new_tokens",
            "attention_tokens")
AUTO = "auto"
"""The prior option that asks for the engine's own profile (``StepPrior.for_engine``)."""
CAPACITY_GRID = (0, *(2 ** i for i in range(6, 23)))
"""L2 capacities tried, in KV tokens: none, then 64 .. 4M tokens."""


@dataclass(frozen=True)
class StepPrior:
    """Seconds per unit of each of ``FEATURES`` and the L2 capacity in KV tokens."""

    coefficients: tuple[float, ...]
    capacity_tokens: float

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES) or min(self.coefficients) < 0:
            raise ValueError(f"a prior needs {len(FEATURES)} non-negative coefficients")
        if self.capacity_tokens < 0:
            raise ValueError("capacity_tokens must be non-negative")

    @classmethod
    def of(cls, cost_model: CostModel) -> StepPrior:
        """The additive roofline of a cost model in per-token units."""
        hw, model, p = cost_model.hardware, cost_model.model, cost_model.params
        hbm = hw.hbm_bytes_per_s * p.bandwidth_efficiency
        l2 = hw.l2_bytes_per_s * p.l2_bandwidth_efficiency
        flops = hw.bf16_flops * p.flops_efficiency
        kv = model.kv_bytes_per_token
        return cls((model.weight_bytes / hbm + p.step_overhead_s, p.request_overhead_s,
                    kv / hbm, kv / l2, 2 * model.params / flops,
                    4 * model.layers * model.heads * model.head_dim / flops),
                   cost_model.capacity_tokens)

    @classmethod
    def named(cls, name: str) -> StepPrior | None:
        """A prior by name: ``none``; ``auto`` (none here: the engine's profile is found by
        ``for_engine``, where an adapter describes the engine); ``<hardware>/<model>`` from
        the profiles this package ships (e.g. ``h100-sxm/llama-3-8b``); or the path of a
        ``feather calibrate`` profile.  ValueError naming the choices when nothing
        matches."""
        from feather_sched.costmodel.calibrate import load_profile
        from feather_sched.costmodel.hardware import HARDWARE
        from feather_sched.costmodel.model_profiles import MODELS

        if name in ("none", AUTO):
            return None
        hardware, _, model = name.partition("/")
        if hardware in HARDWARE and model in MODELS:
            return cls.of(CostModel(HARDWARE[hardware], MODELS[model]))
        if Path(name).is_file():
            try:
                profile = load_profile(name)
            except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as error:
                raise ValueError(f"prior {name!r} is not a calibrated profile: {error}") \
                    from None
            return cls.of(CostModel(profile.hardware, profile.model, profile.params))
        raise ValueError(f"unknown prior {name!r}: use none, auto, <hardware>/<model> with "
                         f"hardware in {sorted(HARDWARE)} and model in {sorted(MODELS)}, "
                         f"or a profile written by feather calibrate")

    @classmethod
    def for_engine(cls, engine: EngineShape) -> tuple[StepPrior | None, str]:
        """The prior of the engine's device and model, from the built-in hardware profiles,
        and how a gate starts from it, for the log (without one it starts cold)."""
        from feather_sched.costmodel.hardware import device_profile
        from feather_sched.costmodel.model_profiles import ModelProfile

        hardware = device_profile(engine.device_name)
        if hardware is None:
            return None, f"starts cold: no built-in profile for device {engine.device_name!r}"
        if engine.pipeline_parallel > 1:
            return None, "starts cold: no prior under pipeline parallelism"
        model = ModelProfile.of_engine(engine.model_config, dtype_bytes=engine.dtype_bytes,
                                       tensor_parallel=engine.tensor_parallel)
        if model is None:
            return None, "starts cold: the model is not a dense Llama-style transformer"
        return cls.of(CostModel(hardware, model)), (
            f"starts from the {hardware.name} profile ({model.layers} layers, "
            f"{model.kv_heads} KV heads x {model.head_dim} per rank)")


@dataclass(frozen=True)
class EngineShape:
    """What an adapter knows of the engine's device and model, for ``StepPrior.for_engine``."""

    device_name: str | None
    """As the driver reports it (NVML, ``torch.cuda.get_device_name``); None if unknown."""
    model_config: Mapping[str, Any]
    """The model's Hugging Face config fields (its text model's, for a multimodal one)."""
    dtype_bytes: int = 2
    """Bytes per weight and KV element as the engine runs the model."""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @classmethod
    def of(cls, model_config: Any, device_name: Callable[[], str | None], *,
           tensor_parallel: int = 1, pipeline_parallel: int = 1) -> EngineShape:
        """The shape of an engine whose ``model_config`` carries ``hf_text_config`` and a
        torch ``dtype`` (vLLM's and SGLang's both do).  ``device_name`` is asked once; if it
        raises, the name is unknown and that is logged, never raised: it only picks a
        prior."""
        try:
            device = device_name()
        except Exception as error:
            logging.getLogger("feather_sched").info(
                "Feather: no device name from the engine (%s)", error)
            device = None
        return cls(device_name=device, model_config=model_config.hf_text_config.to_dict(),
                   dtype_bytes=model_config.dtype.itemsize, tensor_parallel=tensor_parallel,
                   pipeline_parallel=pipeline_parallel)


class OnlineStepModel:
    """Step time from batch composition, learned from observed steps (see module doc)."""

    def __init__(self, prior: StepPrior | None = None, *, prior_steps: float = 8.0,
                 forgetting: float = 0.995, refit_every: int = 8) -> None:
        if prior_steps < 0 or not 0 < forgetting <= 1 or refit_every < 1:
            raise ValueError("need prior_steps >= 0, 0 < forgetting <= 1, refit_every >= 1")
        self.prior = prior
        self.prior_steps = prior_steps
        self.forgetting = forgetting
        self.refit_every = refit_every
        grid = len(CAPACITY_GRID)
        width = len(FEATURES)
        self._gram = np.zeros((grid, width, width))
        self._moment = np.zeros((grid, width))
        self._square = 0.0
        self._count = 0.0
        """Steps observed, faded like the sums."""
        self._unfitted = 0
        self.steps = 0
        """Steps observed."""
        self.coefficients = np.array(prior.coefficients if prior else [0.0] * width)
        self.capacity_tokens = prior.capacity_tokens if prior else 0.0

    @property
    def ready(self) -> bool:
        """Whether predictions mean anything: a prior, or a fit from measured steps."""
        return self.prior is not None or (self.steps >= 2 * len(FEATURES)
                                          and bool(self.coefficients.any()))

    def predict(self, batch: Sequence[BatchEntry]) -> float:
        """Predicted seconds of a step running ``batch`` in this order; 0 for none."""
        traffic = summarize(batch)
        if not traffic.requests:
            return 0.0
        return float(self.coefficients @ _features(traffic, (self.capacity_tokens,))[0])

    def observe(self, batch: Sequence[BatchEntry], seconds: float) -> None:
        """Learn from one measured step (ignored when empty or not timed)."""
        if not batch or not seconds > 0:
            return
        rows = _features(summarize(batch), CAPACITY_GRID)
        weight = 1.0 / seconds ** 2  # relative error: small and large steps count alike
        decay = self.forgetting
        self._gram *= decay
        self._moment *= decay
        self._gram += weight * rows[:, :, None] * rows[:, None, :]
        self._moment += weight * seconds * rows
        self._square = decay * self._square + weight * seconds ** 2
        self._count = decay * self._count + 1.0
        self.steps += 1
        self._unfitted += 1
        if self._unfitted >= self.refit_every:
            self.refit()

    def refit(self) -> None:
        """Solve for the coefficients at every capacity; keep the best explanation."""
        self._unfitted = 0
        best = None
        preferred = self._prior_capacity()
        for index, capacity in enumerate(CAPACITY_GRID):
            theta, error = self._solve(index)
            if capacity == preferred:
                error *= 0.99  # where steps cannot tell capacities apart, keep the prior's
            if best is None or error < best[0]:
                best = (error, theta, capacity)
        assert best is not None
        _, self.coefficients, self.capacity_tokens = best

    def _solve(self, index: int) -> tuple[np.ndarray, float]:
        """Ridge toward the prior: ``prior_steps`` steps' worth of each feature's mean square."""
        gram, moment = self._gram[index], self._moment[index]
        width = len(FEATURES)
        prior = np.array(self.prior.coefficients) if self.prior else np.zeros(width)
        mean_square = np.diag(gram) / max(self._count, 1.0)
        ridge = np.diag(self.prior_steps * mean_square + 1e-12 * (mean_square.max() + 1.0))
        try:
            theta = np.linalg.solve(gram + ridge, moment + ridge @ prior)
        except np.linalg.LinAlgError:
            theta = prior.copy()
        theta = np.maximum(theta, 0.0)
        error = self._square - 2 * theta @ moment + theta @ gram @ theta
        return theta, float(error)

    def _prior_capacity(self) -> int | None:
        """The grid capacity nearest the prior's (None without a prior)."""
        if self.prior is None:
            return None
        return min(CAPACITY_GRID, key=lambda c: abs(c - self.prior.capacity_tokens))


def _features(traffic: StepTraffic, capacities: Sequence[float]) -> np.ndarray:
    """The features of a step at each L2 capacity, one row each: a re-read hits L2 when
    both its reuse distance and the prefix fit (``costmodel.cost.CostModel.l2_tokens``)."""
    reuse, distance = traffic.reuse_tokens, traffic.reuse_distance
    limits = np.asarray(capacities, dtype=float)[:, None]
    l2 = (((distance <= limits) & (reuse <= limits)) * reuse).sum(axis=1).astype(float)
    rows = np.empty((len(capacities), len(FEATURES)))
    rows[:] = (1.0, traffic.requests, traffic.context_tokens, 0.0, traffic.new_tokens,
               traffic.attention_tokens)
    rows[:, 2] -= l2
    rows[:, 3] = l2
    return rows
