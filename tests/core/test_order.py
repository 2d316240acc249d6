"""``Order``: the running order (the preemption order), its mirror of the engine's list, and
the waiting order, through the runtime's members and directly."""

from __future__ import annotations

from tests.core.test_runtime import Req, admit_all, req, runtime


def test_admissions_and_exits_between_passes_keep_the_order_exact() -> None:
    """Between passes Feather follows the engine's list through the admissions and exits
    it is told of; the next pass still returns Feather's order where they change it:
    a group's oldest member leaving re-ranks the group, a member joining its group or an
    older request admitted last moves into place."""
    rt = runtime()
    a1, b1, a2, c1, b2 = req("a1", 0), req("b1", 1), req("a2", 0), req("c1", 2), req("b2", 1)
    for arrival, request in enumerate((a1, b1, a2, c1)):
        request.arrival = float(arrival)
        rt.enter_waiting(request)
    running = rt.begin_pass([])
    admit_all(rt, running)
    rt.end_pass(1, running)
    running = rt.begin_pass(running)
    assert [r.rid for r in running] == ["a1", "a2", "b1", "c1"]
    running.remove(a1)  # finished: group a now ranks by a2, after b1
    rt.discard("a1")
    running = rt.begin_pass(running)
    assert [r.rid for r in running] == ["b1", "a2", "c1"]
    running.remove(c1)  # a group of one leaving changes no rank
    rt.discard("c1")
    assert rt.begin_pass(running) == running
    b2.arrival = 4.0
    rt.enter_waiting(b2)
    admit_all(rt, running)
    rt.end_pass(2, running)
    assert [r.rid for r in running] == ["b1", "a2", "b2"]  # appended: b2 joins group b
    running = rt.begin_pass(running)
    assert [r.rid for r in running] == ["b1", "b2", "a2"]
    d = req("d", 3)
    d.arrival = 1.5  # older than a2: its group ranks before a's
    rt.enter_waiting(d)
    running = rt.begin_pass(running)
    admit_all(rt, running)
    rt.end_pass(3, running)
    assert [r.rid for r in rt.begin_pass(running)] == ["b1", "b2", "d", "a2"]


def test_begin_pass_returns_the_running_list_grouped_by_age() -> None:
    rt = runtime()
    running = [req("b1", 1), req("a1", 0), req("a2", 0)]
    for arrival, request in enumerate(running):
        request.arrival = float(arrival)
        rt.enter_waiting(request)
    assert [r.rid for r in rt.begin_pass(running)] == ["b1", "a1", "a2"]
    assert [r.rid for r in rt.begin_pass(running[::-1])] == ["b1", "a1", "a2"]
    rt = runtime(order_running=False)
    for request in running:
        rt.enter_waiting(request)
    as_given = [running[2], running[0], running[1]]
    assert rt.begin_pass(as_given) == as_given  # the engine's order
    assert [r.rid for r in rt.order(as_given)] == ["b1", "a1", "a2"]  # by arrival only
    assert rt.preemption_victim(as_given) is running[2]  # the latest arrival


def test_the_victim_is_the_newest_member_of_the_youngest_group() -> None:
    rt = runtime()
    old = Req("solo", [(9,)], arrival=1.0)
    first, young = Req("maj-1", [(0,)], arrival=2.0), Req("maj-2", [(0,)], arrival=3.0)
    tied = Req("maj-3", [(0,), (0, "t")], arrival=3.0)  # same time, entered later
    for request in (old, first, young, tied):
        rt.enter_waiting(request)
    ordered = rt.begin_pass([young, tied, old, first])
    assert [r.rid for r in ordered] == ["solo", "maj-1", "maj-2", "maj-3"]
    assert rt.preemption_victim(ordered) is tied  # the old singleton never pays
    assert rt.preemption_victim([old, first]) is first
    later = Req("late", [(5,)], arrival=1.5)  # a singleton older than the group's oldest
    rt.enter_waiting(later)
    assert rt.preemption_victim([old, later, first, young]) is young
    stranger = Req("never-seen", arrival=0.5)  # not in the queue: its own arrival counts
    assert rt.preemption_victim([stranger, old]) is old
    rt = runtime(order_running=False)
    for request in (old, first, young, tied):
        rt.enter_waiting(request)
    assert rt.preemption_victim([tied, old, first, young]) is tied  # the latest arrival


def test_a_member_at_the_preemption_bound_goes_after_its_group() -> None:
    """Preempted ``max_preemptions`` times, a request leads its group in the order (its
    siblings go first), the group keeps its place (by its oldest member), and the
    order returns to age once it leaves."""
    rt = runtime(max_preemptions=2)
    solo = Req("solo", [(9,)], arrival=1.0)
    members = [Req(f"a{i}", [(0,), (0, i)], arrival=2.0 + i) for i in range(3)]
    for request in (solo, *members):
        rt.enter_waiting(request)
    running = rt.begin_pass([solo, *members])
    assert rt.preemption_victim(running) is members[2]
    rt.preempted(members[2])
    assert rt.preemption_victim(running) is members[2]  # below the bound still
    rt.preempted(members[2])
    ordered = rt.begin_pass(running)
    assert [r.rid for r in ordered] == ["solo", "a2", "a0", "a1"]
    assert rt.preemption_victim(ordered) is members[1]
    assert rt.begin_pass(ordered) == ordered  # the same order from the mirror
    rt.discard("a2")
    assert [r.rid for r in rt.begin_pass(ordered[:1] + ordered[2:])] == ["solo", "a0", "a1"]
    assert runtime(max_preemptions=None).config.max_preemptions is None


def test_the_batch_order_gathers_a_group_across_classes() -> None:
    """Preemption keeps classes apart (the least urgent last); a batch lays each group
    out in one run, where its first member stands."""
    rt = runtime()
    a_low = Req("a-low", [(1,), (1, "x")], arrival=1.0, priority=1)
    b_high = Req("b-high", [(2,), (2, "y")], arrival=2.0, priority=0)
    a_high = Req("a-high", [(1,), (1, "z")], arrival=3.0, priority=0)
    for request in (a_low, b_high, a_high):
        rt.enter_waiting(request)
    running = rt.begin_pass([a_low, b_high, a_high])
    assert [r.rid for r in running] == ["b-high", "a-high", "a-low"]
    assert [r.rid for r in rt.batch_order(running)] == ["b-high", "a-high", "a-low"]
    assert [r.rid for r in rt.order([a_low, a_high, b_high])] == ["b-high", "a-high", "a-low"]
    c_high = Req("c-high", [(1,), (1, "w")], arrival=0.5, priority=0)  # group 1, oldest
    rt.enter_waiting(c_high)
    running = rt.begin_pass([a_low, b_high, a_high, c_high])
    assert [r.rid for r in running] == ["c-high", "a-high", "b-high", "a-low"]
    assert [r.rid for r in rt.batch_order(running)] == ["c-high", "a-high", "a-low", "b-high"]


def test_the_least_urgent_class_gives_way_first_however_old() -> None:
    rt = runtime()
    old_low = Req("old-low", [(1,)], arrival=1.0, priority=1)
    young_high = Req("young-high", [(2,)], arrival=5.0, priority=0)
    for request in (old_low, young_high):
        rt.enter_waiting(request)
    assert rt.preemption_victim([young_high, old_low]) is old_low
    stranger = Req("never-seen", arrival=9.0, priority=0)
    assert rt.preemption_victim([stranger, old_low]) is old_low


def test_a_bypassing_admission_passes_a_due_request_only_if_it_arrived_later() -> None:
    """What an engine's own side queue (vLLM's kv_holding_waiting) may run before a due
    request: earlier arrivals, and more urgent ones; never a later one of its class."""
    rt = runtime(max_overtakes=0)
    assert not rt.passes_due(Req("alone", arrival=9.0))  # nothing waits: nothing due
    rt.enter_waiting(Req("due", [(1,)], arrival=2.0, priority=1))
    assert rt.passes_due(Req("later", arrival=3.0, priority=1))
    assert rt.passes_due(Req("less-urgent", arrival=1.0, priority=2))
    assert not rt.passes_due(Req("earlier", arrival=1.0, priority=1))
    assert not rt.passes_due(Req("urgent", arrival=3.0, priority=0))
    patient = runtime(max_overtakes=5)
    patient.enter_waiting(Req("waits", [(1,)], arrival=2.0, priority=1))
    assert not patient.passes_due(Req("later", arrival=3.0, priority=1))  # not due yet


def test_rank_waiting_puts_the_candidate_first_then_the_trees_rank() -> None:
    """The engine's waiting list as Feather would admit it: the candidate, then what the
    tree ranks (a running group's members before strangers, strangers by arrival), then
    requests Feather does not hold waiting, in their given order."""
    rt = runtime(min_passing_tokens=0)
    running = [req("r", 1)]
    long_stranger = Req("long", [("long", i) for i in range(9)], arrival=1.0)
    short_stranger = Req("short", [("short", 0)], arrival=2.0)
    sibling, held = req("sibling", 1), req("held", 2)
    for request in (*running, long_stranger, sibling, short_stranger, held):
        rt.enter_waiting(request)
    rt.begin_pass([])
    admit_all(rt, [], limit=1)  # "r", the oldest
    rt.end_pass(1, running)
    rt.begin_pass(running)
    rt.hold("held")
    unknown = req("unknown", 3)
    waiting = [unknown, held, short_stranger, long_stranger, sibling]
    ranked = rt.rank_waiting(waiting)
    assert [r.rid for r in ranked] == ["sibling", "long", "short", "unknown", "held"]
    assert ranked[0] is rt.candidate() and waiting[0] is unknown  # the list is not changed

def test_the_mirror_spares_reconciling_the_very_list_it_holds() -> None:
    rt = runtime()
    a, b = Req("a", [(0,)], arrival=1.0), Req("b", [(1,)], arrival=2.0)
    for request in (a, b):
        rt.enter_waiting(request)
    ordered = rt.begin_pass([b, a])
    order = rt._order
    assert order.unchanged(list(ordered)) == ["a", "b"]  # the same objects, any list
    assert order.unchanged([b, a]) is None and order.unchanged([a]) is None
    assert order.unchanged([a, Req("b", [(1,)], arrival=2.0)]) is None  # another object
    rt.discard("a")
    assert order.unchanged([b]) == ["b"]  # an exit it was told of keeps it current
    rt.queue.hold("b")  # the running set changed behind it
    assert order.current() is None and order.unchanged([b]) is None


def test_group_size_counts_the_running_members_and_the_request_once() -> None:
    rt = runtime()
    members = [Req(f"m{i}", [(0,), (0, i)], arrival=float(i)) for i in range(3)]
    solo = Req("solo", [(1,)], arrival=5.0)
    for request in (*members, solo):
        rt.enter_waiting(request)
    rt.begin_pass([*members[:2], solo])
    order = rt._order
    assert order.group_size(members[0], "m0") == 2
    assert order.group_size(members[2], "m2") == 3  # waiting, counted once
    assert order.group_size(solo, "solo") == 1
