"""Calibration: the NNLS solver, and recovering known parameters from a step log of
synthetic steps."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest

from feather_sched.costmodel.calibrate import fit, load_profile, nnls, save_profile
from feather_sched.costmodel.cost import CostModel, CostParams
from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS
from feather_sched.telemetry.steplog import BatchEntry, read_steps, write_steps

GPU = HARDWARE["h100-sxm"]
MODEL = MODELS["llama-3-8b"]
TRUE = CostParams(bandwidth_efficiency=0.7, flops_efficiency=0.5, l2_usable_fraction=0.35,
                  step_overhead_s=3e-3, request_overhead_s=5e-6, l2_bandwidth_efficiency=0.8,
                  additive=True)


def random_batch(rng: random.Random, step: int) -> list[BatchEntry]:
    """A few prefix groups, decode or prefill chunks, kept together or shuffled."""
    batch = []
    for g in range(rng.randint(1, 6)):
        shared = rng.randint(200, 6000)
        for _ in range(rng.randint(1, 12)):
            new = 1 if rng.random() < 0.7 else rng.randint(16, 512)
            context = shared + rng.randint(new, 3000)
            batch.append(BatchEntry(f"s{step}g{g}", shared, context, new))
    if rng.random() < 0.5:
        rng.shuffle(batch)
    return batch


def synthetic_steps(params: CostParams, count: int = 200, noise: float = 0.003,
                    cascade: bool = False) -> list[tuple[list[BatchEntry], float]]:
    rng = random.Random(7)
    model = CostModel(GPU, MODEL, params, cascade=cascade)
    steps = []
    for step in range(count):
        batch = random_batch(rng, step)
        steps.append((batch, model.step(batch).seconds * (1 + rng.gauss(0, noise))))
    return steps


def test_fit_recovers_parameters_from_a_csv_round_trip(tmp_path) -> None:
    steps = synthetic_steps(TRUE)
    path = tmp_path / "steps.csv"
    write_steps(path, steps)
    assert read_steps(path) == steps

    params, report = fit(read_steps(path), GPU, MODEL, granularity="layer")
    assert abs(params.l2_usable_fraction - TRUE.l2_usable_fraction) <= 0.05 + 1e-9
    assert params.additive and params.reuse_granularity == "layer"
    assert report.rows == len(steps) and report.mape < 0.02 and report.r2 > 0.99
    fitted = CostModel(GPU, MODEL, params)
    predicted = np.array([fitted.step(batch).seconds for batch, _ in steps])
    measured = np.array([seconds for _, seconds in steps])
    assert np.mean(np.abs(predicted / measured - 1)) < 0.02
    assert params.bandwidth_efficiency == pytest.approx(TRUE.bandwidth_efficiency, rel=0.05)


@pytest.mark.parametrize("weighting", ["time", "relative"])
def test_both_weightings_recover_the_total_time(weighting: str) -> None:
    steps = synthetic_steps(TRUE)
    params, _ = fit(steps, GPU, MODEL, weighting=weighting)
    fitted = CostModel(GPU, MODEL, params)
    total = sum(fitted.step(batch).seconds for batch, _ in steps)
    assert total == pytest.approx(sum(seconds for _, seconds in steps), rel=0.01)
    with pytest.raises(ValueError, match="weighting must be one of"):
        fit(steps, GPU, MODEL, weighting="median")


def test_steps_of_a_cascade_kernel_fit_only_as_a_cascade() -> None:
    steps = synthetic_steps(TRUE, cascade=True)
    params, report = fit(steps, GPU, MODEL, cascade=True)
    assert report.mape < 0.02
    assert params.bandwidth_efficiency == pytest.approx(TRUE.bandwidth_efficiency, rel=0.1)
    assert "l2_bytes" in report.unidentified  # a cascade re-reads nothing from L2
    _, as_plain = fit(steps, GPU, MODEL)
    assert as_plain.mape > report.mape


def test_steps_without_sharing_leave_l2_unidentified() -> None:
    rng = random.Random(1)
    model = CostModel(GPU, MODEL, TRUE)
    steps = []
    for step in range(30):
        batch = [BatchEntry(f"{step}-{i}", 0, rng.randint(100, 4000), 1)
                 for i in range(rng.randint(1, 64))]
        steps.append((batch, model.step(batch).seconds))
    params, report = fit(steps, GPU, MODEL)
    assert "l2_bytes" in report.unidentified
    assert params.l2_bandwidth_efficiency == CostParams().l2_bandwidth_efficiency
    assert report.mape < 1e-6


def test_nnls_clamps_a_negative_coefficient() -> None:
    # Unconstrained optimum (1, -1); with x2 >= 0, minimise (x1-1)^2 + 1 + x1^2: x1 = 1/2.
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    x = nnls(a, np.array([1.0, -1.0, 0.0]))
    assert x == pytest.approx([0.5, 0.0])


def test_profile_round_trip(tmp_path) -> None:
    params = replace(TRUE, flops_efficiency=math.inf)
    save_profile(tmp_path / "p.json", GPU, MODEL, params)
    profile = load_profile(tmp_path / "p.json")
    assert profile == (GPU, MODEL, params)
    batch = [BatchEntry("a", 10, 20, 1)]
    assert profile.cost_model().step(batch) == CostModel(GPU, MODEL, params).step(batch)


def test_feather_calibrate_fits_several_logs_merged(tmp_path) -> None:
    """Each data-parallel rank writes its own log: a fit takes them all, as one."""
    from typer.testing import CliRunner

    from feather_sched.cli import app

    steps = synthetic_steps(TRUE, count=60)
    write_steps(tmp_path / "steps.rank0.csv", steps[:25])
    write_steps(tmp_path / "steps.rank1.csv", steps[25:])
    expected, report = fit(steps, GPU, MODEL)
    for logs in ([str(tmp_path)], [str(tmp_path / "steps.rank*.csv")],
                 [str(tmp_path / "steps.rank0.csv"), str(tmp_path / "steps.rank1.csv")]):
        out = tmp_path / "profile.json"
        result = CliRunner().invoke(app, ["calibrate", *logs, "--hardware", "h100-sxm",
                                          "--model", "llama-3-8b", "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert f"fitted {report.rows} steps of 2 log(s)" in result.output
        assert load_profile(out).params == expected
        out.unlink()
