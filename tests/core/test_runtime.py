"""FeatherRuntime: the contract every adapter drives, checked on a plain request type."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_sched.core.config import FeatherConfig
from feather_sched.core.queue import QueueState
from feather_sched.core.runtime import FeatherRuntime
from feather_sched.core.tenants import DEFAULT_HIT_WEIGHT
from feather_sched.gates.base import BatchLayout, Decision, GateContext, Unobservant


@dataclass(eq=False)
class Req:
    rid: str
    keys: list = field(default_factory=list)
    arrival: float = 0.0
    priority: int = 0


class View:
    def request_id(self, request: Req) -> str:
        return request.rid

    def chunk_keys(self, request: Req) -> list:
        return list(request.keys)

    def prompt_tokens(self, request: Req) -> int:
        return len(request.keys)

    def arrival_s(self, request: Req) -> float:
        return request.arrival

    def priority(self, request: Req) -> int:
        return request.priority


class RecordingGate(Unobservant):
    """STOP when the candidate loses two chunks or more; remembers every reward."""

    always_adds = False  # shown every candidate
    stops_in_ordered_batches = True  # it may STOP whatever the layout

    def __init__(self) -> None:
        self.rewards: list[tuple[list, int, float]] = []

    def decide(self, context: GateContext) -> Decision:
        return Decision.STOP if context.batch_size and context.chunk_loss > 1 else Decision.ADD

    def reward(self, decisions, batch_size: int, seconds: float) -> None:
        self.rewards.append((list(decisions), batch_size, seconds))

    def end_step(self) -> None:
        pass


def req(rid: str, group: int = 0, chunks: int = 3) -> Req:
    return Req(rid, [(group,) + (i,) * (i > 0) for i in range(chunks - 1)] + [(group, rid)])


def runtime(gate=None, on_fault=None, **options) -> FeatherRuntime:
    config = FeatherConfig.from_sources({"gate": "always", "max_wait_s": None, **options},
                                        environ={})
    rt = FeatherRuntime(config, View(), clock=lambda: 0.0, on_fault=on_fault)
    if gate is not None:
        rt.queue.gate = gate
    return rt


def admit_all(rt: FeatherRuntime, running: list[Req], limit: int = 99) -> list[Req]:
    """An engine's admission loop: ask, then admit while ADD (up to ``limit``)."""
    admitted = []
    while len(admitted) < limit and (answer := rt.decide()) is not None:
        if answer.decision is Decision.STOP:
            break
        request = rt.request(answer.request_id)
        rt.admit(request)
        running.append(request)
        admitted.append(request)
    return admitted


def running_ids(rt: FeatherRuntime) -> set[str]:
    return set(rt.queue.running_ids())


def test_enter_waiting_is_idempotent_and_discard_is_once() -> None:
    rt = runtime()
    a = req("a")
    rt.enter_waiting(a)
    rt.enter_waiting(a)
    assert len(rt) == 1 and "a" in rt
    assert rt.discard("a") is True
    assert rt.discard("a") is False and "a" not in rt and len(rt) == 0


def test_the_running_set_is_the_engines_not_the_admissions() -> None:
    rt = runtime(gate=RecordingGate())
    a, b, phantom = req("a", 0), req("b", 1), req("phantom", 0)
    for request in (a, b, phantom):
        rt.enter_waiting(request)
    running: list[Req] = []
    rt.begin_pass(running)
    admit_all(rt, running, limit=1)
    rt.end_pass(1, running)
    # the engine parks the running request elsewhere (a streaming session between turns)
    running.remove(running[0])
    rt.begin_pass(running)
    assert running_ids(rt) == set() and rt.queue.state("a") is QueueState.HELD
    answer = rt.decide()
    assert answer.context.batch_size == 0 and answer.decision is Decision.ADD


def test_a_pass_over_the_same_list_still_sees_what_changed_between_passes() -> None:
    """``begin_pass`` skips its work for the list it ordered last, unless Feather's
    running set changed since: a hold (the engine skipped the request) is undone, and
    a list the engine reordered is put back in order."""
    rt = runtime()
    a, b, c = req("a", 0), req("b", 1), req("c", 0)
    for request in (a, b, c):
        rt.enter_waiting(request)
    running = rt.begin_pass([])
    admit_all(rt, running)
    rt.end_pass(1, running)
    running = rt.begin_pass(running)
    assert running == [a, c, b] and rt.begin_pass(running) == [a, c, b]
    rt.hold("c")
    assert rt.begin_pass(running) == [a, c, b] and rt.queue.state("c") is QueueState.RUNNING
    assert rt.begin_pass([b, c, a]) == [a, c, b]


def test_an_engine_running_a_request_feather_never_admitted_is_believed() -> None:
    rt = runtime()
    a, b = req("a"), req("b")
    rt.enter_waiting(a)
    rt.begin_pass([a, b])  # b arrived by a path Feather does not see; a bypassed the gate
    assert running_ids(rt) == {"a", "b"} and len(rt) == 0


def test_an_add_counts_only_when_its_request_runs() -> None:
    rt = runtime()
    a, b = req("a", 0), req("b", 0)
    rt.enter_waiting(a)
    rt.enter_waiting(b)
    running: list[Req] = []
    rt.begin_pass(running)
    rt.decide()  # asked, but the engine had no room: nothing admitted
    rt.end_pass(1, running)
    rt.end_step(1, 0, 0.1)
    assert (rt.counts.asked, rt.counts.add) == (1, 0)
    rt.begin_pass(running)
    admitted = admit_all(rt, running)
    skipped = admitted[1]
    running.remove(skipped)
    rt.hold(skipped.rid)  # the engine popped it, then skipped it
    rt.end_pass(2, running)
    assert (rt.counts.add, rt.counts.stop, rt.counts.forced) == (1, 0, 0)
    assert rt.queue.state(skipped.rid) is QueueState.HELD
    rt.enter_waiting(skipped)  # and prepended it back
    assert rt.queue.state(skipped.rid) is QueueState.WAITING


def test_rewards_reach_the_decisions_of_their_own_step() -> None:
    """Async scheduling: pass N+1 is formed before step N reports."""
    gate = RecordingGate()
    rt = runtime(gate=gate)
    rt.enter_waiting(a0 := req("a0", 0))
    running: list[Req] = []
    rt.begin_pass(running)
    admit_all(rt, running)
    rt.end_pass("step-1", running)  # an empty batch: ADD, and not a learned decision
    for request in (req("a1", 0), req("b0", 1)):
        rt.enter_waiting(request)
    rt.begin_pass(running)
    admit_all(rt, running)  # a1 ADD (no loss), then b0 STOP (loses the group's chunks)
    rt.end_pass("step-2", running)
    rt.end_step("step-2", 2, 0.5)
    rt.end_step("step-1", 1, 0.25)
    step2, step1 = gate.rewards
    assert [d for _, d in step2[0]] == [Decision.ADD, Decision.STOP] and step2[1:] == (2, 0.5)
    assert [d for _, d in step1[0]] == [Decision.ADD] and step1[1:] == (1, 0.25)
    assert (rt.counts.add, rt.counts.stop, rt.counts.asked) == (2, 1, 3)
    assert a0 in running


def test_a_prompt_that_grew_is_rekeyed() -> None:
    rt = runtime()
    session = req("s", 0, chunks=2)
    rt.enter_waiting(session)
    rt.begin_pass([session])
    session.keys = [*session.keys, ("s", "turn-2")]
    rt.begin_pass([])
    rt.enter_waiting(session)
    assert rt.queue.keys("s") == session.keys


def test_reconcile_with_the_waiting_queue_forgets_what_left_unseen() -> None:
    rt = runtime()
    a, b, c = req("a"), req("b"), req("c")
    for request in (a, b, c):
        rt.enter_waiting(request)
    rt.reconcile(running=[a], waiting=[c])
    assert "b" not in rt and running_ids(rt) == {"a"} and list(rt.queue.waiting_ids()) == ["c"]


def test_admit_requires_an_add_for_that_request() -> None:
    rt = runtime()
    a, b = req("a"), req("b", 1)
    rt.enter_waiting(a)
    rt.enter_waiting(b)
    rt.begin_pass([])
    with pytest.raises(RuntimeError, match="without an ADD"):
        rt.admit(a)
    assert rt.decide().request_id == "a"
    with pytest.raises(RuntimeError, match="without an ADD"):
        rt.admit(b)


def test_stats_are_written_and_a_failed_write_keeps_the_runtime_alive(tmp_path, caplog) -> None:
    stats = tmp_path / "stats.json"
    rt = runtime(stats_file=str(stats))
    rt.enter_waiting(a := req("a"))
    rt.begin_pass([])
    admit_all(rt, running := [])
    rt.end_pass(1, running)
    rt.end_step(1, 1, 0.5)
    rt.close()
    data = json.loads(stats.read_text())
    assert data["steps"] == 1 and data["admissions"]["add"] == 1
    rt.meter.stats_file = str(tmp_path / "missing" / "stats.json")
    rt.close()  # logged, not raised
    assert "could not write its stats file" in caplog.text
    assert a in running


def test_faults_are_counted_logged_once_and_n_in_a_row_turn_feather_off(
        contained_faults, caplog) -> None:
    rt = runtime(max_faults=3)
    guard, stats = rt.faults, rt.meter.stats
    guard.fault("decide", KeyError("a"))
    guard.fault("admit", KeyError("b"))
    rt.enter_waiting(req("a"))
    rt.begin_pass([], [req("a")])  # rebuilt from the engine's sets first
    rt.end_pass(1, admit_all(rt, []))  # a pass that decided ends the run
    assert (stats.faults, guard.in_a_row, guard.active, guard.dirty) == (2, 0, True, False)
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is not None  # the first, with traceback
    assert "fault in decide" in errors[0].getMessage()
    for where in ("begin_pass", "decide"):
        guard.fault(where, RuntimeError(where))
        for step in range(2):  # passes that decide nothing: fewer than 3 go on with the run
            rt.begin_pass([], [])
            rt.end_pass(step, [])
    guard.fault("end_pass", RuntimeError("end_pass"))
    assert not guard.active and stats.faults == 5
    assert caplog.text.count("Feather is off") == 1
    assert "3 faults in a row" in caplog.text and "the latest in end_pass" in caplog.text
    assert [where for where, _ in contained_faults] == ["decide", "admit", "begin_pass",
                                                        "decide", "end_pass"]


events = st.lists(st.tuples(st.sampled_from(["arrive", "pass", "finish", "preempt", "park",
                                             "resume", "abort"]), st.integers(0, 11)),
                  max_size=120)


@settings(max_examples=150, deadline=None)
@given(events, st.integers(1, 4))
def test_any_engine_history_keeps_the_picture_exact(history, seats: int) -> None:
    """A toy engine that preempts, parks, skips and aborts; after every pass Feather's
    running set is the engine's and every request leaves exactly once."""
    rt = runtime(gate=RecordingGate())
    waiting: list[Req] = []
    running: list[Req] = []
    parked: list[Req] = []
    arrived, left = [], []
    for n, (event, arg) in enumerate(history):
        if event == "arrive":  # groups 0-2, or a group of its own; classes 0 and 1
            request = req(f"r{n}", arg % 4, chunks=1 if arg % 4 == 3 else 3)
            request.priority = arg // 6
            arrived.append(request.rid)
            waiting.append(request)
            rt.enter_waiting(request)
        elif event == "pass":
            running[:] = rt.begin_pass(running)
            assert running == rt.order(running)  # a pass that reuses the last order too
            while len(running) < seats and (answer := rt.decide()) is not None:
                if answer.decision is Decision.STOP:
                    break
                request = rt.request(answer.request_id)
                rt.admit(request)
                waiting.remove(request)
                if arg % 3 == 0:  # popped, then skipped for this pass
                    rt.hold(request.rid)
                    waiting.append(request)
                    rt.enter_waiting(request)
                    break
                running.append(request)
            rt.end_pass(n, running)
            assert running_ids(rt) == {r.rid for r in running}
            rt.end_step(n, len(running), 0.01)
        elif event in ("finish", "preempt", "park") and running:
            request = running.pop(arg % len(running))
            if event == "finish":
                rt.discard(request.rid)
                left.append(request.rid)
            elif event == "preempt":  # reported: past the bound, it orders differently
                rt.preempted(request)
                waiting.insert(0, request)
                rt.enter_waiting(request)
            else:
                parked.append(request)
        elif event == "resume" and parked:
            running.append(parked.pop(arg % len(parked)))  # the engine runs it directly
        elif event == "abort" and waiting:
            request = waiting.pop(arg % len(waiting))
            rt.discard(request.rid)
            left.append(request.rid)
    for request in waiting + running + parked:
        assert rt.discard(request.rid)
        left.append(request.rid)
    assert sorted(left) == sorted(arrived) and len(rt) == 0 and not running_ids(rt)
    stats = rt.meter.stats
    assert stats.requests_entered == stats.requests_left == len(arrived)


def test_the_queue_learns_the_engines_size_and_who_lays_out_the_batch() -> None:
    """What ``FeatherQueue.fits_all`` and the arrival-order rule read: the seats and KV
    cache the adapter gives, and whether Feather's batch order acts."""
    config = FeatherConfig.from_sources({"gate": "always"}, environ={})
    rt = FeatherRuntime(config, View(), seats=8, kv_tokens=4096)
    assert (rt.queue.seats, rt.queue.kv_tokens, rt.layout) == (8, 4096, BatchLayout.FEATHER)
    rt.engine_keeps_its_order()
    assert rt.layout is BatchLayout.ENGINE
    assert runtime(order_running=False).layout is BatchLayout.ENGINE


# ---- the verbs every adapter shares ---------------------------------------------------


def test_describe_batch_counts_shared_chunks_in_feathers_chunks() -> None:
    rt = runtime(chunk_tokens=16)
    a, b, stranger = req("a", 7, chunks=4), req("b", 7, chunks=4), req("x", 8, chunks=2)
    rt.enter_waiting(a)
    rows = [(a, 70, 1), (b, 40, 8), (stranger, 30, 1)]
    entries = rt.describe_batch(rows)  # b is keyed by the view: Feather does not track it
    assert [e.group for e in entries] == [(7,), (7,), (8,)]
    assert [e.shared_tokens for e in entries] == [3 * 16, 3 * 16 - 8, 0]
    assert [(e.context_tokens, e.new_tokens) for e in entries] == [(70, 1), (40, 8), (30, 1)]


def test_guarded_calls_contain_a_fault_and_run_the_adapters_fall_back(
        contained_faults) -> None:
    fell_back: list[str] = []
    rt = runtime(on_fault=fell_back.append)
    assert rt.faults.call("decide", lambda x: x + 1, 1) == 2
    assert rt.faults.attempt("admit", lambda: None) is True
    assert rt.faults.call("decide", lambda: {}["missing"], default="engine's") == "engine's"
    assert rt.faults.attempt("admit", rt.admit, req("never-decided")) is False
    assert fell_back == ["decide", "admit"] == [where for where, _ in contained_faults]
    assert rt.meter.stats.faults == 2 and not rt.faults.serves
    with pytest.raises(KeyboardInterrupt):
        rt.faults.call("decide", _interrupt)


def _interrupt() -> None:
    raise KeyboardInterrupt


@dataclass(eq=False)
class TenantReq(Req):
    tenant: str = "default"


class TenantView(View):
    def tenant(self, request: TenantReq) -> str:
        return request.tenant


def test_served_work_is_the_tenants_and_steers_the_next_admissions() -> None:
    config = FeatherConfig.from_sources({"gate": "always", "max_wait_s": None,
                                         "fairness": "tenants", "fair_quantum_tokens": 0},
                                        environ={})
    rt = FeatherRuntime(config, TenantView(), clock=lambda: 0.0)
    flood = [TenantReq(f"f{i}", req(f"f{i}", 0).keys, tenant="flood") for i in range(3)]
    other = TenantReq("o", req("o", 1).keys, arrival=1.0, tenant="other")
    for request in [*flood, other]:
        rt.enter_waiting(request)
    running: list[Req] = []
    rt.begin_pass(running)
    assert [r.rid for r in admit_all(rt, running, limit=1)] == ["f0"]
    rt.end_pass(1, running)
    rt.served("f0", computed_tokens=300, generated_tokens=1)
    rt.served("unknown", computed_tokens=10**6, generated_tokens=0)  # ignored
    prompt, hits = len(flood[0].keys), DEFAULT_HIT_WEIGHT  # its prompt, charged at admission
    assert rt.queue.share.service("flood") == hits * prompt + (1 - hits) * 300 + 2
    assert rt.queue.share.service("other") == 0
    rt.begin_pass(running)
    assert [r.rid for r in admit_all(rt, running, limit=1)] == ["o"]  # the less served
    assert [r.rid for r in rt.rank_waiting(flood[1:])] == ["f1", "f2"]


def test_an_admission_the_engine_skips_is_refunded_and_charged_when_it_runs() -> None:
    """vLLM pops a request and may skip it (no KV room) in the same pass: its tenant pays
    for the prompt once, when it is admitted and runs."""
    rt = runtime(fairness="tenants", fair_hit_weight=1)
    request = req("a")
    rt.enter_waiting(request)
    rt.begin_pass([])
    assert rt.decide().decision is Decision.ADD
    rt.admit(request)
    assert rt.queue.share.service("default") == len(request.keys)
    rt.hold("a")  # skipped
    rt.end_pass(1, [])
    assert rt.queue.share.service("default") == 0
    rt.enter_waiting(request)
    rt.begin_pass([])
    assert [r.rid for r in admit_all(rt, [])] == ["a"]
    assert rt.queue.share.service("default") == len(request.keys)


def test_without_a_tenant_in_the_view_or_without_fair_share_nothing_is_charged() -> None:
    rt = runtime(fairness="tenants", fair_hit_weight=0)
    rt.enter_waiting(req("a"))
    rt.served("a", 100, 1)
    assert rt.queue.tenant("a") == "default" and rt.queue.share.service("default") == 102
    plain = runtime()
    plain.enter_waiting(req("a"))
    plain.served("a", 100, 1)  # a no-op
    assert plain.queue.share is None


def fair_runtime(**options) -> FeatherRuntime:
    config = FeatherConfig.from_sources({"gate": "always", "max_wait_s": None,
                                         "fairness": "tenants", "fair_hit_weight": 0,
                                         **options}, environ={})
    return FeatherRuntime(config, TenantView(), clock=lambda: 0.0)


def test_under_fair_share_the_most_served_tenant_is_preempted_first() -> None:
    """Each tenant's requests in Feather's order, the tenants by their counters as the
    pass began, the most served last: its newest member of its youngest group is the
    victim, though the other tenant's singleton is younger; the batch still lays each
    group out in one run."""
    rt = fair_runtime()
    flood = [TenantReq(f"f{i}", [(0,), (0, i)], arrival=float(i), tenant="flood")
             for i in range(3)]
    shared = TenantReq("shared", [(0,), (0, "o")], arrival=4.0, tenant="other")
    solo = TenantReq("solo", [(1,), (1, "s")], arrival=5.0, tenant="other")
    running = [*flood, solo, shared]
    for request in running:
        rt.enter_waiting(request)
    rt.begin_pass([])
    admit_all(rt, [])
    rt.served("f0", 100, 0)
    ordered = rt.begin_pass(running)
    assert [r.rid for r in ordered] == ["shared", "solo", "f0", "f1", "f2"]
    assert rt.preemption_victim(ordered) is flood[2]
    assert [r.rid for r in rt.batch_order(ordered)] == ["shared", "f0", "f1", "f2", "solo"]
    rt.served("solo", 200, 0)  # other is now the most served: re-sorted at the next pass
    assert [r.rid for r in rt.begin_pass(ordered)] == ["f0", "f1", "f2", "shared", "solo"]
    assert rt.preemption_victim(ordered) is solo
    unordered = fair_runtime(order_running=False)  # the engine's rule: the latest arrival
    for request in running:
        unordered.enter_waiting(request)
    assert unordered.begin_pass(running) == running
    assert unordered.preemption_victim(running) is solo


def test_vtc_keeps_the_engines_order_and_charges_each_admission_its_whole_prompt() -> None:
    """VTC's victim is vLLM FCFS's, the latest admitted (the end of the engine's list);
    a preempted request pays its prompt again when readmitted, as VTC charges."""
    rt = fair_runtime(fairness="vtc")
    requests = [TenantReq(f"r{i}", [(0,), (0, i)], arrival=float(i), tenant="t")
                for i in range(3)]
    for request in requests:
        rt.enter_waiting(request)
    rt.begin_pass([])
    running = admit_all(rt, [])
    assert rt.queue.share.service("t") == 3 * 2
    engine_order = [running[2], running[0], running[1]]
    assert rt.begin_pass(engine_order) == engine_order
    assert rt.order(engine_order) == engine_order == rt.batch_order(engine_order)
    assert rt.preemption_victim(engine_order) is running[1]
    rt.enter_waiting(running[1])  # preempted
    rt.begin_pass(engine_order[:2])
    assert admit_all(rt, engine_order[:2]) == [running[1]]
    assert rt.queue.share.service("t") == 4 * 2


def test_with_one_tenant_fair_share_keeps_feathers_order() -> None:
    plain, fair = runtime(), fair_runtime()
    requests = [TenantReq(f"r{i}", [(i % 3,), (i % 3, i)], arrival=float(7 * i % 5),
                          priority=i % 2)
                for i in range(9)]
    for rt in (plain, fair):
        for request in requests:
            rt.enter_waiting(request)
        rt.begin_pass([])
        admit_all(rt, [])
        rt.served("r0", 50, 1)
    assert fair.begin_pass(requests) == plain.begin_pass(requests)
    assert fair.batch_order(requests) == plain.batch_order(requests)


def urgent_waits_behind(running: list[Req]) -> tuple[FeatherRuntime, Req]:
    """A runtime (``max_urgent_preemptions`` 1 by default) that runs ``running``, admitted
    in one pass, when a class-0 request of a group of its own arrives: (it, the request)."""
    rt = runtime()
    for request in running:
        rt.enter_waiting(request)
    rt.begin_pass([])
    admit_all(rt, [])
    waiting = Req("urgent", req("urgent", 9).keys, arrival=9.0, priority=0)
    rt.enter_waiting(waiting)
    return rt, waiting


class Frees:
    """A fake engine ``Room``: a set of victims makes room when what they free (each
    ``frees[rid]``, default 1) reaches ``needed``; one seat is ``Frees()``.  Records the
    sets it was asked about (``tried``)."""

    def __init__(self, needed: int = 1, frees: dict[str, int] | None = None) -> None:
        self.needed, self.frees = needed, frees or {}
        self.tried: list[list[str]] = []

    def made_by(self, victims: Sequence[Req]) -> bool:
        self.tried.append([v.rid for v in victims])
        return sum(self.frees.get(v.rid, 1) for v in victims) >= self.needed


def victims(rt: FeatherRuntime, running: list[Req], waiting: Req, room: Frees | None = None
            ) -> list[str]:
    return [v.rid for v in rt.urgent_victims(running, waiting, room or Frees())]


def test_the_urgent_victim_is_the_least_urgent_end_of_the_order_and_pays_once() -> None:
    low_old = Req("low-old", req("low-old", 1).keys, arrival=0.0, priority=1)
    low_new = Req("low-new", req("low-new", 2).keys, arrival=1.0, priority=1)
    urgent_running = Req("urgent-running", req("u", 3).keys, arrival=2.0, priority=0)
    running = [low_old, low_new, urgent_running]
    rt, waiting = urgent_waits_behind(running)
    assert victims(rt, running, waiting) == ["low-new"]  # the end of Feather's order
    assert victims(rt, running, waiting) == ["low-old"]  # low-new was preempted so once
    assert victims(rt, running, waiting) == []  # same class is never a victim
    same = Req("same", req("same", 5).keys, arrival=4.0, priority=1)
    assert victims(rt, running, same) == []
    assert victims(runtime(max_urgent_preemptions=0), running, waiting) == []


def test_the_urgent_bound_is_max_urgent_preemptions_per_request() -> None:
    """With ``max_urgent_preemptions`` 2, a request gives way twice, then never again; a
    set that makes room only with one at its bound is not named."""
    low = Req("low", req("low", 1).keys, arrival=0.0, priority=1)
    other = Req("other", req("other", 2).keys, arrival=1.0, priority=1)
    rt = runtime(max_urgent_preemptions=2)
    for request in (low, other):
        rt.enter_waiting(request)
    rt.begin_pass([])
    admit_all(rt, [])
    urgent = Req("urgent", req("urgent", 9).keys, arrival=9.0, priority=0)
    rt.enter_waiting(urgent)
    both = Frees(needed=2)
    assert victims(rt, [low, other], urgent, both) == ["other", "low"]
    assert victims(rt, [low, other], urgent, both) == ["other", "low"]
    assert victims(rt, [low, other], urgent, both) == []  # each at its bound
    assert len(both.tried) == 6  # the room was not asked the third time: nobody may go


def test_the_urgent_bound_holds_across_a_rebuild_and_a_grown_prompt() -> None:
    """A request keeps its urgent preemptions when Feather's picture is rebuilt after a
    fault (``resync``) and when it is re-keyed for a grown prompt (``_refresh``)."""
    rt = runtime()
    low = Req("low", req("low", 1).keys, arrival=0.0, priority=1)
    rt.enter_waiting(low)
    rt.begin_pass([])
    admit_all(rt, [])
    urgent = Req("urgent", req("urgent", 2).keys, arrival=1.0, priority=0)
    rt.enter_waiting(urgent)
    assert victims(rt, [low], urgent) == ["low"]
    rt.resync([low], [urgent])
    assert victims(rt, [low], urgent) == []
    grown = Req("low", [*low.keys, ("more",)], arrival=0.0, priority=1)
    rt.reconcile([grown], [urgent])
    assert victims(rt, [grown], urgent) == []


def test_urgent_victims_are_the_fewest_in_feathers_order_that_make_room() -> None:
    """The engine's ``Room`` says which sets make room: here the KV each frees (the two
    youngest little, a prefix held by a request that stays; the oldest much). The run of
    Feather's order that makes room is all three; the two it does without stay, and the
    one that goes pays its bound, after which nothing makes room and nobody goes."""
    running = [Req(rid, req(rid, i).keys, arrival=float(i), priority=1)
               for i, rid in enumerate(("old", "mid", "young"))]
    rt, waiting = urgent_waits_behind(running)
    room = Frees(needed=5, frees={"old": 5, "mid": 1, "young": 1})
    assert victims(rt, running, waiting, room) == ["old"]
    assert room.tried == [["young"], ["young", "mid"], ["young", "mid", "old"],
                          ["young", "old"], ["old"]]
    assert victims(rt, running, waiting, room) == []
    assert victims(rt, running, waiting) == ["young"]  # one seat: the end
    assert victims(runtime(max_urgent_preemptions=0), running, waiting) == []


def test_under_fair_share_the_share_decides_who_takes_a_seat_urgency_freed() -> None:
    """Four seats, tenants x and y each running two class-1 requests (their seat share)
    and each with a class-0 request waiting; y's is the candidate (x is the more
    served). The victim is x's (the most served tenant's, the end of the order), which
    takes x below its share while y stays at its own: the share gives the freed seat to
    x's urgent request, not to y's the preemption was asked for."""
    rt = fair_runtime(fair_quantum_tokens=0)
    rt.queue.seats = 4
    low = [TenantReq(f"{t}{i}", [(t, i)], arrival=float(i), priority=1, tenant=t)
           for t in "xy" for i in range(2)]
    for request in low:
        rt.enter_waiting(request)
    rt.begin_pass([])
    running = admit_all(rt, [])
    urgent = {t: TenantReq(f"{t}-urgent", [(t, "u")], arrival=9.0, priority=0, tenant=t)
              for t in "xy"}
    for request in urgent.values():
        rt.enter_waiting(request)
    rt.served("x0", 100, 0)
    running = rt.begin_pass(running)
    assert rt.candidate() is urgent["y"] and rt.decide().decision is Decision.ADD
    victims = rt.urgent_victims(running, urgent["y"], Frees())
    assert [v.tenant for v in victims] == ["x"]
    for victim in victims:  # the engine preempts them: back to waiting
        running.remove(victim)
        rt.preempted(victim, urgent=True)
        rt.enter_waiting(victim)
    rt.promise(urgent["y"])
    answer = rt.decide()
    assert answer.request_id == "x-urgent" and answer.decision is Decision.ADD
    rt.admit(urgent["x"])
    assert rt.queue.share.running("x") == rt.queue.share.running("y") == 2
