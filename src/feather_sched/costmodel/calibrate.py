"""Fit the step-cost model's parameters to measured steps, and store the result.

Measured steps come as a step log (``feather_sched.telemetry.steplog``: one row per request of a
step, written by the vLLM adapter and the GPU kernel kit alike). The fit keeps the
model's structure but makes the roofline additive (time = a*hbm_bytes + b*l2_bytes +
c*flops + d + e*requests), since that is linear in the unknowns; the L2 capacity enters
non-linearly, so it is searched on a grid with a non-negative least-squares solve per
grid point.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from feather_sched.costmodel.cost import (
    CostModel,
    CostParams,
    StepTraffic,
    read_profile,
    summarize,
)
from feather_sched.costmodel.hardware import HardwareProfile
from feather_sched.costmodel.model_profiles import ModelProfile
from feather_sched.telemetry.steplog import BatchEntry

DEFAULT_GRID = tuple(round(0.05 * i, 2) for i in range(1, 21))
"""Candidate ``l2_usable_fraction`` values: 0.05, 0.10, ..., 1.0."""
FEATURES = ("hbm_bytes", "l2_bytes", "flops", "step", "requests")


# --- fit -------------------------------------------------------------------------------

@dataclass(frozen=True)
class FitReport:
    """How well the fitted additive model explains the measured steps."""

    rows: int
    """Steps used (non-empty, with positive measured time)."""
    mape: float
    """Mean absolute percentage error of predicted step times, as a fraction."""
    r2: float
    """Coefficient of determination of predicted step times."""
    coefficients: tuple[float, ...]
    """Seconds per unit of each of FEATURES."""
    grid_error: tuple[tuple[float, float], ...]
    """(l2_usable_fraction, RMS relative error) per grid point; flat means L2 is not
    identified by these steps."""
    unidentified: tuple[str, ...]
    """Parameters no step informs (an all-zero feature); they keep their defaults."""


WEIGHTINGS = ("time", "relative")


def fit(steps: Sequence[tuple[Sequence[BatchEntry], float]], hardware: HardwareProfile,
        model: ModelProfile, *, granularity: str = "layer",
        grid: Sequence[float] = DEFAULT_GRID,
        weighting: str = "time", cascade: bool = False) -> tuple[CostParams, FitReport]:
    """Fit CostParams (additive roofline) to measured steps.

    Each grid point fixes ``l2_usable_fraction``; the other parameters come from a
    non-negative least-squares fit, and the grid point with the lowest error wins.
    ``weighting="time"`` fits seconds, so a run's total time (hence its throughput) is
    what comes out right, long prefill steps included; ``"relative"`` fits relative
    error, so short and long steps weigh alike. ``cascade``: the steps ran a shared-prefix
    kernel, so each group's prefix counts once per step (use the profile with
    ``CostModel(..., cascade=True)`` too).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    used = [(summarize(batch), t) for batch, t in steps if batch and t > 0]
    if len(used) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} non-empty steps with positive "
                         f"time, got {len(used)}")
    traffic = [s for s, _ in used]
    times = np.array([t for _, t in used])
    base = CostParams(reuse_granularity=granularity, additive=True)
    scored = []
    for fraction in grid:
        params = replace(base, l2_usable_fraction=fraction)
        x = features(CostModel(hardware, model, params, cascade=cascade), traffic)
        scale = times if weighting == "relative" else np.full(len(times), times.mean())
        coefficients = nnls(x / scale[:, None], times / scale)
        error = float(np.sqrt(np.mean(((x @ coefficients - times) / scale) ** 2)))
        scored.append((error, fraction, x, coefficients))
    _, fraction, x, coefficients = min(scored, key=lambda s: s[0])
    unidentified = tuple(n for n, column in zip(FEATURES, x.T, strict=True) if not column.any())
    params = _to_params(replace(base, l2_usable_fraction=fraction), coefficients, unidentified,
                        hardware)
    predicted = x @ coefficients
    report = FitReport(
        rows=len(times), mape=float(np.mean(np.abs(predicted / times - 1))),
        r2=float(1 - np.sum((predicted - times) ** 2) / np.sum((times - times.mean()) ** 2)),
        coefficients=tuple(float(c) for c in coefficients),
        grid_error=tuple((float(f), s[0]) for f, s in zip(grid, scored, strict=True)),
        unidentified=unidentified,
    )
    return params, report


def features(cost_model: CostModel, traffic: Sequence[StepTraffic]) -> np.ndarray:
    """One row per step: the additive model's regressors (FEATURES)."""
    rows = []
    for step in traffic:
        cost = cost_model.cost(step)
        rows.append((cost.hbm_bytes, cost.l2_bytes, cost.flops, 1.0, step.requests))
    return np.array(rows, dtype=float)


def _to_params(base: CostParams, coefficients: np.ndarray, unidentified: tuple[str, ...],
               hardware: HardwareProfile) -> CostParams:
    """Seconds-per-unit coefficients back to CostParams (0 s/byte: an infinite efficiency,
    the term is free); unidentified parameters keep their defaults."""
    a, b, c, d, e = (float(v) for v in coefficients)

    def efficiency(seconds_per_unit: float, peak: float) -> float:
        return 1.0 / (seconds_per_unit * peak) if seconds_per_unit > 0 else math.inf

    fitted = {
        "hbm_bytes": ("bandwidth_efficiency", efficiency(a, hardware.hbm_bytes_per_s)),
        "l2_bytes": ("l2_bandwidth_efficiency", efficiency(b, hardware.l2_bytes_per_s)),
        "flops": ("flops_efficiency", efficiency(c, hardware.bf16_flops)),
        "step": ("step_overhead_s", d),
        "requests": ("request_overhead_s", e),
    }
    return replace(base, **{name: value for feature, (name, value) in fitted.items()
                            if feature not in unidentified})


def nnls(a: np.ndarray, b: np.ndarray, max_iterations: int = 100) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson & Hanson, "Solving Least Squares
    Problems", 1974, ch. 23). Columns are scaled to unit norm first for conditioning;
    all-zero columns get 0."""
    norms = np.linalg.norm(a, axis=0)
    live = norms > 0
    scaled = a[:, live] / norms[live]
    x = _lawson_hanson(scaled, b, max_iterations)
    result = np.zeros(a.shape[1])
    result[live] = x / norms[live]
    return result


def _lawson_hanson(a: np.ndarray, b: np.ndarray, max_iterations: int) -> np.ndarray:
    n = a.shape[1]
    tolerance = 1e-10 * max(1.0, float(np.linalg.norm(b)))
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iterations):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max() <= tolerance:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                break
            # Move from x towards z until the first passive variable reaches zero; drop it.
            blocking = passive & (z <= 0)
            ratios = np.full(n, np.inf)
            ratios[blocking] = x[blocking] / np.maximum(x[blocking] - z[blocking], 1e-300)
            first = int(np.argmin(ratios))
            x = x + ratios[first] * (z - x)
            x[first] = 0.0
            passive &= x > 0
        x = z
    return x


# --- profiles --------------------------------------------------------------------------

class Profile(NamedTuple):
    """What costing a step needs: hardware, model and fitted parameters."""

    hardware: HardwareProfile
    model: ModelProfile
    params: CostParams

    def cost_model(self, cascade: bool = False) -> CostModel:
        return CostModel(self.hardware, self.model, self.params, cascade=cascade)


def save_profile(path: str | Path, hardware: HardwareProfile, model: ModelProfile,
                 params: CostParams) -> None:
    """One JSON object with hardware, model and params (infinite efficiencies are
    written as ``Infinity``, which Python's json reads back)."""
    data = {"hardware": asdict(hardware), "model": asdict(model), "params": asdict(params)}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def load_profile(path: str | Path) -> Profile:
    """A profile written by ``save_profile``; ValueError naming the file and the field."""
    return Profile(*read_profile(path))
