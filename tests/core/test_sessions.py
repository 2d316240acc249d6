"""core.sessions: recognition by prefix match and by key within a namespace, the hold
rule and its TTL, the bound on held blocks, and the three ways a hold ends."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_sched.core.sessions import (
    CUT_SHORT,
    PRIOR_S_PER_TOKEN,
    TOOL_CALLS,
    ReloadCost,
    RetentionConfig,
    Sessions,
    quantiles,
)

POOL = 1000


def table(share: float = 0.5, reload_per_token: float = 1e-3, **config) -> Sessions:
    return Sessions(RetentionConfig(max_held_share=share, **config), POOL,
                    lambda tokens: tokens * reload_per_token)


def keys(*names: str) -> list[str]:
    """Chained keys: key i names the prefix through block i."""
    return ["/".join(names[:i + 1]) for i in range(len(names))]


def test_a_request_extending_a_finished_turn_continues_its_session():
    sessions = table()
    assert not sessions.arrived("t0", "ns", keys("sys", "task"), 0.0)
    hold, _ = sessions.turn_ended("t0", keys("sys", "task", "out"), 30, 480, 1.0, TOOL_CALLS)
    assert hold is not None and hold.holder == "t0"
    assert sessions.arrived("t1", "ns", keys("sys", "task", "out", "tool"), 2.0)
    assert sessions.session_of("t1").id == hold.session
    assert sessions.counts.continued == 1 and sessions.counts.reloads_avoided == 1


def test_another_namespace_or_a_mere_shared_system_block_is_a_new_session():
    sessions = table()
    sessions.arrived("a0", "tenant-a", keys("sys", "task"), 0.0)
    sessions.turn_ended("a0", keys("sys", "task", "out"), 30, 480, 1.0, TOOL_CALLS)
    assert not sessions.arrived("b1", "tenant-b", keys("sys", "task", "out", "x"), 2.0)
    assert not sessions.arrived("a9", "tenant-a", keys("sys", "other"), 2.0)
    first = sessions.holds[0].session
    assert sessions.session_of("b1").id != first and sessions.session_of("a9").id != first


def test_an_explicit_key_names_the_session_whatever_the_prompt():
    sessions = table()
    sessions.arrived("t0", "ns", keys("a"), 0.0, explicit="user-7")
    sessions.turn_ended("t0", keys("a", "b"), 10, 160, 1.0, TOOL_CALLS)
    assert sessions.arrived("t1", "ns", keys("zzz"), 1.5, explicit="user-7")
    assert not sessions.arrived("t2", "other", keys("zzz"), 1.5, explicit="user-7")


def test_ttl_is_the_gap_quantile_capped_by_breakeven_and_max_ttl():
    sessions = table(default_gap_s=4.0, max_ttl_s=60.0)
    sessions.arrived("t0", "ns", keys("a"), 0.0)
    session = sessions.session_of("t0")
    # 100 blocks over 1,000 tokens: reload 1 s, breakeven 1 s * 1000 / 100 = 10 s.
    assert sessions.ttl_s(session, 1000, 100) == 4.0
    session.gaps.extend([1.0, 2.0, 3.0, 8.0])
    assert sessions.ttl_s(session, 1000, 100) == 8.0  # the 0.9 quantile of its own gaps
    assert sessions.ttl_s(session, 1000, 400) == 2.5  # capped at breakeven: 1 s * 1000 / 400
    assert table(max_ttl_s=3.0).ttl_s(session, 1000, 100) == 3.0
    # under the median gap (2 s) a hold would most likely lapse unused: none
    assert sessions.ttl_s(session, 1000, 1000) is None
    assert table(max_ttl_s=0.5).ttl_s(session, 1000, 100) is None


def test_a_final_answer_is_not_held_but_a_returning_chat_is():
    sessions = table()
    sessions.arrived("t0", "ns", keys("a"), 0.0)
    hold, _ = sessions.turn_ended("t0", keys("a", "b"), 10, 160, 1.0, "stop")
    assert hold is None
    sessions.arrived("t1", "ns", keys("a", "b", "c"), 3.0)  # the user came back
    hold, _ = sessions.turn_ended("t1", keys("a", "b", "c", "d"), 10, 160, 4.0, "stop")
    assert hold is not None


def test_a_hold_lapses_at_expiry_and_goes_first_unless_its_turn_arrived():
    sessions = table(default_gap_s=2.0)
    for name in ("x", "y", "z"):
        sessions.arrived(f"{name}0", "ns", keys(name), 0.0)
        sessions.turn_ended(f"{name}0", keys(name, "o"), 10, 160, 1.0, TOOL_CALLS)
    assert sessions.arrived("y1", "ns", keys("y", "o", "t"), 2.5)
    assert len(sessions.holds) == 3  # lapsed holds stay while nothing needs their blocks
    gone = sessions.reclaim(100, 3.5, lapsed_only=True)
    assert sorted(h.holder for h in gone) == ["x0", "z0"]
    assert sessions.admitted("y1").holder == "y0"  # arrived: held until admitted
    assert sessions.holds == [] and sessions.counts.expired == 2
    assert sessions.counts.reclaimed == 0


def test_holds_sharing_blocks_count_them_once():
    sessions = table(share=0.1)  # 100 blocks at most
    for name in ("a", "b", "c"):  # 40 blocks each, 30 of them a shared system prompt
        sessions.arrived(f"{name}0", "ns", keys(name), 0.0)
        prompt = keys(*(["sys"] * 30 + [name] * 10))
        hold, displaced = sessions.turn_ended(f"{name}0", prompt, 40, 640, 1.0, TOOL_CALLS)
        assert hold is not None and not displaced
    assert sessions.held_blocks == 60
    sessions.arrived("d0", "ns", keys("d"), 1.0)
    hold, _ = sessions.turn_ended("d0", keys(*(["sys"] * 30 + ["d"] * 50)), 80, 1280, 1.0,
                                  TOOL_CALLS)
    assert hold is None and sessions.held_blocks == 60  # 50 more would pass the bound


def test_a_hold_beyond_the_bound_displaces_less_valuable_ones_or_is_refused():
    sessions = table(share=0.1, default_gap_s=5.0)  # 100 blocks at most
    sessions.arrived("a0", "ns", keys("a"), 0.0)
    sessions.turn_ended("a0", keys("a", "o"), 80, 1280, 0.0, TOOL_CALLS)
    sessions.arrived("b0", "ns", keys("b"), 0.0)
    hold, displaced = sessions.turn_ended("b0", keys("b", "o"), 60, 960, 4.0, TOOL_CALLS)
    assert hold is not None and [h.holder for h in displaced] == ["a0"]  # a0 nearly expired
    sessions.arrived("c0", "ns", keys("c"), 4.0)
    hold, displaced = sessions.turn_ended("c0", keys("c", "o"), 60, 480, 4.0, TOOL_CALLS)
    assert hold is None and not displaced and sessions.counts.refused == 1


def test_a_turn_cut_short_is_never_held():
    sessions = table()
    sessions.arrived("t0", "ns", keys("a"), 0.0)
    sessions.turn_ended("t0", keys("a", "b"), 10, 160, 1.0, "stop")
    sessions.arrived("t1", "ns", keys("a", "b", "c"), 3.0)  # came back: would be held
    for reason in CUT_SHORT:
        assert sessions.turn_ended("t1", keys("a", "b", "c", "d"), 10, 160, 4.0,
                                   reason) == (None, [])
        sessions.arrived("t1", "ns", keys("a", "b", "c", "d", "e"), 5.0)


def test_a_hold_no_turn_took_ends_with_its_sessions_next_turn():
    """A turn that ended without admission (aborted waiting) releases its session's hold."""
    sessions = table()
    sessions.arrived("t0", "ns", keys("a"), 0.0)
    held, _ = sessions.turn_ended("t0", keys("a", "b"), 10, 160, 1.0, TOOL_CALLS)
    assert sessions.arrived("t1", "ns", keys("a", "b", "c"), 2.0)
    hold, released = sessions.turn_ended("t1", [], 0, 0, 2.5, "abort")
    assert hold is None and released == [held] and sessions.holds == []
    assert sessions.held_blocks == 0 and sessions.counts.displaced == 1


def test_holds_named_by_engine_block_ids_count_each_block_once():
    """``held``: the engine's block ids, shared between two sessions' holds."""
    sessions = table()
    for name, ids in (("a", [1, 2, 3]), ("b", [1, 2, 4, 5])):
        sessions.arrived(f"{name}0", "ns", keys(name), 0.0)
        hold, _ = sessions.turn_ended(f"{name}0", keys(name, "o"), len(ids), 64, 1.0,
                                      TOOL_CALLS, held=ids)
        assert hold.keys == tuple(ids)
    assert sessions.held_blocks == 5


def test_reclaim_releases_least_valuable_first_until_enough():
    sessions = table(default_gap_s=10.0)
    for index, start in enumerate((0.0, 5.0, 9.0)):
        sessions.arrived(f"r{index}", "ns", keys(f"r{index}"), start)
        sessions.turn_ended(f"r{index}", keys(f"r{index}", "o"), 50, 800, start, TOOL_CALLS)
    gone = sessions.reclaim(60, 9.0)
    assert [h.holder for h in gone] == ["r0", "r1"]
    assert sessions.held_blocks == 50


def test_a_hold_yields_at_once_to_work_that_cannot_wait_and_to_a_request_past_its_bound():
    sessions = table(default_gap_s=10.0)
    for name in ("a", "b"):
        sessions.arrived(f"{name}0", "ns", keys(name), 0.0)
        sessions.turn_ended(f"{name}0", keys(name, "o"), 50, 800, 0.0, TOOL_CALLS)
    assert sessions.yield_for(30.0, 1.0) == []  # no bound: a newcomer waits
    assert sessions.yield_for(4.0, 1.0, max_wait_s=5.0) == []
    assert len(sessions.yield_for(5.0, 1.0, max_wait_s=5.0)) == 1
    assert len(sessions.yield_for(None, 1.0)) == 1 and sessions.holds == []
    assert sessions.yield_for(None, 1.0) == []


def test_a_hold_that_would_most_likely_lapse_before_its_turn_is_not_made():
    """Where a reload is cheap against the pool a hold takes (the break-even TTL under
    the median gap), holding would keep room from others for nothing."""
    cheap = table(reload_per_token=1e-6, default_gap_s=10.0)  # 800 tokens: 0.016 s TTL
    cheap.arrived("r0", "ns", keys("r"), 0.0)
    assert cheap.turn_ended("r0", keys("r", "o"), 50, 800, 0.0, TOOL_CALLS)[0] is None
    dear = table(default_gap_s=10.0)  # 800 tokens at 1 ms: a 16 s break-even
    dear.arrived("r0", "ns", keys("r"), 0.0)
    assert dear.turn_ended("r0", keys("r", "o"), 50, 800, 0.0, TOOL_CALLS)[0] is not None


def test_the_reload_cost_is_measured_per_token() -> None:
    cost = ReloadCost(min_tokens=10, weight=0.5)
    assert cost.seconds(10) == pytest.approx(10 * PRIOR_S_PER_TOKEN)  # before any step
    cost.observe(5, 1.0)  # too few tokens to say
    cost.observe(100, 1.0)
    cost.observe(100, 2.0)
    assert cost.seconds(10) == pytest.approx(10 * 0.015)


def test_config_is_checked():
    with pytest.raises(ValueError):
        RetentionConfig(max_held_share=1.5)
    with pytest.raises(ValueError):
        RetentionConfig(gap_quantile=0.0)
    with pytest.raises(ValueError):
        Sessions(RetentionConfig(), 0, lambda tokens: 0.0)
    assert quantiles([3.0, 1.0, 2.0], 0.5) == (2.0,)
    assert quantiles([4.0, 1.0, 3.0, 2.0], 0.9, 0.5, 0.0) == (4.0, 2.0, 1.0)


OPS = st.lists(st.tuples(
    st.sampled_from(["arrive", "end", "admit", "expire", "reclaim", "abort"]),
    st.integers(0, 11), st.integers(1, 400), st.floats(0.0, 5.0),
    st.sampled_from([TOOL_CALLS, "stop", None])), max_size=120)


@settings(max_examples=200, deadline=None)
@given(OPS, st.floats(0.0, 1.0))
def test_held_blocks_never_exceed_the_bound(ops, share):
    """Random sessions that return or never do, turns aborted mid-flight (never ended),
    pool pressure: the holds' blocks never exceed ``max_held_share`` of the pool, and
    every hold made is released once (lapsed, admission, reclaim or displacement) or
    still stands."""
    sessions = table(share=share, max_ttl_s=8.0, max_sessions=6)
    now, turn, live, depth, admitted = 0.0, 0, {}, {}, 0
    for op, program, blocks, dt, reason in ops:
        now += dt
        if op == "arrive":
            turn += 1
            live[f"p{program}-{turn}"] = program
            depth[program] = depth.get(program, 0) + 1
            prompt = keys(f"p{program}", *"x" * depth[program])
            sessions.arrived(f"p{program}-{turn}", program % 2, prompt, now)
        elif op in ("end", "abort") and live:
            request, owner = next(iter(live.items()))
            del live[request]
            depth[owner] += 1
            if op == "end":
                sessions.turn_ended(request, keys(f"p{owner}", *"x" * depth[owner]), blocks,
                                    blocks * 16, now, reason)
        elif op == "admit" and live:
            admitted += sessions.admitted(next(iter(live))) is not None
        elif op == "expire":
            sessions.reclaim(blocks, now, lapsed_only=True)
        elif op == "reclaim":
            sessions.reclaim(blocks, now)
        assert sessions.held_blocks <= sessions.bound_blocks
        assert len({h.holder for h in sessions.holds}) == len(sessions.holds)
    c = sessions.counts
    assert c.held == len(sessions.holds) + c.expired + c.reclaimed + c.displaced + admitted
