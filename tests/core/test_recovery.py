"""``Recovery``: Feather's picture emptied after a fault and rebuilt from the engine's
queues, each request keeping its arrival and counts and counted in and out once."""

from __future__ import annotations

import pytest

from feather_sched.core.cht import ChunkedHashTree
from feather_sched.core.config import FeatherConfig
from feather_sched.core.runtime import FeatherRuntime
from tests.core.test_runtime import (
    RecordingGate,
    TenantReq,
    TenantView,
    admit_all,
    req,
    running_ids,
    runtime,
)


def test_resync_rebuilds_the_picture_from_the_engines_sets() -> None:
    """After a fault the queue may hold anything: resync rebuilds it from what the engine
    runs and holds waiting, keeping arrivals and preemption counts, counting each request
    in once and out once."""
    rt = runtime(gate=RecordingGate())
    a, b, c, d = req("a", 0), req("b", 0), req("c", 1), req("d", 2)
    for arrival, request in enumerate((a, b, c, d)):
        request.arrival = float(arrival)
        rt.enter_waiting(request)
    rt.begin_pass([])
    running = admit_all(rt, [], limit=2)
    rt.end_pass(1, running)
    rt.preempted(running[1])
    rt.queue.tree.remove("c")  # a fault left the tree half-updated
    e = req("e", 1)
    e.arrival = 4.0
    rt.resync(running, [e, d, c])  # e is new to Feather; the waiting side by arrival
    assert running_ids(rt) == {"a", "b"} and list(rt.queue.waiting_ids()) == ["c", "d", "e"]
    assert rt.queue.arrival_s("c") == 2.0 and rt._record.tracked["b"].preemptions == 1
    assert not rt.faults.dirty
    rt.resync(running, [c, e])  # d left unseen
    stats = rt.meter.stats
    assert (stats.requests_entered, stats.requests_left) == (5, 1)
    rt.begin_pass(running)
    assert rt.decide().request_id == "c"  # the older of the two, both of group 1


def test_begin_pass_after_a_fault_rebuilds_from_the_engines_queues(contained_faults) -> None:
    rt = runtime()
    a, b = req("a", 0), req("b", 1)
    rt.enter_waiting(a)
    rt.faults.fault("decide", KeyError("a"))
    with pytest.raises(ValueError, match="waiting queue"):
        rt.begin_pass([])
    assert rt.faults.dirty
    rt.begin_pass([a], [b])  # the engine runs a and holds b waiting
    assert not rt.faults.dirty and running_ids(rt) == {"a"} and len(rt) == 1 and "b" in rt


@pytest.mark.parametrize("fairness", ["tenants", "vtc"])
def test_a_fault_in_the_rebuild_leaves_the_picture_empty_and_counts_once(
        fairness: str, monkeypatch, contained_faults) -> None:
    """Under fair share, twelve requests running: a fault empties Feather's picture, and a
    second one in the rebuild that follows (at its fifth request) leaves it empty again,
    not half-rebuilt. Meanwhile every call an adapter makes (the step's service, a
    request's exit) is answered without a fault, so the two faults count two and Feather
    stays on; the next rebuild is whole, and each request is counted in and out once."""
    config = FeatherConfig.from_sources({"gate": "always", "max_wait_s": None,
                                         "fairness": fairness}, environ={})
    rt = FeatherRuntime(config, TenantView(), clock=lambda: 0.0)
    requests = [TenantReq(f"r{i}", req(f"r{i}", i).keys, arrival=float(i),
                          tenant="ab"[i % 2]) for i in range(15)]
    for request in requests:
        rt.enter_waiting(request)
    rt.begin_pass([])
    running = admit_all(rt, [], limit=12)
    rt.end_pass(1, running)
    waiting = requests[12:]
    share, guard = rt.queue.share, rt.faults

    def adapter_calls(step: int) -> None:  # as an engine's step result makes them
        for request in running:
            guard.attempt("served", rt.served, request.rid, 0, 1)
        gone = running.pop()
        assert guard.call("discard", rt.discard, gone.rid) is True
        assert guard.call("discard", rt.discard, gone.rid) is False
        guard.attempt("step", rt.end_step, step, len(running), 0.01)

    guard.fault("decide", RuntimeError("the first"))
    assert not rt._record.tracked and len(rt) == 0 and rt.queue.num_running == 0
    adapter_calls(1)
    add = ChunkedHashTree.add
    calls = iter(range(100))
    monkeypatch.setattr(ChunkedHashTree, "add", lambda *args: add(*args) if next(calls) != 4
                        else 1 / 0)
    assert not guard.attempt("begin_pass", rt.begin_pass, running, waiting)
    assert not rt._record.tracked and len(rt) == 0 and rt.queue.num_running == 0
    adapter_calls(2)
    monkeypatch.undo()
    served = {tenant: share.service(tenant) for tenant in "ab"}
    assert guard.attempt("begin_pass", rt.begin_pass, running, waiting)
    assert running_ids(rt) == {r.rid for r in running} and len(rt) == 3
    for request in running:
        rt.served(request.rid, 0, 1)
    assert all(share.service(t) > served[t] for t in "ab")
    assert [where for where, _ in contained_faults] == ["decide", "begin_pass"]
    assert rt.meter.stats.faults == 2 and guard.active and not guard.dirty
    for request in [*running, *waiting]:
        rt.discard(request.rid)
    stats = rt.meter.stats
    assert stats.requests_entered == stats.requests_left == 15

def test_a_fault_midway_leaves_the_picture_empty_and_keeps_what_it_knew(monkeypatch) -> None:
    """An ``Exception`` in the rebuild empties the picture (``drop``) and propagates; the
    requests known before stay unsettled, so the next rebuild keeps their arrivals."""
    rt = runtime()
    a, b = req("a", 0), req("b", 1)
    a.arrival, b.arrival = 1.0, 2.0
    for request in (a, b):
        rt.enter_waiting(request)
    add = ChunkedHashTree.add
    monkeypatch.setattr(ChunkedHashTree, "add", lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        rt.resync([], [a, b])
    assert len(rt) == 0 and not rt._record.tracked
    assert set(rt._record.unsettled) == {"a", "b"}
    monkeypatch.setattr(ChunkedHashTree, "add", add)
    a.arrival = b.arrival = None
    rt.resync([], [b, a])
    assert [rt.queue.arrival_s(r) for r in ("a", "b")] == [1.0, 2.0]
    stats = rt.meter.stats
    assert (stats.requests_entered, stats.requests_left) == (2, 0)
