"""``Record``: the engine's requests as Feather knows them, each counted in and out once,
keeping its arrival and preemption counts across a re-key and a fault."""

from __future__ import annotations

from feather_sched.core.config import FeatherConfig
from feather_sched.core.queue import QueueState
from feather_sched.core.record import Record
from feather_sched.telemetry.stats import StepMeter
from tests.core.test_runtime import Req, View, req


def make_record(now: float = 5.0) -> Record:
    config = FeatherConfig.from_sources({"gate": "always", "max_wait_s": None}, environ={})
    return Record(View(), config.make_queue(clock=lambda: now), lambda: now, StepMeter("t"))


def test_a_request_is_counted_in_once_and_out_once() -> None:
    record = make_record()
    a = req("a")
    a.arrival = 1.0
    assert record.refresh(a) == "a" and record.refresh(a) == "a"
    assert record.queue.state("a") is QueueState.WAITING and record.queue.arrival_s("a") == 1.0
    assert record.forget("a") and not record.forget("a") and "a" not in record.tracked
    stats = record.meter.stats
    assert (stats.requests_entered, stats.requests_left) == (1, 1)


def test_a_grown_prompt_is_rekeyed_and_keeps_its_counts() -> None:
    record = make_record()
    a = req("a")
    record.refresh(a)
    record.preempted("a")
    grown = Req("a", [*a.keys, ("more",)], arrival=3.0)
    record.refresh(grown)
    tracked = record.tracked["a"]
    assert tracked.request is grown and tracked.prompt_tokens == len(grown.keys)
    assert tracked.preemptions == 1 and record.queue.keys("a") == grown.keys
    assert record.meter.stats.requests_entered == 1


def test_an_unsettled_request_comes_back_with_its_arrival_or_leaves_once() -> None:
    record = make_record(now=9.0)
    a, b = req("a"), req("b")
    a.arrival, b.arrival = 1.0, 2.0
    record.refresh(a)
    record.refresh(b)
    record.preempted("a")
    record.unsettle()
    record.queue.clear()  # a fault emptied the picture
    assert record.tracked == {} and set(record.unsettled) == {"a", "b"}
    a.arrival = None  # the engine no longer tells: the record does
    record.refresh(a)
    assert record.queue.arrival_s("a") == 1.0 and record.tracked["a"].preemptions == 1
    assert record.forget("b") and not record.forget("b")
    stats = record.meter.stats
    assert (stats.requests_entered, stats.requests_left) == (2, 1)


def test_stale_and_unseen_tell_what_reconciling_must_do() -> None:
    record = make_record()
    a, b = req("a"), req("b")
    assert record.stale(a)  # new to Feather
    record.refresh(a)
    record.refresh(b)
    assert not record.stale(a)
    record.queue.admit("a")
    assert record.stale(a)  # running, not waiting
    assert not record.stale(b) and record.stale(Req("b", [*b.keys, ("more",)]))
    assert record.unseen({"a"}, {"b"}) == [] and record.unseen({"a"}, set()) == ["b"]


def test_only_a_less_urgent_request_under_its_bound_gives_way() -> None:
    record = make_record()
    low, urgent = Req("low", req("low").keys, priority=1), Req("urgent", priority=0)
    record.refresh(low)
    assert record.may_give_way(low, 0, limit=1) and not record.may_give_way(low, 1, limit=1)
    record.urgent_victims([low, Req("unknown", priority=1)])
    assert not record.may_give_way(low, 0, limit=1) and record.may_give_way(low, 0, limit=2)
    assert record.may_give_way(Req("unknown", priority=1), 0, limit=1)  # by class alone
    assert not record.may_give_way(urgent, 0, limit=1)
