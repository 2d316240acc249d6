"""FeatherQueue: the tree's order, STOP for the rest of a pass, held requests, no starvation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_sched.core.cht import CHTError
from feather_sched.core.prefix import group_of
from feather_sched.core.queue import FeatherQueue, QueueState
from feather_sched.core.tenants import TenantShare
from feather_sched.gates.base import BatchLayout, Decision, GateContext, Unobservant
from feather_sched.gates.heuristic import AlwaysAddGate, ChunkLossGate
from tests.core.test_tenants import served_alike


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedGate(Unobservant):
    """Says STOP when the candidate loses more than one chunk; records every question."""

    always_adds = False  # shown every candidate
    stops_in_ordered_batches = True  # it may STOP whatever the layout

    def __init__(self) -> None:
        self.asked: list[GateContext] = []
        self.steps = 0

    def decide(self, context: GateContext) -> Decision:
        self.asked.append(context)
        return Decision.STOP if context.chunk_loss > 1 else Decision.ADD

    def reward(self, decisions, batch_size: int, seconds: float) -> None:
        raise AssertionError("the queue never rewards; the runtime does")

    def end_step(self) -> None:
        self.steps += 1


def group_keys(group: int, request: int) -> list[tuple]:
    """Two chunks of group prefix, then one chunk unique to the request."""
    return [(group,), (group, 0), (group, 0, request)]


def admit_next(queue: FeatherQueue) -> str | None:
    """Admit the queue's candidate if it says ADD; its id, else None."""
    admission = queue.decide()
    if admission is None or admission.decision is Decision.STOP:
        return None
    queue.admit(admission.request_id)
    return admission.request_id


def test_a_gate_that_always_adds_is_not_asked() -> None:
    """Its answer needs no context, so none is built (the tree's candidate analysis is
    skipped) and the admission says so; the tree's order still picks the candidate."""
    gate = ScriptedGate()
    gate.always_adds = True
    gate.decide = None  # called, it would raise
    queue = FeatherQueue(gate, max_wait_s=None)
    for rid, group in [("a0", 0), ("b0", 1), ("a1", 0)]:
        queue.add(rid, group_keys(group, int(rid[1])))
    assert admit_next(queue) == "a0"
    admission = queue.decide()
    assert (admission.request_id, admission.decision, admission.context) == \
        ("a1", Decision.ADD, None)
    assert not admission.forced


def test_stop_closes_the_queue_until_the_next_pass() -> None:
    gate = ScriptedGate()
    queue = FeatherQueue(gate, max_wait_s=None)
    for rid, group in [("a0", 0), ("b0", 1), ("a1", 0)]:
        queue.add(rid, group_keys(group, int(rid[1])))
    assert admit_next(queue) == "a0"
    assert admit_next(queue) == "a1"
    stop = queue.decide()
    assert stop.decision is Decision.STOP and stop.request_id == "b0"
    assert stop.context == GateContext(batch_size=2, chunk_loss=2, sharing_waiters=0,
                                       num_waiting=1, candidate_group=(1,),
                                       candidate_tokens=3 * queue.chunk_tokens,
                                       candidate_prefix_tokens=0, stops_left=4)
    assert queue.decide().decision is Decision.STOP and len(gate.asked) == 3
    queue.remove("a0")
    assert queue.decide().decision is Decision.STOP  # a STOP holds for the whole pass
    queue.remove("a1")
    queue.new_step()
    assert gate.steps == 1 and admit_next(queue) == "b0"


def test_a_promised_admission_holds_while_victims_return_until_it_runs() -> None:
    """The engine preempted for b0 and promised it: b0 stays the candidate, its answer
    ADD whatever the gate said (here STOP), the gate not asked again, as the victim comes
    back waiting; admitted, the promise ends and the pass's STOP applies again."""
    gate = ScriptedGate()
    queue = FeatherQueue(gate, max_wait_s=None)
    for rid, group in [("a0", 0), ("a1", 0), ("b0", 1)]:
        queue.add(rid, group_keys(group, int(rid[1])))
    assert admit_next(queue) == "a0" and admit_next(queue) == "a1"
    assert queue.decide().decision is Decision.STOP
    with pytest.raises(CHTError, match="not waiting"):
        queue.promise("a1")
    queue.promise("b0")
    asked = len(gate.asked)
    queue.requeue("a1")
    admission = queue.decide()
    assert (admission.request_id, admission.decision) == ("b0", Decision.ADD)
    assert queue.candidate() == "b0" and len(gate.asked) == asked
    queue.admit("b0")
    assert queue.decide().decision is Decision.STOP
    queue.new_step()
    queue.requeue("b0")
    assert queue.decide().request_id == "a1"  # no promise survives the pass


def test_the_gate_is_told_the_candidates_group_and_the_seats_left() -> None:
    gate = ScriptedGate()
    queue = FeatherQueue(gate, max_wait_s=None)
    for rid, group in [("a0", 0), ("b0", 1), ("b1", 1), ("b2", 1), ("c0", 2)]:
        queue.add(rid, group_keys(group, int(rid[1])))
    assert admit_next(queue) is not None  # into the empty batch: the gate is not asked
    context = queue.decide().context
    assert context.sharing_waiters == 3  # every other waiter: the batch shares nothing
    assert context.group_waiters == (2 if context.candidate_group == (1,) else 0)
    assert context.free_seats is None  # no cap known
    queue.new_step()
    queue.seats = 4
    assert queue.decide().context.free_seats == 3


def test_the_gate_is_asked_once_per_candidate() -> None:
    gate = ScriptedGate()
    queue = FeatherQueue(gate, max_wait_s=None)
    queue.add("x", [1])
    first = queue.decide()
    assert all(queue.decide() is first for _ in range(5))
    assert len(gate.asked) == 1


def test_an_offered_request_is_judged_itself() -> None:
    queue = FeatherQueue(ScriptedGate(), max_wait_s=None)
    queue.add("a0", group_keys(0, 0))
    queue.admit("a0")
    queue.add("b0", group_keys(1, 0))
    queue.add("a1", group_keys(0, 1))
    assert queue.decide().request_id == "a1"
    offered = queue.decide("b0")
    assert offered.request_id == "b0" and offered.decision is Decision.STOP
    with pytest.raises(CHTError, match="not waiting"):
        queue.decide("a0")


def test_held_requests_are_neither_candidates_nor_running() -> None:
    queue = FeatherQueue(max_wait_s=None)
    queue.add("a", group_keys(0, 0))
    queue.add("b", group_keys(1, 0))
    queue.admit("a")
    queue.hold("a")
    queue.hold("b")
    assert queue.state("a") is QueueState.HELD and queue.state("b") is QueueState.HELD
    assert queue.num_running == 0 and len(queue) == 0 and queue.decide() is None
    queue.requeue("b")
    assert queue.decide().request_id == "b"
    queue.run("a")
    assert queue.state("a") is QueueState.RUNNING and queue.keys("a") == group_keys(0, 0)
    assert queue.groups(["b", "a"]) == [group_of(group_keys(1, 0), "b"), queue.group("a")]
    assert queue.group("a") == group_of(group_keys(0, 0), "a")
    with pytest.raises(KeyError):
        queue.groups(["a", "never-added"])
    with pytest.raises(CHTError, match="already held"):
        queue.hold("b") or queue.hold("b")
    queue.remove("b")
    assert "b" not in queue


def test_unknown_and_duplicate_requests_fail_clearly() -> None:
    queue = FeatherQueue(max_wait_s=None)
    queue.add("r", [1])
    with pytest.raises(CHTError, match="already in the queue"):
        queue.add("r", [2])
    with pytest.raises(CHTError, match="unknown request 'x'"):
        queue.state("x")
    with pytest.raises(CHTError, match="waiting"):
        queue.requeue("r")
    with pytest.raises(ValueError, match="max_wait_s"):
        FeatherQueue(max_wait_s=-1)
    with pytest.raises(ValueError, match="min_passing_tokens"):
        FeatherQueue(min_passing_tokens=-1)


@pytest.mark.parametrize(("min_passing_tokens", "chunk_tokens", "rank_chunks"),
                         [(256, 128, 2), (0, 128, 1), (200, 128, 2), (256, 16, 16),
                          (100, 512, 1)])
def test_min_passing_tokens_are_whole_chunks_of_the_tree(
        min_passing_tokens: int, chunk_tokens: int, rank_chunks: int) -> None:
    queue = FeatherQueue(min_passing_tokens=min_passing_tokens, chunk_tokens=chunk_tokens)
    assert queue.tree.min_rank_chunks == rank_chunks
    queue.clear()
    assert queue.tree.min_rank_chunks == rank_chunks


def test_a_short_shared_prefix_keeps_arrival_order() -> None:
    """Sharing one 128-token chunk with the running set does not pass an older request
    (default ``min_passing_tokens`` 256); sharing two does."""
    queue = FeatherQueue(max_wait_s=None, max_overtakes=None, max_stops=None)
    queue.add("running", [(1,), (1, 2), (1, 2, 3)])
    assert admit_next(queue) == "running"
    queue.add("older", [(9,), (9, 9)])
    queue.add("one chunk", [(1,), (1, 5)])
    assert queue.candidate() == "older"
    queue.add("two chunks", [(1,), (1, 2), (1, 2, 7)])
    assert queue.candidate() == "two chunks"


def test_starved_request_is_admitted_over_the_gate() -> None:
    clock = FakeClock()
    queue = FeatherQueue(ChunkLossGate(max_loss=0, floor_start=0), max_wait_s=5.0, clock=clock)
    queue.add("g0", group_keys(0, 0))
    assert admit_next(queue) == "g0"
    clock.now = 1.0
    queue.add("old-stranger", group_keys(9, 0))
    for i in (1, 2):
        queue.add(f"g{i}", group_keys(0, 0))
    assert admit_next(queue) == "g1"
    assert admit_next(queue) == "g2"
    assert queue.decide().decision is Decision.STOP
    queue.new_step()
    clock.now = 5.5
    assert queue.decide().decision is Decision.STOP
    queue.new_step()
    clock.now = 6.5
    admission = queue.decide()
    assert admission.forced and admission.request_id == "old-stranger"
    assert admission.context is None  # the gate was not asked


def test_requeued_request_keeps_its_arrival_for_the_guard() -> None:
    clock = FakeClock()
    queue = FeatherQueue(ScriptedGate(), max_wait_s=10.0, clock=clock)
    queue.add("early", [("e",)])
    queue.admit("early")
    clock.now = 5.0
    queue.add("late", [("l",)])
    queue.requeue("early")
    clock.now = 10.5
    admission = queue.decide()
    assert admission.forced and admission.request_id == "early"


def test_the_guard_breaks_ties_in_arrival_as_the_age_order_does() -> None:
    """Requests arriving at the same instant (a trace's whole-second stamps) are starved in
    the order they first entered, as ``age_key`` (the victim order) ranks them, however
    often one returns: a preempted first entrant is forced again before a later one.  (A
    guard that ranked a returning request after its peers ping-ponged them under KV
    pressure: admitted, preempted as the youngest, re-admitted, 70 times one request.)"""
    clock = FakeClock()
    queue = FeatherQueue(max_wait_s=1.0, clock=clock)
    for name in ("first", "second"):
        queue.add(name, [(name,)], arrival_s=0.0)
    queue.admit("first")
    clock.now = 5.0
    assert queue.decide().request_id == "second"  # the guard passes the running one
    queue.requeue("first")
    queue.new_step()
    admission = queue.decide()
    assert admission.forced and admission.request_id == "first"
    assert queue.age_key("first") < queue.age_key("second")


def test_the_guard_forces_one_starved_request_a_pass() -> None:
    """In overload every request is old; the rest of the pass still follows the tree."""
    clock = FakeClock()
    queue = FeatherQueue(max_wait_s=1.0, clock=clock)
    queue.add("running", group_keys(0, 0))
    queue.admit("running")
    for i in range(3):
        queue.add(f"stranger{i}", group_keys(9 + i, 0))
    queue.add("sibling", group_keys(0, 1))
    clock.now = 5.0
    assert queue.decide().forced and admit_next(queue) == "stranger0"
    assert not queue.decide().forced and admit_next(queue) == "sibling"
    queue.new_step()
    assert queue.decide().forced and admit_next(queue) == "stranger1"


def test_priority_classes_are_strict_and_the_tree_orders_within_one() -> None:
    """A class-0 stranger goes before class-1 siblings of the running group; within
    class 1 the siblings (sharing the running prefix) go before an older stranger."""
    queue = FeatherQueue(max_wait_s=None)
    queue.add("running", group_keys(0, 0), priority=1)
    queue.admit("running")
    queue.add("old-stranger", group_keys(5, 0), priority=1)
    for i in (1, 2):
        queue.add(f"sibling{i}", group_keys(0, i), priority=1)
    queue.add("urgent", group_keys(9, 0), priority=0)
    assert [admit_next(queue) for _ in range(4)] == \
        ["urgent", "sibling1", "sibling2", "old-stranger"]


def test_the_guard_waits_for_more_urgent_requests() -> None:
    """Starved or not, a request never goes before a more urgent one that waits; the
    guard then picks the oldest of the most urgent class."""
    clock = FakeClock()
    queue = FeatherQueue(max_wait_s=1.0, max_overtakes=None, max_stops=None, clock=clock)
    queue.add("old-low", group_keys(1, 0), priority=1)
    clock.now = 0.5
    queue.add("urgent-a", group_keys(2, 0), priority=0)
    queue.add("urgent-b", group_keys(3, 0), priority=0)
    queue.add("running", group_keys(3, 1), priority=0)
    queue.admit("running")
    clock.now = 5.0
    admission = queue.decide()
    assert admission.forced and admission.request_id == "urgent-a"
    queue.admit("urgent-a")
    assert not queue.decide().forced and admit_next(queue) == "urgent-b"
    queue.new_step()
    admission = queue.decide()
    assert admission.forced and admission.request_id == "old-low"


def sized_queue(seats: int, kv_tokens: int, **options) -> FeatherQueue:
    """A queue that knows the engine's seats and KV cache (chunks of 16 tokens; any
    shared chunk ranks, since its groups share two)."""
    queue = FeatherQueue(ScriptedGate(), max_wait_s=None, chunk_tokens=16,
                         min_passing_tokens=0, **options)
    queue.seats, queue.kv_tokens = seats, kv_tokens
    return queue


def a_stranger_then_siblings(queue: FeatherQueue) -> None:
    """Group 0 runs; a stranger waits, then two siblings of the running group arrive."""
    queue.add("running", group_keys(0, 0), arrival_s=0.0)
    queue.admit("running")
    queue.add("stranger", group_keys(5, 0), arrival_s=1.0)
    for i in (1, 2):
        queue.add(f"sibling{i}", group_keys(0, i), arrival_s=1.0 + i)


def test_while_everything_fits_arrival_order_holds_and_the_gate_answers() -> None:
    """Running and waiting within the seats, their chunks within the KV cache: the older
    stranger goes before the siblings of the running group, judged by the gate."""
    queue = sized_queue(seats=4, kv_tokens=16 * 10)
    queue.gate.stops_in_ordered_batches = False  # as the model gate declares
    a_stranger_then_siblings(queue)
    assert queue.fits_all()
    the_stranger_is_stopped(queue, chunk_loss=3)


def the_stranger_is_stopped(queue: FeatherQueue, chunk_loss: int) -> None:
    """The stranger is the candidate, unforced, the gate's STOP (it loses ``chunk_loss``
    chunks) stands, and it is the candidate again next pass."""
    admission = queue.decide()
    assert admission.request_id == "stranger" and not admission.forced
    assert admission.context is not None and admission.context.chunk_loss == chunk_loss
    assert admission.decision is Decision.STOP  # the gate's answer stands: not forced
    queue.new_step()
    assert queue.candidate() == "stranger"


def test_while_everything_fits_the_fewest_uncached_tokens_go_first_and_the_gate_answers(
        ) -> None:
    """Running and waiting within the seats, their chunks within the KV cache: the
    siblings of the running group (one chunk left to compute each) go before the older
    stranger (three), in arrival order; the gate still answers for each, and its STOP
    for the stranger stands (not forced).  With ``shortest_when_all_fits``."""
    queue = sized_queue(seats=4, kv_tokens=16 * 10, shortest_when_all_fits=True)
    queue.gate.stops_in_ordered_batches = False  # as the model gate declares
    a_stranger_then_siblings(queue)
    assert queue.fits_all()
    assert [admit_next(queue) for _ in range(2)] == ["sibling1", "sibling2"]
    assert queue.fits_all()
    the_stranger_is_stopped(queue, chunk_loss=2)


def test_while_everything_fits_a_shorter_prompt_passes_a_longer_older_one() -> None:
    """Sharing nothing, the prompt with fewer tokens to compute goes first (its class
    first: a more urgent long prompt still leads).  With ``shortest_when_all_fits``."""
    queue = sized_queue(seats=8, kv_tokens=16 * 100, shortest_when_all_fits=True)
    queue.gate = AlwaysAddGate()
    queue.add("long", group_keys(7, 0), arrival_s=0.0, tokens=40)
    queue.add("short", group_keys(8, 0), arrival_s=1.0, tokens=36)
    queue.add("urgent-long", group_keys(9, 0), arrival_s=2.0, tokens=48, priority=-1)
    assert queue.fits_all()
    assert [admit_next(queue) for _ in range(3)] == ["urgent-long", "short", "long"]


@pytest.mark.parametrize(("seats", "kv_tokens"), [(3, 16 * 10), (4, 16 * 9),
                                                  (None, 16 * 10), (4, None)])
def test_the_tree_orders_once_something_would_not_fit(seats, kv_tokens) -> None:
    """One seat or one KV chunk too few (or either unknown): siblings pass the stranger.
    Four requests in flight; their chunks count as 10: 3 running, 7 distinct waiting
    (the group's two shared chunks counted in both states)."""
    queue = sized_queue(seats=seats, kv_tokens=kv_tokens)
    queue.gate = AlwaysAddGate()
    a_stranger_then_siblings(queue)
    assert not queue.fits_all()
    assert [admit_next(queue) for _ in range(3)] == ["sibling1", "sibling2", "stranger"]


def test_requests_that_arrived_together_keep_the_trees_order() -> None:
    """Arrival order has nothing to say among requests that arrived at once (offline)."""
    queue = sized_queue(seats=8, kv_tokens=16 * 100)
    queue.gate = AlwaysAddGate()
    queue.add("running", group_keys(0, 0), arrival_s=0.0)
    queue.admit("running")
    for rid, group in [("stranger", 5), ("sibling", 0)]:
        queue.add(rid, group_keys(group, 1), arrival_s=1.0)
    assert queue.fits_all()
    assert admit_next(queue) == "sibling"


def test_a_gate_that_stops_in_ordered_batches_keeps_the_trees_candidate() -> None:
    """Chunk-loss (and the bandit) STOP on chunk loss whatever the layout: offered the
    older stranger it would hold back the siblings it admits, one request a pass."""
    queue = sized_queue(seats=8, kv_tokens=16 * 100)
    queue.gate = ChunkLossGate(max_loss=1, floor_start=0, floor_step=0)
    a_stranger_then_siblings(queue)
    assert queue.fits_all()
    assert [admit_next(queue) for _ in range(3)] == ["sibling1", "sibling2", None]


def test_where_the_engine_keeps_its_batch_order_the_tree_orders() -> None:
    """Admission order is then the batch's layout: the siblings go side by side."""
    queue = sized_queue(seats=8, kv_tokens=16 * 100)
    queue.gate = AlwaysAddGate()
    queue.use_layout(BatchLayout.ENGINE)
    a_stranger_then_siblings(queue)
    assert queue.fits_all()
    assert [admit_next(queue) for _ in range(3)] == ["sibling1", "sibling2", "stranger"]


def test_without_the_bound_the_tree_orders_even_when_everything_fits() -> None:
    """``-unbounded`` is the paper's pure prefix order."""
    queue = sized_queue(seats=8, kv_tokens=16 * 100, max_overtakes=None, max_stops=None)
    queue.gate = AlwaysAddGate()
    a_stranger_then_siblings(queue)
    assert [admit_next(queue) for _ in range(3)] == ["sibling1", "sibling2", "stranger"]


def test_a_forced_admission_the_engine_skips_frees_the_slot() -> None:
    clock = FakeClock()
    queue = FeatherQueue(max_wait_s=1.0, clock=clock)
    for i in range(2):
        queue.add(f"old{i}", group_keys(i, 0))
    clock.now = 5.0
    assert admit_next(queue) == "old0"
    queue.hold("old0")  # the engine popped it and skipped it
    second = queue.decide()
    assert second.forced and second.request_id == "old1"


def test_a_promised_starved_request_stays_forced_one_a_pass() -> None:
    """The engine preempted for the starved request and promised it: its admission is
    still the pass's forced one, so no second request is forced past the gate after it."""
    clock = FakeClock()
    queue = FeatherQueue(ScriptedGate(), max_wait_s=1.0, clock=clock)
    for rid, group in [("a0", 0), ("b0", 1), ("c0", 2)]:
        queue.add(rid, group_keys(group, 0))
    clock.now = 5.0
    queue.promise(queue.candidate())
    first = queue.decide()
    assert first.forced and first.request_id == "a0"
    queue.admit("a0")
    assert not queue.decide().forced  # one a pass: the gate answers for the next


operations = st.lists(st.tuples(st.sampled_from(["add", "step", "finish", "requeue", "abort",
                                                 "hold", "release"]),
                                st.integers(0, 3)), max_size=80)


@settings(max_examples=100, deadline=None)
@given(operations)
def test_every_request_ends_exactly_once(ops: list[tuple[str, int]]) -> None:
    """Whatever the gate decides, each request is finished or aborted once, never lost;
    the running epoch moves forward exactly when the running set changes."""
    clock = FakeClock()
    queue = FeatherQueue(ChunkLossGate(max_loss=0, floor_start=1), max_wait_s=3.0, clock=clock)
    running: list[str] = []
    held: list[str] = []
    ended: list[str] = []
    added: list[str] = []
    last = (queue.running_epoch, set())
    for n, (op, arg) in enumerate(ops):
        epoch, running_set = queue.running_epoch, set(queue.running_ids())
        assert epoch >= last[0] and (epoch != last[0]) == (running_set != last[1])
        last = (epoch, running_set)
        clock.now = float(n)
        if op == "add":
            rid = f"r{n}"
            added.append(rid)
            queue.add(rid, group_keys(arg, n))
        elif op == "step":
            while (rid := admit_next(queue)) is not None:
                running.append(rid)
            queue.new_step()
        elif running and op in ("finish", "requeue", "hold"):
            rid = running.pop(arg % len(running))
            if op == "finish":
                queue.remove(rid)
                ended.append(rid)
            elif op == "requeue":
                queue.requeue(rid)
            else:
                queue.hold(rid)
                held.append(rid)
        elif held and op == "release":
            queue.requeue(held.pop(arg % len(held)))
        elif op == "abort" and (len(queue) or running):
            rid = next(iter(queue.waiting_ids()), None) or running.pop()
            queue.remove(rid)
            ended.append(rid)
    for rid in held:
        queue.requeue(rid)
    while len(queue) or running:
        while (rid := admit_next(queue)) is not None:
            running.append(rid)
        queue.new_step()
        for rid in running:
            queue.remove(rid)
            ended.append(rid)
        running.clear()
    assert sorted(ended) == sorted(added)
    assert len(set(ended)) == len(ended)


def fair_queue(quantum: float = 100, **options) -> FeatherQueue:
    return FeatherQueue(AlwaysAddGate(), share=TenantShare(quantum=quantum, hit_weight=0),
                        **options)


def test_the_share_admits_in_prefix_order_until_a_tenant_is_a_quantum_ahead() -> None:
    queue = fair_queue(quantum=100, max_overtakes=None)
    queue.add("running", group_keys(0, 0), tenant="flood")
    queue.admit("running")
    for i in range(1, 4):
        queue.add(f"flood{i}", group_keys(0, i), tenant="flood")
    queue.add("other", group_keys(1, 0), tenant="other")
    served_alike(queue.share, ["flood", "other"], tokens=100)  # each its whole quantum
    assert queue.candidate() == "flood1"  # shares the running prefix, within the quantum
    queue.share.charge("flood", 99, 0)
    assert queue.candidate() == "flood1"  # still within the quantum (99.75 now)
    queue.share.charge("flood", 2, 0)
    assert queue.candidate() == "other"  # over it: the least served goes first
    assert admit_next(queue) == "other"
    assert queue.candidate() == "flood1"  # "other" no longer waits: nobody to yield to


def test_the_best_of_the_tenants_admitted_is_in_the_trees_order() -> None:
    queue = fair_queue(quantum=0, max_overtakes=None)
    queue.add("running", group_keys(0, 0), tenant="a")
    queue.admit("running")
    queue.add("b-plain", group_keys(5, 0), tenant="b")
    queue.add("b-shares", group_keys(0, 1), tenant="b")
    queue.add("a-shares", group_keys(0, 2), tenant="a")
    queue.share.charge("a", 10, 0)
    assert queue.candidate() == "b-shares"  # b's best by prefix, not its oldest


def test_classes_come_before_the_share() -> None:
    queue = fair_queue(quantum=0)
    queue.add("rich-urgent", group_keys(0, 0), priority=0, tenant="rich")
    queue.add("poor-later", group_keys(1, 0), priority=1, tenant="poor")
    queue.share.charge("rich", 10**6, 0)
    assert queue.candidate() == "rich-urgent"


def test_within_the_share_overtakes_count_only_within_a_tenant() -> None:
    """Another tenant's later arrivals pass by the share, not against the bound; a tenant's
    own later arrivals still count."""
    queue = fair_queue(quantum=0, max_overtakes=1, max_wait_s=None)
    queue.add("running", group_keys(0, 0), tenant="a")
    queue.admit("running")
    queue.add("a-old", group_keys(3, 0), tenant="a")
    queue.add("b-new", group_keys(0, 1), tenant="b")
    queue.add("a-new", group_keys(0, 2), tenant="a")
    queue.share.charge("a", 10, 0)
    assert admit_next(queue) == "b-new"
    assert queue.due() is None  # passed by b only
    queue.share.charge("b", 100, 0)
    assert admit_next(queue) == "a-new"  # a's prefix order passes its own old request
    assert queue.due() == "a-old"
    assert [queue.state(r) for r in ("a-old",)] == [QueueState.WAITING]


def test_the_share_forgets_what_leaves_waiting() -> None:
    queue = fair_queue(quantum=0)
    queue.add("a", group_keys(0, 0), tenant="a")
    queue.add("b", group_keys(1, 0), tenant="b")
    queue.share.charge("b", 5, 0)
    queue.hold("a")
    assert queue.candidate() == "b"  # a, held, is not backlogged
    queue.requeue("a")
    assert queue.share.service("a") == 5  # lifted: its time away banked nothing
    assert queue.share.eligible_tenants() == ["a", "b"]  # in the order first seen
    queue.remove("a")
    assert queue.share.eligible_tenants() == ["b"]
    queue.clear()
    assert queue.share.eligible_tenants() == [] and queue.share.service("b") == 5


def flood_holds_two_of_four_seats(queue: FeatherQueue) -> None:
    """Four seats; tenant "flood" runs two requests of group 0 (its seat share, once a
    second tenant waits)."""
    queue.seats = 4
    for i in range(2):
        queue.add(f"flood-run{i}", group_keys(0, i), tenant="flood")
        queue.admit(f"flood-run{i}")


@pytest.mark.parametrize("bound", [{"max_overtakes": 0}, {"max_stops": 0},
                                   {"max_overtakes": 1}])
def test_a_request_a_bound_made_due_takes_its_tenants_turn(bound: dict) -> None:
    """The tenant "flood" holds its seat share (two of four seats, two tenants waiting) and
    its oldest request is due at its bound (at 0, every request is): the request of the
    tenant below its share goes first, then the due one when its tenant's turn comes;
    a bound at 0 is arrival order within the share's window, never across it."""
    queue = fair_queue(quantum=10**6, max_wait_s=None, **bound)
    flood_holds_two_of_four_seats(queue)
    queue.add("flood-old", group_keys(3, 0), tenant="flood")
    queue.add("flood-new", group_keys(0, 9), tenant="flood")
    queue.add("light", group_keys(5, 0), tenant="light")
    if bound.get("max_overtakes") == 1:  # flood-new passes flood-old once: due
        queue.remove("light")
        assert admit_next(queue) == "flood-new"
        queue.remove("flood-new")
        queue.add("light", group_keys(5, 0), tenant="light")
    queue.new_step()  # the pass starts: the seat shares as they stand
    assert queue.due() != "flood-old"  # due by its bound, but its tenant holds its share
    assert admit_next(queue) == "light"
    assert queue.due() == "flood-old" and admit_next(queue) == "flood-old"


class ShareRule:
    """The share's admission rule as docs/fairness.md#tenants states it, kept from what
    the workload did (not asked of the share; only counters are read): seat shares
    computed when a pass starts, a tenant that reaches its share in the pass no longer
    backlogged, one that a preemption takes below it backlogged again."""

    def __init__(self, weights: dict[str, float], quantum: float, seats: int) -> None:
        self.weights, self.quantum, self.seats = weights, quantum, seats
        self.waiting: dict[str, tuple[str, int]] = {}
        """Each waiting request's (tenant, class)."""
        self.running: dict[str, tuple[str, int]] = {}
        self.seated: set[str] = set()
        self.per_weight = 0.0

    def runs(self, tenant: str) -> int:
        return sum(t == tenant for t, _ in self.running.values())

    def waits(self) -> set[str]:
        return {t for t, _ in self.waiting.values()}

    def new_pass(self) -> None:
        waiting = self.waits()
        idle = sum(t not in waiting for t, _ in self.running.values())
        weight = sum(self.weights[t] for t in waiting)
        self.per_weight = (self.seats - idle) / weight if weight else 0.0
        self.seated = {t for t in waiting if self.at_share(t)}

    def at_share(self, tenant: str) -> bool:
        return self.runs(tenant) >= self.per_weight * self.weights[tenant]

    def move(self, rid: str, to_running: bool) -> None:
        """``rid`` is admitted (or preempted back to waiting)."""
        source, target = (self.waiting, self.running) if to_running else \
            (self.running, self.waiting)
        tenant, _ = target[rid] = source.pop(rid)
        if tenant not in self.waits():
            self.seated.discard(tenant)
        elif to_running and self.at_share(tenant):
            self.seated.add(tenant)
        elif not to_running and not self.at_share(tenant):
            self.seated.discard(tenant)

    def admits(self, share: TenantShare, tenant: str, priority: int) -> bool:
        """Backlogged in the class (below its seat share, or all are at theirs there) and
        within the quantum of the least backlogged counter."""
        there = {t for t, p in self.waiting.values() if p == priority}
        backlogged = there - self.seated or there
        least = min(map(share.service, backlogged))
        return tenant in backlogged and share.service(tenant) <= least + self.quantum


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_admission_keeps_the_seat_share_and_the_fair_order(data) -> None:
    """Random workloads (three weighted tenants, two classes, shared and unshared
    prefixes, service charged as steps run, exits, urgent preemptions, a gate that
    STOPs, every setting of the bounds, 0 included): every admission is of a tenant the
    share admits in the class then (``ShareRule``, an oracle kept apart from the share:
    backlogged, so below its seat share unless all are at theirs, and within the
    quantum of the least served), whether the tree, the fits-all rule, a bound or a
    promise after an urgent preemption or the starvation backstop (``max_wait_s``, in the
    tenant's turn) chose it; and each admission is of a request waiting then (once per
    wait: ``ShareRule.move`` takes it out of the waiting)."""
    bounds = {"max_overtakes": data.draw(st.sampled_from([0, 1, 3, 32, None])),
              "max_stops": data.draw(st.sampled_from([0, 1, 4, None]))}
    seats = data.draw(st.integers(1, 6))
    gate = data.draw(st.sampled_from([AlwaysAddGate(), ScriptedGate()]))
    weights = {"a": 1, "b": 2, "c": 1}
    quantum = data.draw(st.sampled_from([0, 40, 16384]))
    share = TenantShare(weights, quantum=quantum,
                        hit_weight=data.draw(st.sampled_from([0, 0.5, 1])))
    now = [0.0]
    queue = FeatherQueue(gate, max_wait_s=data.draw(st.sampled_from([None, 0.0, 5.0])),
                         share=share, clock=lambda: now[0], **bounds)
    queue.seats = seats
    queue.kv_tokens = data.draw(st.sampled_from([None, 10**6]))  # everything fits, or not
    rule = ShareRule(weights, quantum, seats)
    events = data.draw(st.lists(st.tuples(st.sampled_from(["arrive", "arrive", "pass",
                                                           "finish", "serve", "urgent"]),
                                          st.sampled_from("abc"), st.integers(0, 5),
                                          st.integers(0, 1)), min_size=20, max_size=120))
    for n, (kind, tenant, group, priority) in enumerate(events):
        now[0] = float(n)
        running = list(rule.running)
        if kind == "arrive":
            queue.add(f"r{n}", group_keys(group, n) if group < 3 else [(tenant, n)],
                      arrival_s=float(n), priority=priority, tenant=tenant)
            rule.waiting[f"r{n}"] = (tenant, priority)
        elif kind == "serve":
            for rid in running:
                share.charge(queue.tenant(rid), group * 10, 1)
        elif kind == "finish" and running:
            rid = running[group % len(running)]
            queue.remove(rid)
            del rule.running[rid]
        elif kind in ("pass", "urgent"):
            queue.new_step()
            rule.new_pass()
            if kind == "urgent":
                preempt_for_the_candidate(queue, rule, group)
            while len(rule.running) < seats and (answer := queue.decide()) is not None \
                    and answer.decision is Decision.ADD:
                rid = answer.request_id
                assert rule.admits(share, queue.tenant(rid), queue.priority(rid)), \
                    (rid, answer.forced)
                share.admitted(queue.tenant(rid), 30)
                queue.admit(rid)
                rule.move(rid, to_running=True)


def preempt_for_the_candidate(queue: FeatherQueue, rule: ShareRule, pick: int) -> None:
    """An engine's urgent preemption: the candidate, of class 0 and an ADD, lacks a seat,
    so one running class-1 request (the ``pick``-th) is preempted and the ADD promised."""
    victims = [r for r, (_, p) in rule.running.items() if p == 1]
    answer = queue.decide()
    if answer is None or answer.decision is not Decision.ADD or not victims or \
            queue.priority(answer.request_id) != 0 or len(rule.running) < rule.seats:
        return
    victim = victims[pick % len(victims)]
    queue.requeue(victim)
    rule.move(victim, to_running=False)
    queue.promise(answer.request_id)


def vtc_queue() -> FeatherQueue:
    return FeatherQueue(AlwaysAddGate(), max_overtakes=None, max_stops=None, max_wait_s=None,
                        share=TenantShare(quantum=0, hit_weight=1, shares_seats=False),
                        prefix_order=False)


def test_without_prefix_order_the_least_served_tenants_oldest_goes_first() -> None:
    """VTC's order: the shared prefix of b2 counts for nothing, the returning a1 goes back
    to its tenant's head, and the ranking lists what the queue would offer."""
    queue = vtc_queue()
    queue.add("running", group_keys(0, 0), tenant="b")
    queue.admit("running")
    queue.add("a1", group_keys(1, 0), tenant="a")
    queue.add("a2", group_keys(2, 0), tenant="a")
    queue.add("b2", group_keys(0, 1), tenant="b")
    queue.share.admitted("b", 10)
    assert queue.candidate() == "a1"
    queue.admit("a1")
    queue.share.admitted("a", 20)
    assert queue.candidate() == "b2"
    queue.requeue("a1")  # preempted
    queue.share.admitted("b", 20)
    assert queue.candidate() == "a1"
    assert sorted(queue.waiting_ids(), key=queue.rank_key) == ["a1", "a2", "b2"]
    with pytest.raises(ValueError, match="give a share"):
        FeatherQueue(prefix_order=False)


def test_among_requests_sharing_as_much_the_least_served_tenant_goes_first() -> None:
    """Inside the window the tree's order picks, but between requests that share equally
    (here nothing) the least served tenant's, not the oldest."""
    queue = fair_queue(quantum=1000, max_overtakes=None, max_wait_s=None)
    queue.add("a-old", group_keys(1, 0), arrival_s=0.0, tenant="a")
    queue.add("b-new", group_keys(2, 0), arrival_s=1.0, tenant="b")
    served_alike(queue.share, "ab", tokens=100)  # each its whole quantum
    queue.share.charge("a", 10, 0)  # within the quantum of b
    assert sorted(queue.share.eligible_tenants()) == ["a", "b"]
    assert queue.candidate() == "b-new"
    queue.add("running", group_keys(1, 1), arrival_s=2.0, tenant="a")
    queue.admit("running")  # a-old now shares a prefix with the running set
    assert queue.candidate() == "a-old"


def test_while_everything_fits_arrival_order_holds_within_the_share_s_pick() -> None:
    """Arrival order while the engine could run everything in flight is the chosen
    tenant's: another tenant's older request does not pass the least served."""
    queue = FeatherQueue(AlwaysAddGate(), share=TenantShare(quantum=1000), max_wait_s=None,
                         chunk_tokens=16, min_passing_tokens=0)
    queue.seats, queue.kv_tokens = 16, 16 * 100
    queue.add("a-oldest", group_keys(1, 0), arrival_s=0.0, tenant="a")
    queue.add("b-old", group_keys(2, 0), arrival_s=1.0, tenant="b")
    queue.add("b-new", group_keys(3, 0), arrival_s=2.0, tenant="b")
    queue.share.charge("a", 10, 0)
    assert queue.fits_all()
    assert queue.candidate() == "b-old"
    queue.share.charge("b", 20, 0)
    assert queue.candidate() == "a-oldest"


def test_while_everything_fits_the_least_served_tenant_goes_before_a_deeper_prefix() -> None:
    """Where the engine could run everything in flight prefix order buys nothing: a tenant
    whose waiting requests share the running prefix (the tree's best) is not admitted
    again, within the quantum, while another tenant is less served (it was, one tenant
    after another, each until a quantum ahead: a tenant of unshared short prompts last)."""
    queue = FeatherQueue(AlwaysAddGate(), share=TenantShare(quantum=1000), max_wait_s=None,
                         chunk_tokens=16, min_passing_tokens=0)
    queue.seats, queue.kv_tokens = 16, 16 * 100
    queue.add("a-running", group_keys(0, 0), arrival_s=0.0, tenant="a")
    queue.admit("a-running")
    queue.add("a-next", group_keys(0, 1), arrival_s=0.0, tenant="a")
    queue.add("b-plain", group_keys(1, 0), arrival_s=1.0, tenant="b")
    queue.share.charge("a", 10, 0)
    assert queue.fits_all() and queue.tree.best() == "a-next"
    assert queue.candidate() == "b-plain"
    queue.share.charge("b", 20, 0)
    assert queue.candidate() == "a-next"


def test_a_tenant_at_its_seat_share_yields_to_one_below_it() -> None:
    """The flood's cached prefix makes it the least served and its requests the tree's
    best, but it holds its share of the seats: the other tenant's request goes next."""
    queue = fair_queue(quantum=0, max_overtakes=None)
    flood_holds_two_of_four_seats(queue)
    queue.add("flood-next", group_keys(0, 9), tenant="flood")
    queue.add("other", group_keys(1, 0), tenant="other")
    queue.share.charge("other", 100, 0)
    queue.new_step()  # the pass starts: the seat shares as they stand
    assert queue.share.seat_share("flood", 4) == 2
    assert queue.candidate() == "other"
    queue.seats = 5  # a share of 2.5: the flood is below it again
    assert queue.candidate() == "flood-next"
    queue.seats = None  # seats unknown: no seat share
    assert queue.candidate() == "flood-next"
