"""The online step-time model: its prior is the simulator's roofline, and it learns the
truth from measured steps, L2 capacity included."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from feather_sched.costmodel.calibrate import save_profile
from feather_sched.costmodel.cost import CostModel, CostParams
from feather_sched.costmodel.hardware import HARDWARE
from feather_sched.costmodel.model_profiles import MODELS, ModelProfile
from feather_sched.gates.step_model import CAPACITY_GRID, EngineShape, OnlineStepModel, StepPrior
from feather_sched.telemetry.steplog import BatchEntry

HARDWARE_H100 = HARDWARE["h100-sxm"]
LLAMA = MODELS["llama-3-8b"]


def batch(rng: np.random.Generator) -> list[BatchEntry]:
    """A decode step of a few groups in random order, with a prefill chunk at times."""
    groups = int(rng.integers(1, 5))
    prefix = int(rng.choice([512, 2048, 8192]))
    entries = [BatchEntry(group=int(rng.integers(groups)), shared_tokens=prefix,
                          context_tokens=prefix + int(rng.integers(1, 400)), new_tokens=1)
               for _ in range(int(rng.integers(2, 64)))]
    if rng.random() < 0.3:
        entries.append(BatchEntry(group="solo", shared_tokens=0, context_tokens=2048,
                                  new_tokens=2048))
    return entries


def additive(params: CostParams | None = None, hardware=HARDWARE_H100) -> CostModel:
    """The simulator's cost model in the additive form the step model is linear in."""
    params = params or CostParams()
    return CostModel(hardware, LLAMA, CostParams(**{**params.__dict__, "additive": True}))


def test_the_prior_is_the_additive_roofline() -> None:
    truth = additive()
    model = OnlineStepModel(StepPrior.of(truth))
    rng = np.random.default_rng(0)
    for _ in range(20):
        entries = batch(rng)
        assert model.predict(entries) == pytest.approx(truth.step(entries).seconds, rel=1e-9)


def test_it_learns_another_machine_from_its_steps() -> None:
    """Started from the H100's roofline, it converges on a slower GPU with a smaller L2."""
    truth = additive(CostParams(bandwidth_efficiency=0.5, l2_usable_fraction=0.25,
                                step_overhead_s=5e-3), HARDWARE["rtx6000-ada"])
    model = OnlineStepModel(StepPrior.of(additive()), forgetting=1.0)
    rng = np.random.default_rng(1)
    steps = [batch(rng) for _ in range(300)]
    held_out = [batch(rng) for _ in range(50)]

    def error() -> float:
        return float(np.mean([abs(model.predict(b) / truth.step(b).seconds - 1)
                              for b in held_out]))

    before = error()
    for entries in steps:
        model.observe(entries, truth.step(entries).seconds)
    model.refit()
    assert before > 0.3, before
    assert error() < 0.03
    lower = max(c for c in CAPACITY_GRID if c <= truth.capacity_tokens)
    assert lower <= model.capacity_tokens <= 2 * lower  # the grid points around the truth


def test_without_a_prior_it_is_not_ready_until_it_has_measured_steps() -> None:
    truth = additive()
    model = OnlineStepModel(None)
    rng = np.random.default_rng(2)
    assert not model.ready
    for _ in range(16):
        entries = batch(rng)
        model.observe(entries, truth.step(entries).seconds)
    assert model.ready


def test_unmeasured_and_empty_steps_teach_nothing() -> None:
    model = OnlineStepModel(None)
    model.observe([], 0.1)
    model.observe([BatchEntry("g", 0, 10, 1)], 0.0)
    assert model.steps == 0
    assert model.predict([]) == 0.0


def test_priors_by_name_and_from_a_calibrated_profile(tmp_path) -> None:
    assert StepPrior.named("none") is None
    assert StepPrior.named("auto") is None  # the engine's profile comes from for_engine
    assert StepPrior.named("h100-sxm/llama-3-8b") == StepPrior.of(CostModel(HARDWARE_H100,
                                                                            LLAMA))
    path = tmp_path / "profile.json"
    save_profile(path, HARDWARE_H100, LLAMA, CostParams(bandwidth_efficiency=0.5))
    assert StepPrior.named(str(path)).coefficients[2] == pytest.approx(
        LLAMA.kv_bytes_per_token / (HARDWARE_H100.hbm_bytes_per_s * 0.5))
    with pytest.raises(ValueError, match=r"unknown prior 'h100/llama'.*feather calibrate"):
        StepPrior.named("h100/llama")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a calibrated profile"):
        StepPrior.named(str(tmp_path / "bad.json"))


LLAMA_3_8B_CONFIG = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_hidden_layers": 32, "vocab_size": 128256}
"""meta-llama/Meta-Llama-3-8B's config.json, as an engine reports it."""


def test_the_engine_prior_is_its_gpus_profile_for_its_model() -> None:
    prior, note = StepPrior.for_engine(EngineShape("NVIDIA H100 80GB HBM3", LLAMA_3_8B_CONFIG))
    model = ModelProfile.of_engine(LLAMA_3_8B_CONFIG)
    assert prior == StepPrior.of(CostModel(HARDWARE_H100, model))
    assert "h100-sxm" in note
    # the weights read per step: the config's 8.03e9 parameters at the profile's bandwidth
    assert prior.coefficients[0] == pytest.approx(StepPrior.of(CostModel(
        HARDWARE_H100, LLAMA)).coefficients[0], rel=0.001)


def test_each_tensor_parallel_rank_reads_its_share() -> None:
    whole, _ = StepPrior.for_engine(EngineShape("NVIDIA H200", LLAMA_3_8B_CONFIG))
    rank, _ = StepPrior.for_engine(EngineShape("NVIDIA H200", LLAMA_3_8B_CONFIG,
                                               tensor_parallel=2))
    launches = CostParams().step_overhead_s
    assert rank.coefficients[0] - launches == pytest.approx(  # the weights read
        (whole.coefficients[0] - launches) / 2)
    assert rank.coefficients[2] == pytest.approx(whole.coefficients[2] / 2)  # 4 KV heads
    fp32, _ = StepPrior.for_engine(EngineShape("NVIDIA H200", LLAMA_3_8B_CONFIG,
                                               dtype_bytes=4))
    assert fp32.coefficients[2] == pytest.approx(2 * whole.coefficients[2])


@pytest.mark.parametrize(("shape", "reason"), [
    (EngineShape("cpu", LLAMA_3_8B_CONFIG), "no built-in profile for device 'cpu'"),
    (EngineShape("NVIDIA H100 PCIe", LLAMA_3_8B_CONFIG), "no built-in profile"),
    (EngineShape(None, LLAMA_3_8B_CONFIG), "no built-in profile for device None"),
    (EngineShape("NVIDIA H200", {**LLAMA_3_8B_CONFIG, "num_local_experts": 8}),
     "not a dense"),
    (EngineShape("NVIDIA H200", {"model_type": "llama"}), "not a dense"),
    (EngineShape("NVIDIA H200", LLAMA_3_8B_CONFIG, pipeline_parallel=2), "pipeline"),
])
def test_engines_without_a_profile_get_no_prior(shape: EngineShape, reason: str) -> None:
    prior, note = StepPrior.for_engine(shape)
    assert prior is None and reason in note


def test_an_engine_shape_from_an_engines_model_config(caplog) -> None:
    """vLLM's and SGLang's model configs both carry ``hf_text_config`` and a torch dtype;
    a device name that cannot be read is logged and left unknown, never raised."""
    import torch

    hf = SimpleNamespace(to_dict=lambda: {"hidden_size": 4096})
    model = SimpleNamespace(hf_text_config=hf, dtype=torch.bfloat16)
    shape = EngineShape.of(model, lambda: "NVIDIA H200", tensor_parallel=2)
    assert shape == EngineShape("NVIDIA H200", {"hidden_size": 4096}, 2, 2, 1)

    def no_driver() -> str:
        raise RuntimeError("no NVML")

    with caplog.at_level("INFO", logger="feather_sched"):
        assert EngineShape.of(model, no_driver).device_name is None
    assert "no device name from the engine (no NVML)" in caplog.text
