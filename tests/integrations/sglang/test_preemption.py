"""``sglang/preemption.py``: SGLang's budget arithmetic (``Room``) and release, replayed, on
the real ``PrefillAdder``, ``ScheduleBatch``, ``ReqToTokenPool`` and ``RadixCache`` of
``test_scheduler``'s engine; and urgent preemption off, with one warning, on a SGLang
without one of the private members it reads."""

from __future__ import annotations

import logging
from array import array

import pytest

from feather_sched.bench.cht.sglang_policy import sglang_installed

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams

from feather_sched.integrations.sglang import preemption
from tests.integrations.sglang.test_scheduler import (
    PREEMPTION_THRESHOLD,
    _req,
    _running_a0_b0_a1,
    _server_args,  # noqa: F401 (the autouse fixture SGLang's objects need)
)


def _adder(engine):
    adder = engine.adder_class(1, engine.tree_cache, engine.allocator, engine.batch, 0.5,
                               1 << 16, None,
                               priority_scheduling_preemption_threshold=PREEMPTION_THRESHOLD)
    return adder


def test_the_room_is_sglangs_budget_arithmetic() -> None:
    """256 tokens, three running requests of 72 prompt tokens and 8 outputs: an urgent
    request of 72 does not fit as things stand, fits once any one is released (its KV
    and its output reserve back), and a seat needs a victim; one of 1,000 tokens does
    not fit even with all three released."""
    engine = _running_a0_b0_a1(pool_tokens=256)
    adder = _adder(engine)
    urgent = _req("C", 0, priority=20)
    urgent.init_next_round_input(engine.tree_cache)
    running = engine.batch.reqs
    room = preemption.Room(adder, urgent, seat=False)
    assert not room.made_by(())
    assert all(room.made_by([req]) for req in running)
    assert not preemption.Room(adder, urgent, seat=True).made_by(())
    huge = Req("huge", "", array("q", range(9000, 10000)), SamplingParams(max_new_tokens=8),
               priority=20)
    huge.init_next_round_input(engine.tree_cache)
    assert not preemption.Room(adder, huge, seat=False).made_by(running)


def test_preempt_releases_the_whole_set_as_sglang_does() -> None:
    """Two victims released at once: out of the running batch, their KV and output
    reserve back in the budget, in ``preempt_list`` for SGLang to re-queue."""
    engine = _running_a0_b0_a1(pool_tokens=256)
    adder = _adder(engine)
    before = adder.rem_total_tokens
    a0, b0, a1 = engine.batch.reqs
    preemption.preempt(adder, [b0, a1])
    assert engine.batch.reqs == [a0] and adder.preempt_list == [b0, a1]
    assert not b0.kv.holds_kv and not a1.kv.holds_kv and a0.kv.holds_kv
    assert adder.rem_total_tokens >= before + 2 * 72


def test_a_sglang_without_a_private_member_leaves_urgent_preemption_off(monkeypatch,
                                                                        caplog) -> None:
    """``PRIVATE`` names a member this SGLang lacks: one warning for the adder class, and
    an urgent request short of a seat, or of KV room, preempts nobody; nothing raises."""
    monkeypatch.setattr(preemption, "PRIVATE", (*preemption.PRIVATE, "_gone_in_this_release"))
    monkeypatch.setattr(preemption, "_USABLE", {})
    engine = _running_a0_b0_a1(pool_tokens=256)
    engine.arrive(_req("C", 0, priority=20))
    # a logger of the test's own: an engine's logging set-up may have disabled Feather's
    monkeypatch.setattr(preemption, "logger", logging.getLogger("tests.sglang_preemption"))
    assert engine.admission_round(seats=3) == []
    assert engine.admission_round() == []
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "urgent preemption" in r.getMessage()]
    assert len(warned) == 1 and "_gone_in_this_release" in warned[0]
    assert {r.rid for r in engine.running} == {"A0", "B0", "A1"}
    assert engine.feather.runtime.meter.stats.preemptions == 0
