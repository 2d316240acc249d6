"""GPU decode-attention kit on CPU: tiny sizes, torch path (and the Triton kernels in
Triton's interpreter where Triton is installed); its checks must catch real faults."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from feather_sched.telemetry.steplog import read_steps

torch = pytest.importorskip("torch")

KIT_PATH = Path(__file__).parents[1] / "benchmarks" / "gpu_decode" / "kit.py"


def load_kit():
    """Import kit.py by path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_decode_kit", KIT_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


kit = load_kit()
SWEEP = kit.Sweep(prefixes=(64,), groups=(1, 2), per_group=(2,), warmup=0, reps=2)
STUDIES = [kit.Study(kit.ORDERS, kit.TINY, SWEEP), kit.Study(kit.SHARED_PREFIX, kit.TINY, SWEEP),
           kit.Study(kit.SHARED_PREFIX, kit.TINY_MHA, SWEEP)]


def setup(config, device: str = "cpu"):
    """Environment with pools, a population, its float64 reference, and its batches."""
    env = kit.make_environment(device, kit.TINY, SWEEP)
    kit.allocate_pools(env, [config])
    pool = env.pools[0]
    population = kit.make_population(config, SWEEP.suffix, kit.TINY, pool.shape[0], device)
    expected = kit.reference(pool, population, kit.TINY)
    batches = {name: kit.make_batch(population, rows, name)
               for name, rows in kit.orders(config).items()}
    return env, pool, population, expected, batches


def test_run_checks_times_and_writes_calibration_steps(tmp_path: Path) -> None:
    report = kit.run("cpu", tmp_path, chosen=STUDIES, seed=7, log=lambda _: None)
    orders, *shared = report["studies"]
    errors = [e for config in orders["max_relative_error"].values() for e in config.values()]
    assert len(errors) == 2 * (3 + 4)  # (decode, cascade) x (orders of G=1, of G=2)
    assert max(errors) < kit.TOLERANCE
    for study in shared:  # (decode, cascade) on the sorted batch of G=1 and of G=2
        assert [len(config) for config in study["max_relative_error"].values()] == [2, 2]

    decode = [m for m in report["measurements"]
              if m["variant"] == "decode" and m["study"] == kit.ORDERS]
    steps = read_steps(tmp_path / "calibration.csv")
    assert len(steps) == len(decode) == 3 + 4  # mixed, sorted, one homogeneous per group
    for (batch, seconds), m in zip(steps, decode, strict=True):
        assert len(batch) == (2 if m["batch"].startswith("homogeneous") else 2 * m["groups"])
        assert {(e.shared_tokens, e.context_tokens, e.new_tokens) for e in batch} == {(64, 84, 1)}
        assert seconds == pytest.approx(m["step_seconds"]) and seconds > 0
    mixed = next(b for (b, _), m in zip(steps, decode, strict=True)
                 if m["batch"] == "mixed" and m["groups"] == 2)
    assert [e.group for e in mixed] == ["0", "1", "0", "1"]
    assert len(read_steps(tmp_path / "calibration-cascade.csv")) == 2

    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["gpu"] and len(saved["measurements"][0]["seconds"]) == SWEEP.reps
    shared_rows = [m for m in saved["measurements"] if m["study"] == kit.SHARED_PREFIX]
    assert {(m["geometry"], m["batch"], m["variant"]) for m in shared_rows} == {
        (g, "sorted", v) for g in ("tiny", "tiny-mha") for v in ("decode", "cascade")}
    table = (tmp_path / "table.md").read_text()
    assert "mixed/homogeneous" in table and "| tiny-mha | 64 | 2 | 2 |" in table


@pytest.mark.parametrize("variant", ["decode", "cascade"])
def test_a_block_table_pointing_at_another_groups_prefix_fails(variant: str) -> None:
    env, pool, population, expected, batches = setup(kit.Config(64, 2, 2))
    backend, batch = env.backends[0], batches["sorted"]
    kit.check("intact", kit.plan(backend, batch, variant), pool, expected[batch.rows])
    batch.block_table[0, 0] = population.prefix_blocks[1, 0]  # request 0 is group 0's first
    with pytest.raises(kit.CheckError, match="relative error"):
        kit.check("corrupt", kit.plan(backend, batch, variant), pool, expected[batch.rows])


def test_poisoned_outputs_catch_a_kernel_that_writes_nothing_or_part() -> None:
    env, pool, _, expected, batches = setup(kit.Config(64, 2, 2))
    batch = batches["mixed"]
    real = kit.plan(env.backends[0], batch, "decode")
    kit.check("real", real, pool, expected[batch.rows])  # leaves correct values behind

    def half(p) -> None:
        real.run(p)
        real.ws.out[1].fill_(float("nan"))  # as if row 1 were never written

    for run in (lambda p: None, half):
        with pytest.raises(kit.CheckError, match="nan"):
            kit.check("lazy", kit.Plan(run, real.ws), pool, expected[batch.rows])


INTERPRETED_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
from test_gpu_decode_kit import kit, setup
for config, variants in (((128, 2, 2), kit.VARIANTS), ((128, 1, 33), ["cascade"])):
    env, pool, _, expected, batches = setup(kit.Config(*config))
    triton, batch = env.backends[0], batches["mixed"]
    assert triton.name == "triton"
    triton.sms = 64  # as many programs wanted as on a GPU: split-K everywhere
    assert triton.splits(batch, batch.decode) > 1 and triton.splits(batch, batch.prefix) > 1
    tiles = kit.triton_kernels._row_tiles(batch.prefix, kit.TINY.gqa, kit.TINY.head_dim)[1]
    assert config[2] < 33 or tiles == 2  # 66 rows, tiles of 64
    for variant in variants:
        kit.check(variant, kit.plan(triton, batch, variant), pool, expected[batch.rows])
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_triton_kernels_in_the_interpreter() -> None:
    """Split-K, several query tiles per group, and the merge, in Triton's CPU interpreter
    (in a fresh process: TRITON_INTERPRET must be set before Triton is imported)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", INTERPRETED_CHECK, str(Path(__file__).parent)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


SELF_CHECK = """
import json, sys
from pathlib import Path
if sys.argv[3] == "hidden":
    sys.modules["sglang"] = None  # as on the lent GPU machine: torch and Triton only
sys.path.insert(0, sys.argv[1])
from test_gpu_decode_kit import kit
out = Path(sys.argv[2])
kit.main(["--device", "cpu", "--tiny", "--only", "self-check", "--out", str(out)])
records = json.loads((out / "self-check.json").read_text())
assert [(r["model"], r["engine"]) for r in records] == [("tiny", "kit"), ("tiny", "sglang")]
ran = records if sys.argv[3] == "present" else records[:1]
for record in ran:
    assert max(c["error"] for c in record["cells"]) < 1e-4, record
    assert any(c["reference_error"] is not None for c in record["cells"]), record
    assert 150 << 20 < record["measured_child_peak_host_bytes"], record  # torch was in it
    assert record["measured_child_peak_host_bytes"] <= record["plan"]["peak_host_bytes"]
if sys.argv[3] == "hidden":
    assert records[1]["skipped"].startswith("SGLang is not installed"), records[1]
    assert "cells" not in records[1]
assert "per-row decode" in (out / "self-check.md").read_text()
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("sglang", ["hidden", "present"])
def test_the_self_check_runs_in_the_kit(sglang: str, tmp_path: Path) -> None:
    """``--only self-check``: the engine-start check, Feather's per-row decode standing in
    for the engine's kernel, and SGLang's Triton subject where SGLang is installed (else
    skipped with the reason, as on a machine with torch and Triton only), each exact
    against its engine's kernel and float64, its check process's own peak resident
    memory (``isolation.resident_peak``) within its memory plan (``check_memory``, that
    process included; the SGLang server's own route, ``triton_recipe`` through
    ``run_isolated``), its verdict and
    table written (in Triton's interpreter, tiny shapes; on a GPU the same command at Llama
    shapes)."""
    if sglang == "present" and importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", SELF_CHECK, str(Path(__file__).parent),
                             str(tmp_path), sglang], env=env, capture_output=True,
                            text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tiny (kit): Feather shared-prefix attention: " in result.stdout
    assert "tiny (sglang): Feather shared-prefix attention: " in result.stdout
