"""FeatherQueue: admission by the tree's order, STOP for the rest of a step, no starvation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_sched.gate import ChunkLossGate, Decision, GateContext
from feather_sched.queue import FeatherQueue


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedGate:
    """Says STOP when the candidate loses more than one chunk; records every question."""

    def __init__(self) -> None:
        self.asked: list[GateContext] = []
        self.rewards: list[tuple[int, float]] = []
        self.steps = 0

    def decide(self, context: GateContext) -> Decision:
        self.asked.append(context)
        return Decision.STOP if context.chunk_loss > 1 else Decision.ADD

    def reward(self, batch_size: int, seconds: float) -> None:
        self.rewards.append((batch_size, seconds))

    def end_step(self) -> None:
        self.steps += 1


def group_keys(group: int, request: int) -> list[tuple]:
    """Two chunks of group prefix, then one chunk unique to the request."""
    return [(group,), (group, 0), (group, 0, request)]


def test_stop_closes_the_queue_until_the_next_step() -> None:
    gate = ScriptedGate()
    queue = FeatherQueue(gate, max_wait_s=None)
    for rid, group in [("a0", 0), ("b0", 1), ("a1", 0)]:
        queue.add(rid, group_keys(group, int(rid[1])))
    assert queue.may_admit() and queue.pop() == "a0"
    assert queue.may_admit() and queue.pop() == "a1"
    assert not queue.may_admit()
    assert len(queue) == 1 and queue.peek() == "b0"
    assert not queue.may_admit()
    assert len(gate.asked) == 3
    queue.record_step(batch_size=2, seconds=0.25)
    assert gate.rewards == [(2, 0.25)] and gate.steps == 0
    assert not queue.may_admit()
    queue.finish("a0")
    queue.finish("a1")
    queue.new_step()
    assert gate.steps == 1
    assert queue.may_admit() and queue.pop() == "b0"


def test_gate_is_asked_once_per_candidate() -> None:
    gate = ScriptedGate()
    queue = FeatherQueue(gate, max_wait_s=None)
    queue.add("x", [1])
    for _ in range(5):
        assert queue.may_admit()
        queue.peek()
    assert len(gate.asked) == 1
    assert queue.counts.add == 1


def test_starved_request_is_admitted_over_the_gate() -> None:
    clock = FakeClock()
    queue = FeatherQueue(ChunkLossGate(max_loss=0, floor_start=0), max_wait_s=5.0, clock=clock)
    queue.add("g0", group_keys(0, 0))
    assert queue.pop() == "g0"
    clock.now = 1.0
    queue.add("old-stranger", group_keys(9, 0))
    for i in (1, 2):
        queue.add(f"g{i}", group_keys(0, 0))
    assert queue.pop() == "g1"
    assert queue.pop() == "g2"
    assert not queue.may_admit() and queue.counts.stop == 1
    queue.new_step()
    clock.now = 5.5
    assert not queue.may_admit()
    queue.new_step()
    clock.now = 6.5
    assert queue.may_admit()
    admission = queue.admission()
    assert admission.forced and admission.candidate.request_id == "old-stranger"
    assert queue.pop() == "old-stranger" and queue.counts.forced == 1


def test_requeued_request_keeps_its_arrival_for_the_guard() -> None:
    clock = FakeClock()
    queue = FeatherQueue(ScriptedGate(), max_wait_s=10.0, clock=clock)
    queue.add("early", [("e",)])
    queue.pop()
    clock.now = 5.0
    queue.add("late", [("l",)])
    queue.requeue("early")
    clock.now = 10.5
    assert queue.admission().forced and queue.peek() == "early"


def test_payloads_follow_requests_and_vanish_with_them() -> None:
    queue = FeatherQueue(max_wait_s=None)
    queue.add("r", [1, 2], payload={"engine": "request"})
    assert queue.payload("r") == {"engine": "request"}
    queue.remove("r")
    assert "r" not in queue
    with pytest.raises(KeyError):
        queue.payload("r")
    with pytest.raises(IndexError):
        queue.peek()


def test_bad_options_fail_clearly() -> None:
    with pytest.raises(ValueError, match="max_wait_s"):
        FeatherQueue(max_wait_s=-1)


operations = st.lists(st.tuples(st.sampled_from(["add", "step", "finish", "requeue", "abort"]),
                                st.integers(0, 3)), max_size=80)


@settings(max_examples=100, deadline=None)
@given(operations)
def test_every_request_ends_exactly_once(ops: list[tuple[str, int]]) -> None:
    """Whatever the gate decides, each request is finished or aborted once, never lost."""
    clock = FakeClock()
    queue = FeatherQueue(ChunkLossGate(max_loss=0, floor_start=1), max_wait_s=3.0, clock=clock)
    running: list[str] = []
    ended: list[str] = []
    added: list[str] = []
    for n, (op, arg) in enumerate(ops):
        clock.now = float(n)
        if op == "add":
            rid = f"r{n}"
            added.append(rid)
            queue.add(rid, group_keys(arg, n))
        elif op == "step":
            while queue.may_admit():
                running.append(queue.pop())
            queue.record_step(batch_size=len(running), seconds=0.1)
            queue.new_step()
        elif running and op in ("finish", "requeue"):
            rid = running.pop(arg % len(running))
            if op == "finish":
                queue.finish(rid)
                ended.append(rid)
            else:
                queue.requeue(rid)
        elif op == "abort" and (len(queue) or running):
            rid = next(iter(queue), None) or running.pop()
            queue.remove(rid)
            ended.append(rid)
    while len(queue) or running:
        while queue.may_admit():
            running.append(queue.pop())
        queue.new_step()
        for rid in running:
            queue.finish(rid)
            ended.append(rid)
        running.clear()
    assert sorted(ended) == sorted(added)
    assert len(set(ended)) == len(ended)


def test_the_guard_forces_one_starved_request_a_step() -> None:
    """In overload every request is old; the rest of the step still follows the tree."""
    clock = FakeClock()
    queue = FeatherQueue(max_wait_s=1.0, clock=clock)
    queue.add("running", group_keys(0, 0))
    queue.pop()
    for i in range(3):
        queue.add(f"stranger{i}", group_keys(9 + i, 0))
    queue.add("sibling", group_keys(0, 1))
    clock.now = 5.0
    first = queue.admission()
    assert first.forced and queue.pop() == "stranger0"
    second = queue.admission()
    assert not second.forced and queue.pop() == "sibling"
    queue.new_step()
    assert queue.admission().forced and queue.pop() == "stranger1"
