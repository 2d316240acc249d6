"""The self-check's memory plan: ``feather attention-check --plan`` on real model shapes
stays under 1 GiB of host memory, running nothing; the plan covers what a batch really
holds; and the check holds one cell at a time."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from feather_sched.attention import check_memory, gpu_check, selfcheck
from feather_sched.attention.check_memory import cell_memory
from feather_sched.attention.gpu_check import PagedBatch
from feather_sched.attention.selfcheck import Cell, Shapes
from feather_sched.cli import app
from tests.helpers.selfcheck_fakes import ExactTrial

LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
              "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
              "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
MHA_7B = {**LLAMA_3_8B, "num_key_value_heads": 32, "max_position_embeddings": 32768,
          "torch_dtype": "float16"}


def model_dir(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("config, kv_heads", [(LLAMA_3_8B, 8), (MHA_7B, 32)],
                         ids=["llama-3-8b", "mha-7b"])
def test_the_plan_of_a_model_stays_under_a_gib_of_host_memory_and_runs_nothing(
        config, kv_heads, tmp_path, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the plan ran a check")

    monkeypatch.setattr(selfcheck, "check", refuse)
    monkeypatch.setattr(gpu_check.PagedBatch, "__init__", refuse)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, [
        "attention-check", "--plan", "--model", str(model_dir(tmp_path, config)),
        "--tensor-parallel-size", "1", "--dtype", "bfloat16", "--max-num-seqs", "256",
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["shapes"]["kv_heads"] == kv_heads and plan["shapes"]["max_rows"] == 256
    assert plan["shapes"]["dtype"] == "bfloat16" and plan["shapes"]["block_size"] == 16
    assert 0 < plan["peak_host_bytes"] <= 1 << 30
    # the device bound: the largest cell (8K prefix, 1 x 16 rows) and the fixed buffers
    assert (8192, 1, 16) in {(c["prefix"], c["groups"], c["per_group"]) for c in plan["cells"]}
    assert plan["peak_device_bytes"] < (2 << 30)
    assert "peak host" in result.output and "| 8192 | 1 x 16 |" in result.output


def test_the_plans_dtype_defaults_to_the_models_and_bad_input_is_a_clear_error(
        tmp_path) -> None:
    model = model_dir(tmp_path, MHA_7B)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["attention-check", "--plan", "--model", str(model),
                                      "--tensor-parallel-size", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    shapes = json.loads(out.read_text())["shapes"]
    assert (shapes["dtype"], shapes["q_heads"], shapes["kv_heads"]) == ("float16", 8, 8)
    result = CliRunner().invoke(app, ["attention-check", "--plan", "--model",
                                      str(tmp_path / "nowhere")])
    assert result.exit_code != 0 and "config.json" in result.output
    result = CliRunner().invoke(app, ["attention-check", "--plan", "--model", str(model),
                                      "--tensor-parallel-size", "3"])
    assert result.exit_code != 0 and "do not split over 3 ranks" in result.output


@pytest.mark.parametrize("cell", [Cell(300, 3, 5, suffix=33), Cell(640, 2, 20, suffix=200)],
                         ids=["with-reference", "without"])
@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_the_plan_covers_what_a_batch_holds(cell, physical) -> None:
    shapes = Shapes(device="cpu", q_heads=8, kv_heads=2, head_dim=64, dtype="bfloat16",
                    block_size=16, layout=physical, max_rows=64, max_context=4096)
    batch = PagedBatch(cell, 8, 2, 64, torch.bfloat16, 16, "cpu", seed=0, physical=physical)
    planned = cell_memory(cell, shapes)
    held = sum(t.untyped_storage().nbytes() for t in (batch.kv_cache, batch.query, batch.out,
                                                      batch.table, batch.seq_lens,
                                                      batch.starts))
    assert held <= planned.device_bytes
    assert batch.table_host.nbytes <= planned.host_bytes
    assert planned.reference == (batch.reference() is not None)
    assert batch.kv_cache.dtype == torch.bfloat16  # written in the engine's dtype


def test_the_check_holds_one_cell_at_a_time() -> None:
    alive: list[weakref.ref] = []
    most = []

    class Trial(ExactTrial):
        def __init__(self, cell: Cell) -> None:
            gc.collect()
            most.append(sum(ref() is not None for ref in alive))
            alive.append(weakref.ref(self))
            super().__init__(cell)

    class Subject:
        shapes = Shapes(device="cpu", q_heads=4, kv_heads=2, head_dim=16, dtype="float32",
                        block_size=16, layout="vec", max_rows=64, max_context=16384)
        idle_cost = True

        def trial(self, cell: Cell, seed: int) -> Trial:
            return Trial(cell)

        def seconds(self, run, reps: int) -> float:
            return 1.0

    verdict = selfcheck.check(Subject(), reps=1)
    assert len(most) == len(verdict.cells) > 10 and max(most) == 0


def test_the_memory_plan_is_the_fixed_buffers_and_the_largest_cell() -> None:
    shapes = Shapes(device="planned", q_heads=32, kv_heads=8, head_dim=128, dtype="bfloat16",
                    block_size=16, layout="NHD", max_rows=256, max_context=32768)
    from feather_sched.attention.gpu_decode import DecodeLimits

    limits = DecodeLimits.for_device(check_memory.PLAN_SMS, 256, 32, 8, 128)
    plan = check_memory.memory_plan(shapes, selfcheck.cells_to_run(shapes), limits)
    largest = max(plan.cells, key=lambda c: c.device_bytes)
    assert largest.cell == selfcheck.IDLE_CELL  # 16 rows of 1K tokens each: the most KV
    assert plan.peak_device_bytes == plan.fixed_device_bytes + largest.device_bytes
    assert plan.fixed_device_bytes >= limits.workspace_bytes + check_memory.ENGINE_ALLOWANCE
    assert all(c.reference == (c.cell.rows * c.cell.length <= 1 << 15
                               and c.cell.length <= selfcheck.REFERENCE_CONTEXT)
               for c in plan.cells)  # float64 only on small cells
    assert any(c.reference for c in plan.cells if c.cell in selfcheck.GRID)
    # The check's process is limited by this plan (its whole grid, the GPU's process).
    child = check_memory.planned_limits(shapes, cuda=True)
    assert child.memory_bytes == int(plan.peak_host_bytes * check_memory.LIMIT_HEADROOM)
    assert child.oom_score_adj == 1000
