"""BFCL's multi-turn tasks as agent programs (``feather_sched.workloads.bfcl_programs``),
from the ``bfcl-eval`` wheel ``scripts/setup.sh --datasets`` brings."""

from __future__ import annotations

import random
import zipfile
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from feather_sched.workloads import bfcl_programs as bfcl
from feather_sched.workloads.agents import STOP, TOOL_CALLS
from feather_sched.workloads.datasets import bfcl_source, load_tokenizer
from feather_sched.workloads.spec import ArrivalSpec


def test_each_task_becomes_a_program_of_its_calls_and_answers() -> None:
    """Turn by turn: each expected call one ``tool_calls`` turn whose output is the call
    as BFCL writes it, each user message closed by a ``stop`` turn; each turn's prompt its
    predecessor's prompt and output and more; programs of one tool-class set share their
    system block exactly, and other sets' blocks differ."""
    workload = bfcl.bfcl_programs(programs=40, arrival=ArrivalSpec("poisson", 2.0), seed=3)
    tasks, _ = bfcl._read(bfcl_source(None))
    random.Random(3).shuffle(tasks)
    decode = load_tokenizer().decode
    systems: dict[int, np.ndarray] = {}
    for program, (task, answer) in zip(workload.programs, tasks, strict=False):
        turns = program.turns
        assert [t.finish_reason for t in turns].count(STOP) == len(task["question"])
        calls = [call for turn_calls in answer for call in turn_calls]
        made = [t for t in turns if t.finish_reason == TOOL_CALLS]
        assert [decode(t.output_tokens.tolist()) for t in made] == calls
        for before, after in pairwise(turns):
            head = np.concatenate([before.spec.prompt, before.output_tokens])
            assert after.spec.shared_len == head.size
            assert np.array_equal(after.spec.prompt[:head.size], head)
            assert after.spec.prompt.size > head.size
        first = turns[0].spec
        system = systems.setdefault(program.agent_type, first.prompt[:first.shared_len])
        assert np.array_equal(first.prompt[:first.shared_len], system)
    blocks = [tuple(s.tolist()) for s in systems.values()]
    assert len(set(blocks)) == len(blocks) > 1


def test_a_wheel_without_the_multi_turn_sets_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "bfcl_eval-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("bfcl_eval/data/other.json", "{}")
    with pytest.raises(ValueError, match="holds no bfcl_eval/data/possible_answer/"):
        bfcl.bfcl_programs(programs=1, source=wheel)
    with pytest.raises(ValueError, match="read the bfcl-eval wheel, not"):
        bfcl.bfcl_programs(programs=1, source=tmp_path)
