"""``PassLedger``: a pass's admissions counted once, charged and refunded under fair share,
settled at the pass's end and bound to their step until its reward."""

from __future__ import annotations

import pytest

from feather_sched.core import ledger as ledger_module
from feather_sched.core.config import FeatherConfig
from feather_sched.core.ledger import PassLedger
from feather_sched.core.queue import Admission
from feather_sched.gates.base import Decision, GateContext


def make_ledger(**options) -> PassLedger:
    config = FeatherConfig.from_sources({"gate": "always", "max_wait_s": None, **options},
                                        environ={})
    queue = config.make_queue(clock=lambda: 0.0)
    for rid, tenant in (("a", "t1"), ("b", "t2")):
        queue.add(rid, [(rid,)], 0.0, 100, 0, tenant)
    return PassLedger(queue)


CONTEXT = GateContext(batch_size=1, chunk_loss=0, sharing_waiters=0, num_waiting=1)


def add(rid: str, context: GateContext | None = CONTEXT, forced: bool = False) -> Admission:
    return Admission(rid, Decision.ADD, forced, context)


def test_an_answer_is_counted_once_however_often_it_is_asked() -> None:
    ledger = make_ledger()
    first = add("a")
    ledger.take(first)
    ledger.take(first)  # the cached answer again
    ledger.take(add("a"))  # a fresh one
    assert ledger.counts.asked == 2 and len(ledger.taken) == 2


def test_admit_needs_the_last_answer_to_be_an_add_of_that_request() -> None:
    ledger = make_ledger()
    with pytest.raises(RuntimeError, match="without an ADD"):
        ledger.last_add("a")
    ledger.take(Admission("a", Decision.STOP, False, CONTEXT))
    with pytest.raises(RuntimeError):
        ledger.last_add("a")
    ledger.take(add("a"))
    with pytest.raises(RuntimeError):
        ledger.last_add("b")
    ledger.admitted(ledger.last_add("a"), 100)
    with pytest.raises(RuntimeError):
        ledger.last_add("a")  # admitted already


def test_fair_share_charges_an_admission_and_refunds_it_when_void() -> None:
    ledger = make_ledger(fairness="tenants", fair_quantum_tokens=0)
    share = ledger.queue.share
    ledger.take(add("a"))
    ledger.admitted(ledger.last_add("a"), 100)
    charged = share.service("t1")
    assert charged > 0 and share.service("t2") == 0
    ledger.void("b")  # not admitted: nothing changes
    assert share.service("t1") == charged and ledger.taken[0].admitted
    ledger.void("a")
    assert share.service("t1") < charged and not ledger.taken[0].admitted


def test_settle_counts_adds_that_run_and_the_gates_stops() -> None:
    ledger = make_ledger()
    answers = [add("a"), Admission("b", Decision.STOP, False, CONTEXT),
               Admission("b", Decision.STOP, False, None), add("b", None, forced=True)]
    for answer in answers:
        ledger.take(answer)
        if answer.decision is Decision.ADD:
            ledger.admitted(ledger.last_add(answer.request_id), 100)
    settled = ledger.settle(lambda rid: rid == "b")  # a was skipped by the engine
    assert (settled.asked, settled.admitted, settled.stops, settled.forced) == \
        (4, ["b"], 1, 1)
    assert settled.credit == [(CONTEXT, Decision.STOP)]  # a forced ADD shows the gate none
    counts = ledger.counts
    assert (counts.add, counts.stop, counts.forced) == (0, 1, 1)


def test_decisions_wait_for_their_step_boundedly(monkeypatch) -> None:
    monkeypatch.setattr(ledger_module, "MAX_OPEN_STEPS", 2)
    monkeypatch.setattr(ledger_module, "MAX_STEP_DECISIONS", 3)
    ledger = make_ledger()
    credit = [(CONTEXT, Decision.ADD)] * 2
    for step in (1, 1, 2, 3):
        ledger.take(add("a"))
        ledger.close(step, credit)
        assert ledger.taken == []
    assert ledger.bound(1) == []  # the oldest open step dropped, unrewarded
    assert len(ledger.bound(2)) == 2 and ledger.reward(3) == credit
    assert ledger.reward(3) is None
    ledger.close(4, credit * 3)
    assert len(ledger.reward(4)) == 3
