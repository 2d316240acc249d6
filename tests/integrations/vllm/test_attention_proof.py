"""The end-to-end proof's runner on vLLM's real CPU engine (the CPU path, on and off):
two engines in fresh processes, greedy over grouped and ungrouped prompts, compared
token for token; nothing kept, as no GPU builder decided (its key is a GPU's)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from typer.testing import CliRunner

from feather_sched.cli import app
from feather_sched.integrations.vllm import attention_proof
from feather_sched.models import TINY_LLAMA

ENGINE = {"load_format": "dummy", "skip_tokenizer_init": True, "enforce_eager": True,
          "max_model_len": 2048, "block_size": 128, "kv_cache_memory_bytes": 1 << 28,
          "scheduler_cls": "feather_sched.integrations.vllm.FeatherScheduler"}


def test_the_prompts_hold_groups_and_singles():
    batch = attention_proof.prompts()
    per = attention_proof.PER_GROUP
    assert len(batch) == attention_proof.GROUPS * per + attention_proof.SINGLES
    prefix = attention_proof.PREFIX_TOKENS
    assert batch[0][:prefix] == batch[per - 1][:prefix] != batch[per][:prefix]
    assert len({tuple(p[:prefix]) for p in batch[-attention_proof.SINGLES:]}) == \
        attention_proof.SINGLES


@pytest.mark.real_engine
def test_the_cpu_engine_gives_the_same_tokens_with_the_path_on_and_off(tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("FEATHER_CACHE_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["attention-check", "--end-to-end", "--model",
                                      str(TINY_LLAMA), "--engine-args", json.dumps(ENGINE)],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    tokens = (attention_proof.GROUPS * attention_proof.PER_GROUP + attention_proof.SINGLES) \
        * attention_proof.NEW_TOKENS
    said = " ".join(result.output.split())  # the console wraps its line
    assert f"end-to-end check passed: every token the engine's own ({tokens} tokens" in said
    assert "not kept: 0 GPU attention shapes" in said
