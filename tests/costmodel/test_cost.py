"""Step-cost model: hand-computed steps on a made-up accelerator with exact numbers."""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feather_sched.costmodel.calibrate import save_profile
from feather_sched.costmodel.cost import (
    BatchEntry,
    CostModel,
    CostParams,
    read_profile,
    summarize,
)
from feather_sched.costmodel.hardware import HARDWARE, HardwareProfile, load_hardware, save_hardware
from feather_sched.costmodel.model_profiles import MODELS, ModelProfile, llama_parameter_count
from feather_sched.gates.step_model import StepPrior
from tests.helpers.strategies import documents, fields_or_any

# 2 layers x 2 KV heads x head dim 4 x 1 byte: K+V = 32 B/token, 16 B per layer, 8 B per
# (layer, KV head). Weights: 100 B.
TOY = ModelProfile("toy", layers=2, heads=4, kv_heads=2, head_dim=4, params=100, dtype_bytes=1)
KV = 32
PARAMS = CostParams(bandwidth_efficiency=0.5, flops_efficiency=0.5, l2_usable_fraction=0.5,
                    step_overhead_s=1.0, request_overhead_s=0.25)
OVERHEAD = 1.0 + 0.25  # one request
HBM_RATE = 100 * 0.5  # B/s achieved
FLOP_RATE = 1e6 * 0.5


def toy_hardware(l2_bytes: float = 64_000) -> HardwareProfile:
    return HardwareProfile("toy", hbm_bytes_per_s=100, l2_bytes=l2_bytes, l2_bytes_per_s=400,
                           bf16_flops=1e6, memory_bytes=1e6)


def toy_model(l2_bytes: float = 64_000, params: CostParams = PARAMS, cascade: bool = False,
              ) -> CostModel:
    return CostModel(toy_hardware(l2_bytes), TOY, params, cascade=cascade)


def group(name: str, members: int, shared: int, private: int) -> list[BatchEntry]:
    return [BatchEntry(name, shared, shared + private, 1) for _ in range(members)]


def test_weight_only_step() -> None:
    cost = toy_model().step([BatchEntry("a", 0, 0, 1)])
    # Memory 100 B / 50 B/s = 2 s beats compute 2 * 100 FLOPs / 5e5 FLOP/s.
    assert cost.hbm_bytes == 100 and cost.weight_bytes == 100 and cost.l2_bytes == 0
    assert cost.flops == 200
    assert cost.seconds == pytest.approx(2.0 + OVERHEAD)


def test_empty_batch_costs_nothing() -> None:
    assert toy_model().step([]).seconds == 0.0


def test_private_kv_is_read_from_hbm() -> None:
    cost = toy_model().step([BatchEntry("a", 0, 10, 1)])
    assert cost.hbm_bytes == 100 + 10 * KV
    assert cost.flops == 200 + 4 * 2 * 4 * 4 * 1 * 10
    assert cost.seconds == pytest.approx(420 / HBM_RATE + OVERHEAD)


def test_homogeneous_batch_rereads_prefix_from_l2() -> None:
    batch = group("g", 4, shared=1000, private=10)
    # Capacity 32 000 B = 2000 tokens per layer: prefix (1000) and distance (10) fit.
    cost = toy_model(l2_bytes=64_000).step(batch)
    assert cost.l2_bytes == 3 * 1000 * KV
    assert cost.hbm_bytes == 100 + (1000 + 4 * 10) * KV
    assert cost.l2_hit_rate == pytest.approx(3000 / 4040)
    memory = cost.hbm_bytes / HBM_RATE + cost.l2_bytes / 400
    assert cost.seconds == pytest.approx(memory + 1.0 + 4 * 0.25)


def test_small_l2_sends_every_reread_to_hbm() -> None:
    # Capacity 8000 B = 500 tokens per layer: the 1000-token prefix does not fit.
    cost = toy_model(l2_bytes=16_000).step(group("g", 4, shared=1000, private=10))
    assert cost.l2_bytes == 0
    assert cost.hbm_bytes == 100 + 4 * 1010 * KV


def test_reuse_distance_counts_private_part_and_requests_between() -> None:
    batch = [BatchEntry("a", 200, 1000, 1), BatchEntry("b", 0, 500, 1),
             BatchEntry("a", 300, 1000, 1)]
    traffic = summarize(batch)
    assert traffic.reuse_distance.tolist() == [800 + 500]
    assert traffic.reuse_tokens.tolist() == [200]  # the extra 100 were never read before
    assert traffic.prefix_tokens == 300


def test_ordered_batch_hits_where_interleaved_misses() -> None:
    a, b = group("a", 2, 200, 800), group("b", 2, 200, 800)
    ordered, interleaved = [*a, *b], [a[0], b[0], a[1], b[1]]
    # Reuse distance 800 tokens ordered, 800 + 1000 interleaved; capacity 19 200 B = 1200.
    model = toy_model(l2_bytes=38_400)
    fast, slow = model.step(ordered), model.step(interleaved)
    assert fast.l2_bytes == 2 * 200 * KV and slow.l2_bytes == 0
    assert fast.seconds < slow.seconds


def test_layer_head_granularity_fits_where_layer_does_not() -> None:
    batch = group("g", 4, shared=1000, private=10)
    # Capacity 12 000 B: a 1000-token prefix is 16 000 B per layer, 8000 B per (layer, head).
    per_layer = toy_model(l2_bytes=24_000).step(batch)
    per_head = toy_model(l2_bytes=24_000,
                         params=replace(PARAMS, reuse_granularity="layer-head")).step(batch)
    assert per_layer.l2_bytes == 0
    assert per_head.l2_bytes == 3 * 1000 * KV


def test_cascade_reads_each_prefix_once_per_group() -> None:
    a, b = group("a", 2, 200, 800), group("b", 2, 200, 800)
    model = toy_model(cascade=True)
    for batch in ([*a, *b], [a[0], b[0], a[1], b[1]]):
        cost = model.step(batch)
        assert cost.l2_bytes == 0
        assert cost.hbm_bytes == 100 + (2 * 200 + 4 * 800) * KV


def test_cascade_reads_longest_prefix_of_a_group() -> None:
    batch = [BatchEntry("a", 200, 300, 1), BatchEntry("a", 250, 300, 1)]
    assert toy_model(cascade=True).step(batch).hbm_bytes == 100 + (250 + 50 + 100) * KV


def test_big_prefill_is_compute_bound() -> None:
    cost = toy_model().step([BatchEntry("a", 0, 4000, 4000)])
    flops = 2 * 100 * 4000 + 4 * 2 * 4 * 4 * 4000 * 4000
    assert cost.compute_s > cost.memory_s
    assert cost.flops == flops
    assert cost.seconds == pytest.approx(flops / FLOP_RATE + OVERHEAD)


def test_additive_roofline_sums_memory_and_compute() -> None:
    batch = [BatchEntry("a", 0, 10, 1)]
    cost = toy_model(params=replace(PARAMS, additive=True)).step(batch)
    assert cost.seconds == pytest.approx(420 / HBM_RATE + 1480 / FLOP_RATE + OVERHEAD)


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError):
        BatchEntry("a", 11, 10, 1)
    with pytest.raises(ValueError):
        CostParams(reuse_granularity="head")


def test_batch_of_256_costs_well_under_a_millisecond_each() -> None:
    rng = random.Random(0)
    batch = [BatchEntry(rng.randrange(16), 1000, 1000 + rng.randrange(500), 1)
             for _ in range(256)]
    model = CostModel(HARDWARE["h100-sxm"], MODELS["llama-3-8b"])
    start = time.perf_counter()
    for _ in range(100):
        model.step(batch)
    assert (time.perf_counter() - start) / 100 < 5e-3  # ~0.3 ms measured; generous for CI


def test_model_profiles() -> None:
    assert MODELS["llama-3-8b"].kv_bytes_per_token == 131072
    assert MODELS["qwen2.5-0.5b"].hidden == 896
    tiny = MODELS["tiny-llama"]
    per_layer = 4 * 512 * 512 + 3 * 512 * 1024 + 2 * 512  # q, k, v, o; gate, up, down; norms
    assert tiny.params == 2 * 32000 * 512 + 2 * per_layer + 512  # embed + lm_head + final norm
    assert (tiny.layers, tiny.heads, tiny.kv_heads, tiny.head_dim) == (2, 8, 8, 64)


def test_llama_parameter_count_matches_llama_3_8b() -> None:
    config = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
    assert llama_parameter_count(config) == pytest.approx(8.03e9, rel=1e-3)


def test_hardware_profiles_round_trip(tmp_path) -> None:
    assert all(key == hw.name for key, hw in HARDWARE.items())
    assert HARDWARE["h200"].hbm_bytes_per_s == 4.8e12
    path = tmp_path / "cpu.json"
    save_hardware(toy_hardware(), path)
    assert load_hardware(path) == toy_hardware()
    path.write_text('{"name": "x", "bogus": 1}')
    with pytest.raises(ValueError, match="bogus"):
        load_hardware(path)


# ---- profile files, checked at load ------------------------------------------------------

POSITIVE = st.floats(1e-3, 1e15)
HARDWARE_FIELDS = {"name": st.text(min_size=1, max_size=8), "hbm_bytes_per_s": POSITIVE,
                   "l2_bytes": POSITIVE, "l2_bytes_per_s": POSITIVE, "bf16_flops": POSITIVE,
                   "memory_bytes": POSITIVE}
MODEL_FIELDS = {"name": st.text(min_size=1, max_size=8), "layers": st.integers(1, 128),
                "heads": st.integers(8, 64), "kv_heads": st.integers(1, 8),
                "head_dim": st.integers(1, 256), "params": POSITIVE,
                "dtype_bytes": st.sampled_from([1, 2, 4])}
PARAMS_FIELDS = {"bandwidth_efficiency": st.floats(1e-3, 1) | st.just(math.inf),
                 "flops_efficiency": st.floats(1e-3, 1) | st.just(math.inf),
                 "l2_usable_fraction": st.floats(0, 1), "step_overhead_s": st.floats(0, 1),
                 "request_overhead_s": st.floats(0, 1e-3),
                 "reuse_granularity": st.sampled_from(["layer", "layer-head"]),
                 "l2_bandwidth_efficiency": st.floats(1e-3, 1) | st.just(math.inf),
                 "additive": st.booleans()}
PROFILES = fields_or_any({"hardware": fields_or_any(HARDWARE_FIELDS),
                          "model": fields_or_any(MODEL_FIELDS),
                          "params": fields_or_any(PARAMS_FIELDS)})
SOME_BATCH = [BatchEntry(0, 512, 600, 1), BatchEntry(0, 512, 700, 1), BatchEntry(1, 0, 90, 64)]


@pytest.mark.parametrize(("part", "field", "value"), [
    ("hardware", "hbm_bytes_per_s", math.nan), ("hardware", "l2_bytes", -1.0),
    ("hardware", "bf16_flops", math.inf), ("hardware", "name", 3),
    ("model", "layers", 0), ("model", "kv_heads", 2.5), ("model", "kv_heads", 64),
    ("model", "params", math.inf), ("model", "dtype_bytes", True),
    ("params", "bandwidth_efficiency", math.nan), ("params", "flops_efficiency", 0),
    ("params", "step_overhead_s", math.inf), ("params", "l2_usable_fraction", 2),
    ("params", "additive", "yes"),
])
def test_a_bad_value_in_a_profile_is_refused_naming_the_file_and_field(
        tmp_path, part: str, field: str, value: object) -> None:
    path = tmp_path / "gpu.json"
    save_profile(path, toy_hardware(), TOY, PARAMS)
    data = json.loads(path.read_text())
    data[part][field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"^{path}: \w+\.{field} must be"):
        read_profile(path)
    with pytest.raises(ValueError, match=rf"prior '{path}' .*{path}: \w+\.{field}"):
        StepPrior.named(str(path))
    if part == "hardware":
        path.write_text(json.dumps(data[part]))
        with pytest.raises(ValueError, match=rf"^{path}: HardwareProfile\.{field} must be"):
            load_hardware(path)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(documents(PROFILES), documents(fields_or_any(HARDWARE_FIELDS)))
def test_a_profile_file_loads_whole_or_is_refused_naming_the_file(tmp_path, profile,
                                                                    hardware) -> None:
    """Whatever the files hold: each loader raises ValueError naming the file, or gives a
    profile whose step costs and prior are numbers (no NaN)."""
    path = tmp_path / "gpu.json"
    path.write_bytes(profile)
    try:
        parts = read_profile(path)
    except ValueError as error:
        assert str(error).startswith(f"{path}: ")
    else:
        cost = CostModel(*parts).step(SOME_BATCH)
        assert cost.seconds > 0 and not math.isnan(cost.seconds)
        prior = StepPrior.named(str(path))
        assert prior is not None and not any(map(math.isnan, prior.coefficients))
    path.write_bytes(hardware)
    try:
        loaded = load_hardware(path)
    except ValueError as error:
        assert str(error).startswith(f"{path}: ")
    else:
        assert CostModel(loaded, TOY).step(SOME_BATCH).seconds > 0
