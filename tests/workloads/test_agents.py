"""workloads.agents: each turn's prompt is its predecessor's prompt, output and tool
output; programs are seeded; shapes are checked."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from feather_sched.workloads.agents import STOP, TOOL_CALLS, AgentShape, LogNormal, agent_programs
from feather_sched.workloads.spec import ArrivalSpec


def test_turns_extend_their_predecessor_and_end_in_tool_calls_then_stop():
    agents = agent_programs(programs=6, arrival=ArrivalSpec("poisson", 1.0), seed=3)
    for program in agents.programs:
        turns = program.turns
        assert [t.finish_reason for t in turns] == [TOOL_CALLS] * (len(turns) - 1) + [STOP]
        assert turns[0].tool_s == 0.0 and all(t.tool_s > 0 for t in turns[1:])
        for before, after in pairwise(turns):
            grown = np.concatenate([before.spec.prompt, before.output_tokens])
            assert np.array_equal(after.spec.prompt[:grown.size], grown)
            assert after.spec.prompt.size > grown.size  # the tool's output follows
            assert after.spec.shared_len == grown.size
            assert after.spec.arrival_s == pytest.approx(before.spec.arrival_s + after.tool_s)
            assert before.spec.output_len == before.output_tokens.size
        assert {t.spec.group for t in turns} == {program.program}


def test_programs_of_one_agent_type_share_its_system_block():
    agents = agent_programs(programs=8, shape=AgentShape(agent_types=2), seed=1)
    firsts = [p.turns[0].spec for p in agents.programs]
    for a, b in zip(firsts, firsts[2:], strict=False):  # same type: programs p and p + 2
        assert np.array_equal(a.prompt[:a.shared_len], b.prompt[:b.shared_len])
    assert not np.array_equal(firsts[0].prompt[:1024], firsts[1].prompt[:1024])


def test_seeded_and_described():
    one, two = (agent_programs(programs=4, seed=9) for _ in range(2))
    assert one.open_loop().requests == two.open_loop().requests
    assert "4 programs" in one.describe()
    assert min(len(p.turns) for p in one.programs) >= 2


def test_invalid_shapes_are_refused():
    with pytest.raises(ValueError):
        LogNormal(0.0, 1.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        AgentShape(agent_types=0)
    with pytest.raises(ValueError):
        agent_programs(programs=0)
