"""The self-check on vLLM's real CPU kernel: its batches are exact where they should be,
and ``feather attention-check`` prints the grid and writes the verdict."""

from __future__ import annotations

import json

import pytest

vllm = pytest.importorskip("vllm", reason="the vllm extra is not installed")

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from feather_sched.attention import selfcheck  # noqa: E402
from feather_sched.attention.selfcheck import Cell  # noqa: E402
from feather_sched.cli import app  # noqa: E402
from feather_sched.integrations.vllm.attention_check import CpuBatch, Geometry  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_is_exact_against_float64_and_a_wrong_block_is_not(dtype) -> None:
    """The trial's reference is the float64 attention over each row's own tokens, so the
    engine's kernel and the path both meet it; a row pointed at another group's prefix
    does not (the check would catch a wrong plan)."""
    batch = CpuBatch(Cell(300, 3, 4, suffix=40), Geometry(8, 4, 64), dtype, 128, seed=1)
    reference = batch.reference()
    tolerance = selfcheck.TOLERANCE[str(dtype).removeprefix("torch.")]
    engine = batch.engine().clone()
    assert selfcheck.relative_error(engine, reference) < tolerance
    assert selfcheck.relative_error(batch.shared().clone(), reference) < tolerance
    assert batch.plan is not None and len(batch.plan.groups) == 3
    batch.table[0, :2] = batch.table[4, :2]  # row 0 now reads group 1's prefix blocks
    assert selfcheck.relative_error(batch.engine().clone(), reference) > 10 * tolerance


def test_feather_attention_check_prints_the_grid_and_writes_the_verdict(tmp_path) -> None:
    out = tmp_path / "check.json"
    result = CliRunner().invoke(app, ["attention-check", "--max-model-len", "1200",
                                      "--dtype", "float32", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "| 512 | 1 x 4 |" in result.output and "| 1024 | 1 x 16 |" in result.output
    assert "Feather shared-prefix attention: " in result.output
    verdict = selfcheck.Verdict.from_json(json.loads(out.read_text()))
    assert verdict.shapes.max_context == 1200 and verdict.shapes.dtype == "float32"
    assert {r.cell.prefix for r in verdict.cells if r.speedup} == {512, 1024}
    assert verdict.max_error < selfcheck.TOLERANCE["float32"]


def test_the_cpu_check_travels_to_its_process_as_a_recipe() -> None:
    """What the child builds from the recipe's plain values (after a pickle round trip)
    is the engine's check: the same shapes, versions and threads."""
    import pickle

    from feather_sched.attention.isolation import resolve
    from feather_sched.integrations.vllm.attention_check import CpuSubject

    subject = CpuSubject(Geometry(8, 2, 64), torch.bfloat16, 128, 64, 4096, (("vllm", "x"),))
    recipe = pickle.loads(pickle.dumps(subject.recipe()))
    assert recipe.shapes == subject.shapes
    assert resolve(recipe.factory)(**recipe.kwargs).shapes == subject.shapes
