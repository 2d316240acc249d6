"""The end-to-end proof's logic against a fake GPU engine: a path that changes one token
fails it, naming where; the verdict is kept under the kernel check's key, and ``auto`` on
CUDA acts only where a kept proof passed (``attention_gpu.proven``)."""

from __future__ import annotations

import pytest

from feather_sched.attention import end_to_end, selfcheck
from feather_sched.attention.end_to_end import EndToEnd, compare
from feather_sched.attention.selfcheck import Shapes

SHAPES = Shapes(device="fake H100", q_heads=32, kv_heads=8, head_dim=128, dtype="bfloat16",
                block_size=16, layout="FlashAttention", max_rows=256, max_context=8192,
                versions=(("vllm", "0.34.0"), ("flash-attn", "3")))
GREEDY = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]


def fake_engine(wrong: tuple[int, int] | None = None):
    """A GPU engine's greedy outputs over the check's prompts, the path's run with token
    ``wrong`` (prompt, position) changed; the path's run is the faster."""
    def runs(path_on: bool) -> tuple[list[list[int]], float]:
        outputs = [list(row) for row in GREEDY]
        if path_on and wrong is not None:
            outputs[wrong[0]][wrong[1]] += 1
        return outputs, 1.0 if path_on else 1.5
    return runs


@pytest.fixture(autouse=True)
def cache_here(tmp_path, monkeypatch):
    monkeypatch.setattr(selfcheck, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(end_to_end, "cache_dir", lambda: tmp_path)


def test_a_path_that_changes_one_token_fails_the_proof_naming_it():
    failed = compare(SHAPES, fake_engine(wrong=(1, 3)))
    assert not failed.passed and failed.tokens == 12
    assert failed.reason == "prompt 1, token 3: 25 with the path, 24 without"
    passed = compare(SHAPES, fake_engine())
    assert passed.passed and passed.reason == "every token the engine's own"
    assert "1.50x" in passed.line()


def test_the_proof_is_kept_under_the_kernel_checks_key():
    assert end_to_end.kept(SHAPES) is None
    verdict = compare(SHAPES, fake_engine())
    path = end_to_end.keep(verdict)
    assert path.name == f"{SHAPES.key()}.end-to-end.json"
    assert end_to_end.kept(SHAPES) == verdict
    fa2 = Shapes(**{**SHAPES.__dict__, "versions": (("vllm", "0.34.0"), ("flash-attn", "2"))})
    assert end_to_end.kept(fa2) is None  # measured on FA3: not FA2's
    path.write_text("{broken")
    assert end_to_end.kept(SHAPES) is None


def test_auto_on_cuda_acts_only_after_a_passing_proof():
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    from feather_sched.integrations.vllm.attention_gpu import (
        END_TO_END_COMMAND,
        decision,
        proven,
    )

    assert decision("auto", None).check and not decision("on", None).check
    assert decision("auto", "off with speculative decoding").reason == \
        "off with speculative decoding"
    kernel_passed = None  # ``checked``'s reason where the kernel check said on
    missing = proven(kernel_passed, cuda=True, proof=end_to_end.kept(SHAPES))
    assert missing is not None and END_TO_END_COMMAND in missing
    end_to_end.keep(compare(SHAPES, fake_engine(wrong=(0, 0))))
    disagreeing = proven(kernel_passed, cuda=True, proof=end_to_end.kept(SHAPES))
    assert disagreeing.startswith("off (auto: end-to-end check failed: prompt 0, token 0")
    end_to_end.keep(compare(SHAPES, fake_engine()))
    assert proven(kernel_passed, cuda=True, proof=end_to_end.kept(SHAPES)) is None
    assert proven("off (self-check: slower)", cuda=True,
                  proof=end_to_end.kept(SHAPES)) == "off (self-check: slower)"
    assert proven(None, cuda=False, proof=None) is None  # no GPU (Triton's interpreter)


def test_a_malformed_file_is_refused():
    with pytest.raises(ValueError):
        EndToEnd.from_json({"format": "other"})
