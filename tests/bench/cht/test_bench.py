"""cht-bench on a tiny queue: every structure reports, and the CLI writes its JSON."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from feather_sched.bench.cht.bench import Queue, Scenario, engine_block_hashes, run_bench
from feather_sched.cli import app


def invoke(*args: str):
    """Run the CLI with a wide terminal so error boxes do not wrap words."""
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})


def test_queue_has_the_scenario_shape() -> None:
    queue = Queue.generate(Scenario(waiting=40, prompt_len=256, groups=8))
    assert len(queue.waiting) == 40
    assert sorted(spec.group for spec in queue.running) == [0, 1, 2, 3]
    assert all(len(spec.prompt) == 256 for spec in queue.waiting)
    lists = queue.token_lists(queue.waiting)
    assert [list(map(int, s.prompt)) for s in queue.waiting] == lists


def test_block_hashes_chain_like_the_engine() -> None:
    queue = Queue.generate(Scenario(waiting=8, prompt_len=100, groups=1))
    a, b = (engine_block_hashes(spec.prompt) for spec in queue.waiting[:2])
    assert len(a) == 100 // 16
    assert a[:4] == b[:4] and a[4:] != b[4:]


def test_every_structure_reports_positive_costs() -> None:
    results = list(run_bench([Scenario(32, 256, 4)], ["cht-tokens", "cht-blocks", "radix-lpm"],
                             chunk_tokens=32, blocks_per_chunk=2, repeats=1))
    assert [r.structure for r in results] == ["cht-tokens", "cht-blocks", "radix-lpm"]
    for result in results:
        assert result.insert_us_per_request > 0 and result.decision_ms > 0
        assert result.bytes_per_request > 0


def test_cli_writes_the_json_the_issue_names(tmp_path) -> None:
    out = tmp_path / "bench.json"
    result = invoke("cht-bench", "--waiting", "16", "--prompt-len", "128", "--groups", "2",
                    "--structures", "cht-tokens,radix-lpm", "--repeats", "1", "--json", str(out))
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert {r["structure"] for r in rows} == {"cht-tokens", "radix-lpm"}
    for key in ("structure", "waiting", "prompt_len", "groups", "insert_us_per_request",
                "decision_ms"):
        assert key in rows[0]


def test_cli_rejects_bad_sizes_and_structures() -> None:
    bad_size = invoke("cht-bench", "--waiting", "0")
    assert bad_size.exit_code != 0 and "positive integers" in bad_size.output
    bad_name = invoke("cht-bench", "--waiting", "4", "--prompt-len", "64", "--groups", "1",
                      "--structures", "btree")
    assert bad_name.exit_code != 0 and "unknown structures" in bad_name.output
