"""Agent sessions in vLLM's real scheduler and block pool (``integrations.vllm.sessions``),
driven as ``test_scheduler.py`` drives it: vLLM's own ``Scheduler``, ``KVCacheManager``
and ``BlockPool``, fabricated model outputs, Feather's clock in the test's hands.  Runs on
every vLLM release (no compiled op: ``test_releases_harness.py`` runs it on 0.33 and 0.34)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from prometheus_client import REGISTRY
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from feather_sched.core import sessions as sessions_rule
from feather_sched.core.sessions import ReloadCost
from feather_sched.integrations.vllm.sessions import VllmSessions, pool_of
from feather_sched.telemetry.prometheus import SessionSink
from tests.integrations.vllm.test_scheduler import BLOCK, Harness

OUTPUT_TOKEN = 7
"""The token ``Harness.fake_output`` samples."""


@pytest.fixture(autouse=True)
def _no_multiprocessing(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(autouse=True)
def _dear_reloads(monkeypatch):
    """Reloads priced as on a large model (the harness's fabricated steps are not
    measured): holds pay in these small pools, and the tests see them."""
    monkeypatch.setattr(sessions_rule, "PRIOR_S_PER_TOKEN", 1.0)
    monkeypatch.setattr(ReloadCost, "observe", lambda self, tokens, seconds: None)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Engine:
    """A ``Harness`` (vLLM's scheduler, Feather's by default) on a clock of its own, and
    what each request found in vLLM's prefix cache when first scheduled."""

    def __init__(self, sessions: bool = True, num_blocks: int = 64,
                 scheduler_cls: type | None = None, engine: dict | None = None,
                 **feather: object) -> None:
        self.clock = Clock()
        extra = dict(engine or {})
        if scheduler_cls is not None:
            extra["scheduler_cls"] = scheduler_cls
        self.h = Harness(num_blocks=num_blocks, clock=self.clock,
                         feather={"sessions": sessions, **feather}, **extra)
        self.scheduler = self.h.scheduler
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.hits: dict[str, int] = {}
        """Each request's ``num_computed_tokens`` when first scheduled (its cache hit)."""

    @property
    def sessions(self) -> VllmSessions | None:
        return getattr(getattr(self.scheduler, "feather", None), "sessions", None)

    def turn(self, rid: str, prompt: list[int], output: int = 4, **fields: object) -> Request:
        params = fields.pop("sampling_params", None) or SamplingParams(
            max_tokens=output, ignore_eos=True, temperature=0.0)
        return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                       pooling_params=None, arrival_time=self.clock.now,
                       block_hasher=self.h.hasher, **fields)

    def step(self) -> None:
        for new in self.h.step().scheduled_new_reqs:
            self.hits.setdefault(new.req_id, new.num_computed_tokens)

    def serve(self, *requests: Request, limit: int = 400) -> None:
        """Adds ``requests``, runs the engine until nothing is left."""
        self.h.add(*requests)
        while self.scheduler.has_requests():
            assert self.h.steps < limit, "the engine stalled"
            self.step()

    def refs(self) -> dict[int, int]:
        """Every block of the pool some reference holds: its id and count."""
        return {b.block_id: b.ref_cnt for b in self.pool.blocks if b.ref_cnt and not b.is_null}

    def held(self) -> set[int]:
        return {b.block_id for blocks in self.sessions.pins.values() for b in blocks}

    def filler(self, tag: str, blocks: int) -> None:
        """Unrelated requests that take ``blocks`` blocks of the pool, one after another:
        under vLLM's LRU they evict whatever nothing references."""
        for i in range(blocks // 3):  # 3 full blocks each (the partial 4th is reused first)
            self.serve(self.turn(f"{tag}{i}", [20_000 + 100 * i + 5_000 * len(tag) + t
                                               for t in range(4 * BLOCK - 2)], output=1))


def next_prompt(prompt: list[int], output: int, tool: list[int]) -> list[int]:
    """The next turn's prompt: this one's, its output (the fabricated tokens), a tool's."""
    return prompt + [OUTPUT_TOKEN] * output + tool


def session(engine: Engine, turns: int, first: int = 3 * BLOCK + 5, tag: str = "t",
            base: int = 1, **fields: object) -> list[Request]:
    """``turns`` turns of one session (its first prompt ``first`` tokens from ``base``),
    each served to its end 5 s after the last; from the second on a turn ends held (its
    session came back once)."""
    prompt, served = [base + t for t in range(first)], []
    for k in range(1, turns + 1):
        if k > 1:
            engine.clock.now += 5.0
            prompt = next_prompt(prompt, 4, [900 + 10 * k + t for t in range(BLOCK)])
        served.append(engine.turn(f"{tag}{k}", prompt, **fields))
        engine.serve(served[-1])
    return served


def pressed_third_turn(sessions: bool) -> tuple[Engine, Request, Request]:
    """Two turns, unrelated requests that cycle the whole pool, then the third turn."""
    engine = Engine(sessions)
    _, second = session(engine, 2)
    engine.filler("f", 96)
    engine.clock.now += 5.0
    prompt = next_prompt(list(second.prompt_token_ids), 4, [990 + t for t in range(BLOCK)])
    third = engine.turn("t3", prompt)
    engine.serve(third)
    return engine, second, third


def test_a_held_turn_survives_pool_pressure_and_its_next_turn_hits_it() -> None:
    engine, second, third = pressed_third_turn(sessions=True)
    cold, _, cold_third = pressed_third_turn(sessions=False)
    counts = engine.sessions.sessions.counts
    # turns 2 and 3 continue the session; turn 2 ends held (its session came back once),
    # turn 3 finds the hold (a reload avoided) and ends held too
    assert (counts.continued, counts.held, counts.reloads_avoided) == (2, 2, 1)
    # turn 2's prompt and output: 5 * 16 - 3 tokens, 4 full blocks, all found
    assert len(second.all_token_ids) // BLOCK == 4
    assert engine.hits["t3"] == 4 * BLOCK
    assert cold.hits[cold_third.request_id] == 0  # without sessions the filler evicted it
    assert cold.sessions is None
    (holder, blocks), = engine.sessions.pins.items()
    assert holder == "t3" and engine.refs() == {b.block_id: 1 for b in blocks}
    assert engine.sessions.sessions.held_blocks == len(blocks) == len(third.all_token_ids) // BLOCK


def test_a_warm_turn_is_admitted_ahead_of_newcomers() -> None:
    """Class 0 for a continuing turn whose prefix is held, class 1 for others."""
    engine = Engine()
    _, second = session(engine, 2)
    view = engine.scheduler.feather.view
    newcomer = engine.turn("new", [40_000 + t for t in range(2 * BLOCK)])
    engine.h.add(newcomer)
    prompt = next_prompt(list(second.prompt_token_ids), 4, [990 + t for t in range(BLOCK)])
    third = engine.turn("t3", prompt)
    engine.h.add(third)
    assert (view.priority(third), view.priority(newcomer)) == (0, 1)
    engine.step()
    assert engine.hits["t3"] == 4 * BLOCK and "t3" not in view.warm


def test_a_warm_turn_preempts_no_running_request_of_its_vllm_class() -> None:
    """vLLM's priority policy, urgent preemption on: a warm turn that lacks KV room
    waits for the running request of its own vLLM class (class 0 both): urgent
    preemption compares vLLM's classes, not the sessions' split of them."""
    engine = Engine(num_blocks=17, engine={"scheduling_policy": "priority"})
    _, second = session(engine, 2)
    running = engine.turn("run", [30_000 + t for t in range(9 * BLOCK)], output=40)
    engine.h.add(running)
    engine.step()
    prompt = next_prompt(list(second.prompt_token_ids), 4, [990 + t for t in range(6 * BLOCK)])
    engine.h.add(engine.turn("t3", prompt))
    engine.step()
    assert "t3" not in engine.hits  # 7 blocks more than its hold's 4, 2 free
    engine.serve()
    assert running.num_preemptions == 0 and engine.hits["t3"] == 4 * BLOCK


def test_the_next_turns_admission_releases_the_hold_it_took() -> None:
    engine = Engine()
    _, second = session(engine, 2)
    blocks = engine.sessions.pins["t2"]
    prompt = next_prompt(list(second.prompt_token_ids), 4, [990 + t for t in range(BLOCK)])
    engine.h.add(engine.turn("t3", prompt, output=8))
    engine.step()
    assert "t2" not in engine.sessions.pins  # t3 runs on the blocks; one reference each
    assert all(engine.refs()[b.block_id] == 1 for b in blocks)
    mine = {b.block_id for b in engine.scheduler.kv_cache_manager.get_blocks("t3").blocks[0]}
    assert {b.block_id for b in blocks} <= mine


def test_the_held_share_never_exceeds_its_bound() -> None:
    """32 blocks, a quarter held at most (8): three sessions of 3 blocks each ask for a
    hold at once (the clock stands still: none lapses); the third would need 9 and
    displaces none worth as much: refused."""
    engine = Engine(num_blocks=33, session_held_share=0.25)
    sessions = engine.sessions
    assert sessions.sessions.bound_blocks == 8
    prompts = [[1 + 1000 * i + t for t in range(2 * BLOCK + i)] for i in range(3)]
    engine.serve(*(engine.turn(f"{tag}1", prompts[i]) for i, tag in enumerate("abc")))
    engine.clock.now += 1.0
    seen = []
    for i, tag in enumerate("abc"):
        tool = [900 + t for t in range(BLOCK)]
        engine.serve(engine.turn(f"{tag}2", next_prompt(prompts[i], 4, tool)))
        seen.append(len(engine.held()))
        assert len(engine.held()) <= 8 and sessions.sessions.held_blocks == len(engine.held())
    counts = sessions.sessions.counts
    assert (counts.held, counts.refused, counts.displaced) == (2, 1, 0)
    assert seen == [3, 6, 6]


def test_a_hold_ends_at_its_ttl() -> None:
    engine = Engine()
    session(engine, 2)
    assert engine.sessions.pins
    engine.clock.now += 61.0  # past max_ttl_s (60 by default), the turn not back
    engine.serve(engine.turn("other", [40_000 + t for t in range(BLOCK)]))
    assert not engine.sessions.pins and engine.sessions.sessions.counts.expired == 1
    assert not engine.refs()


def test_a_prefix_cache_reset_and_shutdown_release_every_hold() -> None:
    engine = Engine()
    session(engine, 2)
    assert engine.refs()
    assert engine.scheduler.reset_prefix_cache()  # vLLM refuses while a block is referenced
    assert not engine.refs() and not engine.sessions.pins
    session(engine, 2, tag="u")
    assert engine.refs()
    engine.scheduler.shutdown()
    assert not engine.refs() and not engine.sessions.pins


def test_a_running_requests_growth_takes_a_holds_blocks_before_vllm_preempts() -> None:
    """16 blocks: a hold of 4; a request that grows past the other 12 takes them instead of
    being preempted (vLLM would preempt it, the only one running, and resume it)."""
    engine = Engine(num_blocks=17)
    session(engine, 2)
    assert len(engine.held()) == 4
    grower = engine.turn("g", [30_000 + t for t in range(8 * BLOCK)], output=5 * BLOCK)
    engine.serve(grower)
    assert grower.num_preemptions == 0 and grower.num_output_tokens == 5 * BLOCK
    counts = engine.sessions.sessions.counts
    assert not engine.sessions.pins and counts.reclaimed == 1 and counts.expired == 0


def test_without_sessions_the_same_growth_is_preempted() -> None:
    """The previous test's counterpart: vLLM's scheduler, holds absent, same pool."""
    engine = Engine(sessions=False, num_blocks=17)
    session(engine, 2)
    long_ = engine.turn("long", [30_000 + t for t in range(8 * BLOCK)], output=3 * BLOCK)
    other = engine.turn("other", [35_000 + t for t in range(6 * BLOCK)], output=3 * BLOCK)
    engine.serve(long_, other)
    assert long_.num_preemptions + other.num_preemptions > 0  # the pool is small enough


def test_a_pass_that_can_schedule_nothing_releases_a_hold() -> None:
    engine = Engine(num_blocks=17)
    session(engine, 2)
    big = engine.turn("big", [40_000 + t for t in range(14 * BLOCK)], output=1)
    engine.serve(big)  # needs 15 of 16 blocks: only once the hold is released
    assert big.is_finished() and engine.sessions.sessions.counts.reclaimed == 1
    assert not engine.refs()


def test_a_request_waiting_past_max_wait_s_takes_a_holds_blocks() -> None:
    """32 blocks: a hold of 4 (for 5 s: recomputing is priced high), a long request
    running on 17: a request of 14 blocks waits (11 free) until it is past
    ``max_wait_s`` (3 s), then the hold yields before its TTL."""
    engine = Engine(num_blocks=33, max_wait_s=3.0, max_urgent_preemptions=0)
    cost = engine.sessions.cost
    cost.per_token_s, cost.min_tokens = 1.0, 1 << 30  # no step measured
    session(engine, 2)
    (hold,) = engine.sessions.sessions.holds
    assert hold.expires_s - hold.since_s == 5.0
    running = engine.turn("run", [30_000 + t for t in range(16 * BLOCK)], output=200)
    engine.h.add(running)
    engine.step()
    waiting = engine.turn("wait", [40_000 + t for t in range(13 * BLOCK + 4)], output=2)
    engine.h.add(waiting)
    for _ in range(3):
        engine.step()
    assert "wait" not in engine.hits and engine.sessions.pins
    engine.clock.now += 3.5
    engine.step()
    assert engine.hits["wait"] == 0 and not engine.sessions.pins
    assert engine.sessions.sessions.counts.reclaimed == 1
    assert running.status is RequestStatus.RUNNING and running.num_preemptions == 0


def test_a_request_past_max_wait_s_goes_before_a_waiting_warm_turn() -> None:
    """32 blocks: a hold of 4, a long request running on 21; a newcomer of 10 blocks
    waits, then a warm turn that lacks blocks too (class 0: vLLM's pass stops at it).
    Past ``max_wait_s`` the newcomer joins the warm class, older, so it is offered first,
    and the hold yields to it."""
    engine = Engine(num_blocks=33, max_wait_s=3.0, max_urgent_preemptions=0)
    cost = engine.sessions.cost
    cost.per_token_s, cost.min_tokens = 1.0, 1 << 30  # holds last their gap (5 s)
    _, second = session(engine, 2)
    running = engine.turn("run", [30_000 + t for t in range(20 * BLOCK)], output=300)
    engine.h.add(running)
    engine.step()
    engine.h.add(engine.turn("new", [40_000 + t for t in range(9 * BLOCK + 4)], output=2))
    engine.step()
    engine.clock.now += 1.0
    prompt = next_prompt(list(second.prompt_token_ids), 4, [990 + t for t in range(8 * BLOCK)])
    engine.h.add(engine.turn("t3", prompt, output=2))
    assert "t3" in engine.sessions.warm
    for _ in range(3):
        engine.step()
    assert "new" not in engine.hits and "t3" not in engine.hits
    engine.clock.now += 2.5  # the newcomer 3.5 s old, the warm turn 2.5 s
    engine.step()
    assert "new" in engine.hits and "t3" not in engine.hits
    assert engine.sessions.sessions.counts.reclaimed == 1 and running.num_preemptions == 0


def test_an_aborted_turn_is_never_held() -> None:
    engine = Engine()
    _, second = session(engine, 2)
    prompt = next_prompt(list(second.prompt_token_ids), 4, [990 + t for t in range(BLOCK)])
    engine.h.add(engine.turn("t3", prompt, output=50))
    engine.step()
    engine.step()
    assert engine.scheduler.requests["t3"].num_output_tokens > 0
    engine.scheduler.finish_requests("t3", RequestStatus.FINISHED_ABORTED)
    assert not engine.sessions.pins and not engine.refs()
    assert engine.sessions.sessions.counts.held == 1  # turn 2's, which turn 3 took


def test_an_aborted_waiting_turn_releases_its_sessions_hold() -> None:
    engine = Engine()
    _, second = session(engine, 2)
    prompt = next_prompt(list(second.prompt_token_ids), 4, [990 + t for t in range(BLOCK)])
    engine.h.add(engine.turn("t3", prompt))
    engine.scheduler.finish_requests("t3", RequestStatus.FINISHED_ABORTED)
    assert not engine.sessions.pins and not engine.refs()


@pytest.mark.parametrize("fields", [{"cache_salt": "other"},
                                    {"sampling_params": SamplingParams(
                                        max_tokens=4, ignore_eos=True,
                                        extra_args={"tenant": "other"})}],
                         ids=["cache_salt", "tenant"])
def test_another_namespace_never_continues_a_session(fields: dict) -> None:
    """The same tokens under another cache_salt or tenant: a new session, cold."""
    engine = Engine()
    _, second = session(engine, 2)
    prompt = next_prompt(list(second.prompt_token_ids), 4, [990 + t for t in range(BLOCK)])
    stranger = engine.turn("x", prompt, **fields)
    engine.h.add(stranger)
    sessions = engine.sessions
    assert sessions.sessions.session_of("x").ended_s is None  # a new session
    assert "x" not in sessions.warm and sessions.sessions.counts.continued == 1
    engine.serve()
    assert "t2" in sessions.pins  # turn 2's hold stands: no turn of its session came


def test_an_explicit_session_key_is_honoured_within_its_tenant_only() -> None:
    engine = Engine()

    def keyed(rid: str, tenant: str, base: int) -> Request:
        params = SamplingParams(max_tokens=2, ignore_eos=True,
                                extra_args={"session": "s1", "tenant": tenant})
        return engine.turn(rid, [base + t for t in range(2 * BLOCK)], sampling_params=params)

    engine.serve(keyed("a", "alice", 1000))
    engine.clock.now += 2.0
    engine.serve(keyed("b", "alice", 5000))  # no prefix in common: the key says
    sessions = engine.sessions.sessions
    assert sessions.counts.continued == 1 and "b" in engine.sessions.pins
    engine.h.add(keyed("c", "bob", 9000))
    assert sessions.session_of("c").ended_s is None and sessions.counts.continued == 1


def test_sessions_off_changes_nothing() -> None:
    """``sessions`` false: no component, vLLM's priorities, vLLM's ``allocate_slots``;
    vLLM's own scheduler ignores the option; both miss turn 3 after the filler."""
    for engine in (Engine(sessions=False), Engine(scheduler_cls=Scheduler)):
        assert engine.sessions is None
        manager = engine.scheduler.kv_cache_manager
        assert manager.allocate_slots.__func__ is type(manager).allocate_slots
        _, second = session(engine, 2)
        engine.filler("f", 96)
        prompt = next_prompt(list(second.prompt_token_ids), 4, [990 + t for t in range(BLOCK)])
        engine.serve(engine.turn("t3", prompt))
        assert engine.hits["t3"] == 0 and not engine.refs()
    assert Engine(sessions=False).scheduler.feather.view.warm is None


def test_vllms_prefix_caching_off_turns_sessions_off() -> None:
    h = Harness(feather={"sessions": True}, enable_prefix_caching=False)
    assert h.scheduler.feather.sessions is None


def test_a_fault_in_the_sessions_code_never_reaches_vllm(monkeypatch,
                                                        contained_faults) -> None:
    """Every sessions call raises: vLLM serves every request; past ``max_faults`` Feather
    is off and every hold is released."""
    engine = Engine(max_faults=3)
    session(engine, 2)
    assert engine.sessions.pins

    def broken(*args: object) -> None:
        raise RuntimeError("injected")

    for name in ("arrived", "ended", "expire", "after_pass"):
        monkeypatch.setattr(VllmSessions, name, broken)
    served = session(engine, 3, tag="v")
    assert all(r.is_finished() for r in served)
    assert engine.scheduler.feather.faults.active is False
    assert engine.sessions is None and not engine.refs()
    assert engine.scheduler.feather.view.warm is None
    assert {where for where, _ in contained_faults} == {"sessions"}


def test_the_metrics_see_holds_and_reloads_avoided() -> None:
    engine = Engine()
    engine.sessions.sink = SessionSink("sessions-test")
    session(engine, 3)

    def sample(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"scheduler": "sessions-test", **labels})

    assert sample("feather:sessions_held") == 1
    assert sample("feather:session_blocks_held") == len(engine.held())
    events = {event: sample("feather:session_events_total", event=event)
              for event in ("held", "reloads_avoided")}
    assert events == {"held": 2, "reloads_avoided": 1}


def test_where_a_reload_is_cheap_against_the_pool_a_hold_takes_nothing_is_held(
        monkeypatch) -> None:
    """At the prior's price (1e-4 s a token) a 2-block turn's break-even in a 64-block
    pool is well under the default 10 s gap: its session goes on unheld, as Feather
    without sessions would serve it (a hold would only keep room from others)."""
    monkeypatch.undo()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = Engine()
    session(engine, 2)
    assert not engine.sessions.pins and not engine.refs()
    assert engine.sessions.sessions.counts.held == 0


def test_a_block_names_its_pool_or_none() -> None:
    engine = Engine()
    assert pool_of(engine.pool.blocks[1]) in (None, engine.pool)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sessions_keep_the_bound_and_finish_every_request(seed: int) -> None:
    """Sessions that come back or never do, aborts mid-turn, a pool under pressure: after
    every pass the holds keep at most their share of the pool and each block's references
    are the live requests' plus the holds'; no hold stands while a request past
    ``max_wait_s`` still waits with seats and tokens left in the pass (and no warm turn
    ahead of it); every request ends exactly once; at shutdown every reference is
    returned."""
    rng = random.Random(seed)
    engine = Engine(num_blocks=48, session_held_share=0.25, max_wait_s=4.0)
    scheduler, sessions = engine.scheduler, engine.sessions
    waits_on_a_hold = watch_overdue(engine, 4.0)
    cost = sessions.cost  # holds that last seconds (fabricated steps take microseconds)
    cost.per_token_s, cost.min_tokens = 0.01, 1 << 30
    ended: Counter[str] = Counter()
    freed = scheduler.feather.freed
    scheduler.feather.freed = lambda request: (ended.update([request.request_id]),
                                               freed(request))[1]
    programs = {p: [1 + 1000 * p + t for t in range(rng.randint(1, 3) * BLOCK + 3)]
                for p in range(8)}
    submitted, live, turns = [], {}, Counter()
    for _ in range(400):
        engine.clock.now += rng.uniform(0.05, 1.5)
        for p in [p for p, rid in live.items() if rid not in scheduler.requests]:
            del live[p]
            if rng.random() < 0.25:
                programs.pop(p)  # never returns
        for p in [p for p in programs if p not in live and turns[p] < 5]:
            if rng.random() < 0.3:
                turns[p] += 1
                programs[p] = next_prompt(programs[p], 3, [rng.randint(100, 30_000)
                                                         for _ in range(rng.randint(4, 40))])
                live[p] = f"p{p}t{turns[p]}"
                engine.h.add(engine.turn(live[p], programs[p], output=3))
                submitted.append(live[p])
        if rng.random() < 0.2:  # pressure: an unrelated request of 8-14 blocks
            big = f"big{len(submitted)}"
            engine.h.add(engine.turn(big, [rng.randint(30_000, 31_000)
                                           for _ in range(rng.randint(8, 14) * BLOCK)],
                                     output=rng.randint(1, 2 * BLOCK)))
            submitted.append(big)
        if live and rng.random() < 0.05:
            scheduler.finish_requests(rng.choice(list(live.values())),
                                      RequestStatus.FINISHED_ABORTED)
        if scheduler.has_requests():
            engine.step()
        assert len(engine.held()) <= sessions.sessions.bound_blocks
        assert engine.refs() == expected_refs(engine)
    engine.serve(limit=engine.h.steps + 500)
    assert waits_on_a_hold == []
    assert sorted(ended) == sorted(submitted) and set(ended.values()) == {1}
    counts = sessions.sessions.counts
    assert counts.held > 0 and counts.reloads_avoided > 0 and counts.reclaimed + counts.expired > 0
    scheduler.shutdown()
    assert not engine.refs()


def expected_refs(engine: Engine) -> dict[int, int]:
    """Each block's references: one per live request that holds it, one per hold."""
    expected: Counter[int] = Counter()
    manager = engine.scheduler.kv_cache_manager
    for rid in engine.scheduler.requests:
        for group in manager.get_blocks(rid).blocks:
            expected.update(b.block_id for b in group if not b.is_null)
    for blocks in engine.sessions.pins.values():
        expected.update(b.block_id for b in blocks)
    return dict(expected)


def watch_overdue(engine: Engine, max_wait_s: float) -> list[tuple[float, list[str]]]:
    """After each pass: the requests past ``max_wait_s`` still waiting although the pass
    left seats and tokens, a hold stands and no warm turn waits (Feather offers the
    overdue first in its class; a failed allocation for one takes holds until none is
    left).  A waiting warm turn is of a more urgent class, which ``max_wait_s`` does not
    cross (docs/sessions.md): vLLM's pass stops at it when it lacks blocks.  The list
    fills as passes run."""
    found: list[tuple[float, list[str]]] = []
    scheduler = engine.scheduler
    after_schedule = scheduler.feather.after_schedule
    waiting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    def checked(output) -> None:
        after_schedule(output)
        now = engine.clock.now
        overdue = [r.request_id for r in scheduler.requests.values()
                   if r.status in waiting and now - r.arrival_time >= max_wait_s]
        room = len(scheduler.running) < scheduler.max_num_running_reqs and \
            output.total_num_scheduled_tokens < scheduler.max_num_scheduled_tokens
        if overdue and room and engine.sessions.pins:
            found.append((now, overdue))

    scheduler.feather.after_schedule = checked
    return found
