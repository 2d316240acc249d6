"""The overtaking bound: counts against a brute-force model, and the bound it guarantees."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_sched.core.fairness import OvertakeBound
from feather_sched.core.queue import FeatherQueue
from feather_sched.gates.base import Decision
from feather_sched.gates.heuristic import ChunkLossGate


class Model:
    """Every admission checked against every waiting request, the slow obvious way."""

    def __init__(self) -> None:
        self.sequence: dict[str, int] = {}
        self.priority: dict[str, int] = {}
        self.tenant: dict[str, int] = {}
        self.log: list[str] = []
        self.entered: dict[str, int] = {}
        self.held: dict[str, int] = {}
        self.stops = 0
        self.stops_at: dict[str, int] = {}

    def arrive(self, rid: str, priority: int = 0, tenant: int = 0) -> None:
        self.sequence[rid] = len(self.sequence)
        self.priority[rid] = priority
        self.tenant[rid] = tenant
        self.entered[rid] = len(self.log)
        self.stops_at[rid] = self.stops

    def overtakes(self, rid: str) -> int:
        """Admissions since it entered of later arrivals of its tenant not more urgent
        than it."""
        return sum(self.sequence[a] > self.sequence[rid] and
                   self.priority[a] >= self.priority[rid] and
                   self.tenant[a] == self.tenant[rid]
                   for a in self.log[self.entered[rid]:])

    def top(self) -> int:
        return min((self.priority[r] for r in self.entered), default=0)

    def due(self, limit: int | None, stop_limit: int | None = None,
            tenants: set[int] | None = None) -> str | None:
        """The oldest request of the most urgent class waiting at either bound (of the
        ``tenants``, where given)."""
        at_bound = [r for r in self.entered
                    if self.priority[r] == self.top() and
                    (tenants is None or self.tenant[r] in tenants) and
                    ((limit is not None and self.overtakes(r) >= limit) or
                     (stop_limit is not None and self.stops - self.stops_at[r] >= stop_limit))]
        return min(at_bound, key=self.sequence.__getitem__, default=None)

    def stops_left(self, stop_limit: int | None) -> int | None:
        waiting = [r for r in self.entered if self.priority[r] == self.top()]
        if stop_limit is None or not waiting:
            return None
        return max(0, stop_limit - max(self.stops - self.stops_at[r] for r in waiting))


def test_a_minority_request_is_admitted_after_k_later_arrivals() -> None:
    bound = OvertakeBound(limit=2)
    for rid in ("minority", "m1", "m2", "m3"):
        bound.arrive(rid)
    bound.admit("m1")
    assert bound.overtakes("minority") == 1 and bound.due() is None
    bound.admit("m2")
    assert bound.overtakes("minority") == 2 and bound.due() == "minority"
    assert bound.overtakes("m3") == 0  # m1, m2 arrived before it


def test_requests_that_arrive_together_never_overtake_each_other() -> None:
    bound = OvertakeBound(limit=1)
    for rid in ("a", "b", "c"):
        bound.arrive(rid, arrival_s=1.0)
    bound.arrive("late", arrival_s=2.0)
    bound.admit("c")
    assert bound.due() is None  # "a" and "b" arrived with "c", not before it
    bound.admit("late")
    assert bound.due() == "a"


def test_the_oldest_waiting_request_of_a_class() -> None:
    bound = OvertakeBound(limit=None)
    for rid, arrival, priority in [("a", 1.0, 0), ("b", 1.0, 0), ("c", 2.0, 1), ("d", 3.0, 0)]:
        bound.arrive(rid, arrival_s=arrival, priority=priority)
    assert bound.oldest() in {"a", "b"} and bound.oldest(1) == "c"
    assert not bound.arrived_before("a", "b") and not bound.arrived_before("b", "a")
    assert bound.arrived_before("a", "d") and not bound.arrived_before("d", "a")
    bound.admit("a")
    bound.admit("b")
    assert bound.oldest() == "d" and bound.oldest(2) is None
    bound.requeue("a")  # preempted: it keeps its place in arrival order
    assert bound.oldest() == "a"


def test_the_oldest_waiting_request_of_a_tenant() -> None:
    bound = OvertakeBound(limit=None)
    for rid, arrival, tenant in [("a0", 1.0, 0), ("b0", 2.0, 1), ("b1", 3.0, 1)]:
        bound.arrive(rid, arrival_s=arrival, tenant=tenant)
    assert bound.oldest() == "a0" and bound.oldest(tenant=1) == "b0"
    bound.admit("b0")
    assert bound.oldest(tenant=1) == "b1" and bound.oldest(tenant=2) is None
    bound.requeue("b0")  # preempted: first of its tenant again
    assert bound.oldest(tenant=1) == "b0"


def test_a_skip_undoes_its_admission_and_a_preemption_starts_afresh() -> None:
    bound = OvertakeBound(limit=1)
    for rid in ("old", "young", "other"):
        bound.arrive(rid)
    bound.admit("young")
    assert bound.due() == "old"
    bound.hold("young", was_running=True)  # the engine skipped it: nothing passed "old"
    assert bound.due() is None
    bound.requeue("young")
    bound.admit("old")
    bound.admit("other")
    bound.requeue("old")  # preempted: waits under the bound afresh
    assert bound.overtakes("old") == 0 and bound.overtakes("young") == 1  # "other" only


operations = st.lists(st.tuples(st.sampled_from(["arrive", "admit", "skip", "preempt",
                                                 "finish", "park", "unpark", "stop"]),
                                st.integers(0, 50)), max_size=150)
limits = st.one_of(st.none(), st.integers(0, 4))


@settings(max_examples=300, deadline=None)
@given(operations, limits, limits, st.integers(1, 3), st.integers(1, 4),
       st.one_of(st.none(), st.sets(st.integers(0, 4))))
def test_counts_and_the_due_request_match_the_model(ops, limit: int | None,
                                                    stop_limit: int | None, classes: int,
                                                    tenants: int, window: set | None) -> None:
    """Requests of ``classes`` priority classes and ``tenants`` tenants: counts by later
    arrivals of the same tenant and the same or a less urgent class, STOPs since entry,
    the due request of the most urgent class waiting among the ``window``'s tenants."""
    bound, model = OvertakeBound(limit, stop_limit), Model()
    mask = None if window is None else np.isin(np.arange(3), sorted(window))
    window = None if mask is None else set(np.flatnonzero(mask).tolist())  # 3, 4 unmarked
    waiting: list[str] = []
    running: list[str] = []
    parked: list[str] = []
    last_admitted = None
    for n, (op, arg) in enumerate(ops):
        if op == "arrive":
            rid = f"r{n}"
            tenant = arg // classes % tenants
            bound.arrive(rid, priority=arg % classes, tenant=tenant)
            model.arrive(rid, arg % classes, tenant)
            waiting.append(rid)
        elif op == "admit" and waiting:
            rid = waiting.pop(arg % len(waiting))
            bound.admit(rid)
            model.log.append(rid)
            model.held[rid] = model.entered.pop(rid)
            running.append(rid)
            last_admitted = rid
            continue
        elif op == "skip" and last_admitted in running:
            running.remove(last_admitted)
            bound.hold(last_admitted, was_running=True)
            model.log.pop()
            parked.append(last_admitted)
        elif op == "park" and waiting:
            rid = waiting.pop(arg % len(waiting))
            bound.hold(rid, was_running=False)
            model.held[rid] = model.entered.pop(rid)
            parked.append(rid)
        elif op == "unpark" and parked:
            rid = parked.pop(arg % len(parked))
            bound.requeue(rid)
            model.entered[rid] = model.held.pop(rid)
            waiting.append(rid)
        elif op == "preempt" and running:
            rid = running.pop(arg % len(running))
            bound.requeue(rid)
            model.held.pop(rid, None)
            model.entered[rid] = len(model.log)
            model.stops_at[rid] = model.stops
            waiting.append(rid)
        elif op == "finish" and running:
            rid = running.pop(arg % len(running))
            bound.forget(rid)
            model.held.pop(rid, None)
        elif op == "stop":
            bound.stopped()
            model.stops += 1
        last_admitted = None
        for rid in waiting:
            assert bound.overtakes(rid) == model.overtakes(rid)
            assert bound.stops(rid) == model.stops - model.stops_at[rid]
        assert bound.due(model.top(), mask) == model.due(limit, stop_limit, window)
        assert bound.stops_left(model.top()) == model.stops_left(stop_limit)


def test_more_urgent_later_arrivals_do_not_count_and_only_the_top_class_is_due() -> None:
    bound = OvertakeBound(limit=1)
    bound.arrive("low", priority=1)
    bound.arrive("urgent", priority=0)
    bound.arrive("urgent2", priority=0)
    bound.admit("urgent")
    assert bound.overtakes("low") == 0  # a more urgent request was entitled to go first
    bound.arrive("low2", priority=1)
    bound.admit("low2")
    assert bound.overtakes("low") == 1  # one of its own class
    assert bound.overtakes("urgent2") == 1  # so is a less urgent one
    assert bound.due(0) == "urgent2" and bound.due(1) == "low"
    bound.admit("urgent2")
    bound.arrive("urgent3", priority=0)
    assert bound.due(0) is None  # "low" is at its bound, but class 0 still waits


def test_the_log_is_trimmed_to_what_waiting_requests_need() -> None:
    bound = OvertakeBound(limit=10)
    bound.arrive("patient")
    for i in range(5000):
        bound.arrive(f"r{i}")
        bound.admit(f"r{i}")
        bound.forget(f"r{i}")
        if i == 2500:
            bound.admit("patient")
            bound.forget("patient")
    assert len(bound._log) <= 4096  # the admissions before "patient" left were dropped


def test_the_queue_admits_a_starving_minority_within_the_bound() -> None:
    """A majority group keeps arriving; the tree alone would never pick the minority."""
    queue = FeatherQueue(ChunkLossGate(max_loss=0, floor_start=0), max_overtakes=4,
                         max_wait_s=None)
    keys = {group: [(group,), (group, 1)] for group in ("major", "minor")}
    queue.add("major-0", keys["major"])
    queue.add("minor-0", keys["minor"])
    admitted = []
    for step in range(1, 12):
        queue.new_step()
        queue.add(f"major-{step}", keys["major"] + [(step,)])
        while (answer := queue.decide()) is not None and answer.decision is Decision.ADD:
            queue.admit(answer.request_id)
            admitted.append(answer.request_id)
    position = admitted.index("minor-0")
    later = [r for r in admitted[:position] if r != "major-0"]
    assert len(later) == 4  # exactly the bound, then the minority is forced in


def test_no_bound_means_no_count() -> None:
    queue = FeatherQueue(max_overtakes=None, max_stops=None)
    assert queue.bound is None
    with pytest.raises(ValueError, match="non-negative"):
        OvertakeBound(-1)
    with pytest.raises(ValueError, match="stop limit must be non-negative"):
        OvertakeBound(None, -1)


def test_the_gate_holds_a_waiting_request_back_at_most_s_times() -> None:
    bound = OvertakeBound(limit=None, stop_limit=2)
    bound.arrive("old")
    bound.stopped()
    bound.arrive("new")
    assert bound.due() is None
    bound.stopped()
    assert (bound.stops("old"), bound.stops("new")) == (2, 1) and bound.due() == "old"


def test_the_queue_admits_a_request_the_gate_keeps_stopping_for() -> None:
    """A strict gate stops for the other group every pass; after two STOPs it goes in."""
    queue = FeatherQueue(ChunkLossGate(max_loss=0, floor_start=0, floor_step=0),
                         max_overtakes=None, max_stops=2, max_wait_s=None)
    queue.add("a", [("a",), ("a", 1)])
    queue.admit(queue.decide().request_id)
    queue.add("b", [("b",), ("b", 1)])
    for _ in range(2):
        queue.new_step()
        assert queue.decide().decision is Decision.STOP
    queue.new_step()
    forced = queue.decide()
    assert forced.forced and forced.request_id == "b" and forced.decision is Decision.ADD


def test_stops_left_counts_down_to_the_oldest_waiters_bound() -> None:
    bound = OvertakeBound(limit=None, stop_limit=3)
    assert bound.stops_left() is None  # nothing waits
    bound.arrive("a", 0.0)
    bound.stopped()
    bound.arrive("b", 1.0)
    assert bound.stops_left() == 2
    bound.stopped()
    bound.stopped()
    assert bound.stops_left() == 0 and bound.due() == "a"
    bound.admit("a")
    assert bound.stops_left() == 1
    assert OvertakeBound(limit=4).stops_left() is None
