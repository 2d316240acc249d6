"""A Mooncake-format trace replayed on the real vLLM engine (in-process, the embedded
model) reaches the prefix-cache hit rate its hash ids imply."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="the vllm extra is not installed")

from typer.testing import CliRunner

from feather_sched.cli import app
from tests.helpers.replay_trace import (
    ENGINE_BLOCK,
    REPLAY_FLAGS,
    REQUESTS,
    implied_hit_rate,
    replayed_length,
    write_trace,
)


def test_a_replayed_trace_hits_the_prefix_cache_as_its_hash_ids_say(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    result = CliRunner().invoke(app, [
        "bench", "--trace", str(write_trace(tmp_path / "trace.jsonl")), *REPLAY_FLAGS,
        "--schedulers", "fcfs,feather-model", "--engine-arg", "enforce_eager=true",
        "--engine-arg", f"block_size={ENGINE_BLOCK}", "--kv-cache-gib", "0.25",
        "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    expected = implied_hit_rate()
    assert 0.4 < expected < 0.6
    for name, summary in json.loads(out.read_text())["runs"].items():
        assert summary["completed"] == len(REQUESTS)
        assert summary["total_input_tokens"] == sum(replayed_length(*r) for r in REQUESTS)
        assert summary["prefix_cache_hit_rate"] == pytest.approx(expected, abs=0.02), name
