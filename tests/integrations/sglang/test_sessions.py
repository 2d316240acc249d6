"""Agent sessions in SGLang 0.5.23, on its real ``RadixCache``, ``ReqToTokenPool``, KV
allocator, ``ScheduleBatch`` and ``Req``: turns are admitted by Feather's adder, prefilled
by SGLang's ``prepare_for_extend`` and finished by SGLang's own ``release_kv_cache`` (which
caches them in the tree), as the scheduler's result processing does."""

from __future__ import annotations

import time
from array import array
from dataclasses import replace

import pytest

from feather_sched.bench.cht.sglang_policy import published_server_args, sglang_installed

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams

from feather_sched.integrations.sglang import scheduler as feather_sglang
from tests.integrations.sglang.test_scheduler import CHUNK, Engine, installed

POOL = 1024
"""KV tokens of the pool (SGLang's ``max_total_num_tokens``)."""
TURN = 4 * CHUNK
"""Tokens each turn adds to its session's context."""


@pytest.fixture(autouse=True)
def _server_args():
    with published_server_args():  # what SGLang's request and cache code reads
        yield


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _engine(sessions: bool = True, share: float = 0.5, pool: int = POOL,
            **options) -> Engine:
    engine = Engine(kv=True, pool_tokens=pool, options=dict(
        options, sessions=sessions, session_held_share=share))
    engine.clock = Clock()
    engine.feather.start_sessions(engine.tree_cache, pool)
    if engine.feather.sessions is not None:
        engine.feather.sessions.clock = engine.clock
        engine.feather.sessions.cost.per_token_s = 1.0  # breakeven past every TTL here
    return engine


def _context(name: int, turns: int) -> list[int]:
    """Session ``name``'s context after ``turns`` turns (each turn: prompt then output)."""
    return [name * 100_000 + t for t in range(turns * TURN)]


def _turn(rid: str, tokens: list[int], **params) -> Req:
    req = Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=8,
                                                          custom_params=params or None))
    return req


def _run_turn(engine: Engine, req: Req, output: list[int], reason=None) -> None:
    """``req`` arrives, is admitted and prefilled, emits ``output`` and finishes: SGLang
    releases its KV into the tree (``release_kv_cache``, checkpointed unless aborted)."""
    engine.arrive(req)
    assert req in engine.admission_round()
    _finish(engine, req, output, reason)


def _finish(engine: Engine, req: Req, output: list[int], reason=None) -> None:
    req.output_ids.extend(output)
    req.finished_reason = reason or FINISH_LENGTH(length=len(output))
    release_kv_cache(req, engine.tree_cache, checkpoint=not isinstance(reason, FINISH_ABORT))
    engine.batch.filter_batch(reqs_to_exclude=[req])
    engine.running = list(engine.batch.reqs)


GAP_S = 10.0
"""Seconds between a session's turns (the TTL its holds get: the rule's gap quantile)."""


def _session_turns(engine: Engine, names: int | tuple[int, ...], turns: int,
                   **params) -> None:
    """The sessions' first ``turns`` turns, ``GAP_S`` apart (the sessions' turns at once);
    a turn's output is the tail of its next turn's prompt."""
    for turn in range(1, turns + 1):
        if turn > 1:
            engine.clock.now += GAP_S
        for name in names if isinstance(names, tuple) else (names,):
            context = _context(name, turn)
            _run_turn(engine, _turn(f"s{name}t{turn}", context[: -TURN // 2], **params),
                      context[-TURN // 2:])


def _cached(engine: Engine, tokens: list[int], **key) -> int:
    match = engine.tree_cache.match_prefix(MatchPrefixParams(key=RadixKey(
        array("q", tokens), cache_salt=key.get("cache_salt"))))
    return match.device_prefix_len


def _pressure(engine: Engine) -> None:
    """Evict everything evictable (as SGLang's allocator does when it lacks room)."""
    engine.tree_cache.evict(EvictParams(num_tokens=POOL))


def test_a_held_turn_survives_eviction_and_its_next_turn_matches_it() -> None:
    for sessions in (False, True):
        engine = _engine(sessions)
        _session_turns(engine, 1, 2)  # the first return makes the session expected to go on
        held = _context(1, 2)[: -TURN // 2]  # its prompt: the KV SGLang committed
        _pressure(engine)
        cached = _cached(engine, held)
        if not sessions:
            assert cached == 0
            continue
        feather = engine.feather.sessions
        assert cached == len(held) and feather.sessions.counts.held == 1
        assert feather.sessions.held_blocks == len(held)
        nxt = _turn("s1t3", _context(1, 3)[: -TURN // 2])
        engine.arrive(nxt)
        assert nxt.rid in feather.warm
        assert engine.feather.requests.priority(nxt) == 0
        assert nxt in engine.admission_round()
        assert nxt.prefix_len == len(held)  # SGLang matched the held prefix
        assert not feather.pins and feather.sessions.counts.reloads_avoided == 1
        assert engine.tree_cache.protected_size() == nxt.prefix_len


def test_holds_never_exceed_the_share_of_the_pool() -> None:
    engine = _engine(share=0.25)  # 256 tokens: one session's 2-turn context (128) fits
    _session_turns(engine, (1, 2, 3), 2)
    feather = engine.feather.sessions
    assert feather.sessions.held_blocks <= POOL // 4
    assert feather.sessions.counts.held == 2 and feather.sessions.counts.refused == 1
    assert engine.tree_cache.protected_size() == feather.sessions.held_blocks


def test_a_hold_expires_at_its_ttl() -> None:
    engine = _engine()
    _session_turns(engine, 1, 2)
    feather = engine.feather.sessions
    assert feather.pins
    engine.clock.now += 3600
    engine.admission_round()
    assert not feather.pins and engine.tree_cache.protected_size() == 0
    assert feather.sessions.counts.expired == 1


def test_a_decode_step_short_of_room_takes_a_hold_before_sglang_retracts(monkeypatch) -> None:
    engine = _engine(pool=3 * TURN)
    _session_turns(engine, 1, 2)  # holds its second prompt: 96 of the pool's 192 tokens
    running = _turn("r", _context(9, 1)[: TURN // 2])
    engine.arrive(running)
    assert running in engine.admission_round() and engine.feather.sessions.pins
    engine.allocator.alloc(engine.allocator.available_size())  # the pool is full
    assert not engine.batch.check_decode_mem()  # SGLang alone would retract ``r``
    monkeypatch.setattr(feather_sglang, "_process_feather", engine.feather)
    assert feather_sglang._hook_check_decode_mem(ScheduleBatch.check_decode_mem, engine.batch)
    assert not engine.feather.sessions.pins
    assert engine.feather.sessions.sessions.counts.reclaimed == 1


def test_a_request_alone_without_room_takes_the_holds_room() -> None:
    engine = _engine(pool=3 * TURN, max_wait_s=None)  # the held prompt leaves 96 tokens
    _session_turns(engine, 1, 2)
    assert engine.feather.sessions.pins
    big = _turn("big", _context(9, 2)[: 2 * TURN - 8])
    engine.arrive(big)
    assert big in engine.admission_round()
    assert not engine.feather.sessions.pins
    assert engine.feather.sessions.sessions.counts.reclaimed == 1


def test_a_cache_flush_and_feather_off_release_every_hold() -> None:
    engine = _engine()
    _session_turns(engine, 1, 2)
    engine.tree_cache.reset()  # Scheduler.flush_cache
    assert not engine.feather.sessions.pins and engine.tree_cache.protected_size() == 0
    _session_turns(engine, 2, 2)
    assert engine.feather.sessions.pins
    engine.feather.faults.active = False
    engine.feather.begin_round([], [])
    assert engine.feather.sessions is None and engine.feather.requests.warm is None
    assert engine.tree_cache.protected_size() == 0
    assert "on_release" not in vars(engine.tree_cache)


def test_an_aborted_turn_is_never_held() -> None:
    engine = _engine()
    _session_turns(engine, 1, 1)
    second = _context(1, 2)
    _run_turn(engine, _turn("s1t2", second[: -TURN // 2]), second[-TURN // 2:],
              reason=FINISH_ABORT("client gone"))
    engine.clock.now += 1
    third = _context(1, 3)
    _run_turn(engine, _turn("s1t3", third[: -TURN // 2]), third[-TURN // 2:],
              reason=FINISH_ABORT("client gone"))
    assert not engine.feather.sessions.pins
    assert engine.feather.sessions.sessions.counts.held == 0


def test_a_warm_turn_aborted_while_waiting_lets_its_hold_go() -> None:
    """SGLang pops an aborted waiting request and drops its cache-side state
    (``Scheduler._release_aborted_request``, through Feather's hook): the hold its arrival
    found, which would not lapse at its TTL (its turn came), is released, and the turn is
    no longer warm or known to its session."""
    engine = _engine()
    _session_turns(engine, 1, 2)  # the first return makes the session expected to go on
    feather = engine.feather.sessions
    assert feather.pins and engine.tree_cache.protected_size() > 0
    engine.clock.now += GAP_S
    nxt = _turn("s1t3", _context(1, 3)[: -TURN // 2])
    engine.arrive(nxt)
    assert nxt.rid in feather.warm
    engine.scheduler.waiting_queue.remove(nxt)
    feather_sglang._hook_release_aborted_request(Scheduler._release_aborted_request,
                                                 engine.scheduler, nxt)
    assert nxt.rid not in feather.warm and feather.sessions.session_of(nxt.rid) is None
    assert not feather.pins and engine.tree_cache.protected_size() == 0
    engine.clock.now += 10 * GAP_S
    engine.feather.begin_round([], [])  # the rule has nothing left to expire or release
    assert not feather.sessions.holds


@pytest.mark.parametrize("params", [{"tenant": "other"}, {}])
def test_a_session_continues_only_in_its_tenant_and_cache_salt(params) -> None:
    engine = _engine()
    _session_turns(engine, 1, 2, tenant="t1")
    nxt = _turn("s1t3", _context(1, 3)[: -TURN // 2], **params)
    engine.arrive(nxt)
    feather = engine.feather.sessions
    assert nxt.rid not in feather.warm and feather.sessions.counts.continued == 1
    salted = _turn("salted", _context(1, 3)[: -TURN // 2], tenant="t1")
    salted.cache_salt = "other"
    engine.arrive(salted)
    assert salted.rid not in feather.warm and feather.sessions.counts.continued == 1


def test_sessions_off_change_nothing() -> None:
    engine = _engine(sessions=False)
    assert engine.feather.sessions is None and "on_release" not in vars(engine.tree_cache)
    _session_turns(engine, 1, 3)
    assert engine.tree_cache.protected_size() == 0
    assert engine.feather.requests.priority(_turn("x", [1, 2, 3])) == 0


def test_a_disabled_radix_cache_runs_without_sessions(caplog) -> None:
    engine = _engine(sessions=False)
    engine.feather.config = replace(engine.feather.config, sessions=True)
    engine.feather.start_sessions(RadixCache.create_simulated(disable=True), POOL)
    assert engine.feather.sessions is None
    assert "radix cache is disabled" in caplog.text


def test_a_fault_in_sessions_never_reaches_sglang(monkeypatch, contained_faults) -> None:
    engine = _engine()
    feather = engine.feather.sessions

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    for name in ("arrived", "admitted", "ended", "expire", "publish"):
        monkeypatch.setattr(feather, name, broken)
    monkeypatch.setattr(feather.sessions, "reclaim", broken)
    _session_turns(engine, 1, 2)  # every call inside SGLang's path contained
    assert {where for where, _ in contained_faults} == {"sessions"}
    assert not engine.feather.holds_yield(None, alone=False)


def test_sessions_that_fail_to_start_or_to_let_go_never_reach_sglang(monkeypatch,
                                                                      caplog) -> None:
    engine = _engine(sessions=False)
    engine.feather.config = replace(engine.feather.config, sessions=True)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    with monkeypatch.context() as patched:
        patched.setattr(feather_sglang, "SGLangSessions", broken)
        engine.feather.start_sessions(engine.tree_cache, POOL)  # the scheduler's start
    assert engine.feather.sessions is None and "failed to start" in caplog.text
    engine = _engine()
    _session_turns(engine, 1, 2)
    monkeypatch.setattr(engine.feather.sessions, "release_all", broken)
    engine.feather.faults.active = False
    engine.feather.begin_round([], [])  # Feather off: the holds' release fails, contained
    assert engine.feather.sessions is None and "releasing the holds failed" in caplog.text


@pytest.mark.parametrize("low_first", [False, True])
def test_warm_turns_go_first_within_sglangs_own_priority_classes(low_first) -> None:
    from feather_sched.integrations.sglang.scheduler import SGLangRequests

    view = SGLangRequests(CHUNK, priority_scheduling=True, low_priority_values_first=low_first)
    reqs = {(value, warm): Req(f"{value}{warm}", "", array("q", [1]),
                               SamplingParams(max_new_tokens=1), priority=value)
            for value in (-3, 0, 5) for warm in (True, False)}
    unsplit = sorted(reqs, key=lambda k: view.priority(reqs[k]))
    view.warm = {req.rid for (value, warm), req in reqs.items() if warm}
    split = sorted(reqs, key=lambda k: view.priority(reqs[k]))
    assert [value for value, _ in split] == [value for value, _ in unsplit]
    assert [warm for _, warm in split] == [True, False] * 3
    assert all(view.engine_class(req) == view.priority(req) // 2 for req in reqs.values())


def test_the_scheduler_hook_starts_sessions_over_sglangs_tree_when_asked(monkeypatch) -> None:
    scheduler = installed(monkeypatch, '{"sessions": true, "session_held_share": 0.3}')
    sessions = scheduler.feather.sessions
    assert sessions.tree_cache is scheduler.tree_cache
    assert sessions.sessions.bound_blocks == int(0.3 * 4096)  # max_total_num_tokens, pages of 1
    assert scheduler.feather.requests.warm is sessions.warm
    assert "on_release" in vars(scheduler.tree_cache)


@pytest.mark.parametrize("max_wait_s", [None, 1e-6])
def test_warm_turns_overtake_a_newcomer_only_within_max_wait_s(max_wait_s) -> None:
    engine = _engine(max_wait_s=max_wait_s)
    _session_turns(engine, 1, 2)
    newcomer = _turn("new", _context(7, 1))
    engine.arrive(newcomer)
    time.sleep(0.01)  # the newcomer waits past max_wait_s (Feather's own clock)
    warm = _turn("s1t3", _context(1, 3)[: -TURN // 2])
    engine.arrive(warm)
    assert warm.rid in engine.feather.sessions.warm
    first = engine.admission_round(max_requests=1)
    assert first == ([warm] if max_wait_s is None else [newcomer])
    assert engine.feather.requests.arrivals == {}
