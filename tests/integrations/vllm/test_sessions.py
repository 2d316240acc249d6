"""Agent sessions in vLLM's real scheduler and block pool (``integrations.vllm.sessions``),
driven as ``test_scheduler.py`` drives it: fabricated model outputs, Feather's clock in the
test's hands.  Runs on every vLLM release (no compiled op)."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from feather_sched.integrations.vllm.scheduler import FeatherScheduler  # noqa: E402
from feather_sched.integrations.vllm.sessions import ReloadCost, pool_of  # noqa: E402
from tests.integrations.vllm.test_scheduler import BLOCK, Harness  # noqa: E402

OUTPUT_TOKEN = 7
"""The token ``Harness.fake_output`` samples."""


@pytest.fixture(autouse=True)
def _no_multiprocessing(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def harness(sessions: bool = True, num_blocks: int = 64, **feather: object
            ) -> tuple[Harness, Clock]:
    clock = Clock()
    return Harness(num_blocks=num_blocks, clock=clock,
                   feather={"sessions": sessions, **feather}), clock


def turn(h: Harness, rid: str, prompt: list[int], output: int = 4, **fields) -> Request:
    params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                   pooling_params=None, arrival_time=time.time(), block_hasher=h.hasher,
                   **fields)


def next_prompt(prompt: list[int], output: int, tool: list[int]) -> list[int]:
    """The next turn's prompt: this one's, its output (the fabricated tokens), a tool's."""
    return prompt + [OUTPUT_TOKEN] * output + tool


def serve(h: Harness, request: Request) -> Request:
    h.add(request)
    h.drain()
    return request


def filler(h: Harness, tag: str, blocks: int) -> None:
    """Unrelated requests that take ``blocks`` blocks of the pool, one after another:
    under LRU they evict whatever nothing references."""
    for i in range(blocks // 4):
        serve(h, turn(h, f"{tag}{i}", [20_000 + 100 * i + hash(tag) % 97 + t
                                       for t in range(4 * BLOCK - 2)], output=1))


def refs(h: Harness) -> dict[int, int]:
    """Every block of the pool that some reference holds: its id and count."""
    pool = h.scheduler.kv_cache_manager.block_pool
    return {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt and not b.is_null}


def three_turns(sessions: bool) -> tuple[Harness, int]:
    """Turn 1, its return (turn 2, which the rule then holds: its session came back),
    unrelated requests that fill the pool, then turn 3; the prefix-cache hits of turn 3
    in tokens (vLLM's own count)."""
    h, clock = harness(sessions)
    manager = h.scheduler.kv_cache_manager
    prompt = [1 + t for t in range(3 * BLOCK + 5)]
    serve(h, turn(h, "t1", prompt))
    for k in (2, 3):
        clock.now += 5.0
        if k == 3:
            filler(h, "f", 64)
            manager.make_prefix_cache_stats()  # counted afresh from here
        prompt = next_prompt(prompt, 4, [900 + 10 * k + t for t in range(BLOCK)])
        serve(h, turn(h, f"t{k}", prompt))
    return h, manager.make_prefix_cache_stats().hits


def test_a_returning_turn_finds_its_session_held_and_hits_it() -> None:
    h, hits = three_turns(sessions=True)
    cold, cold_hits = three_turns(sessions=False)
    sessions = h.scheduler.feather.sessions
    counts = sessions.sessions.counts
    # turns 2 and 3 continue the session; turn 2 ends held (its session came back), turn
    # 3 finds the hold, and ends held too
    assert (counts.continued, counts.held, counts.reloads_avoided) == (2, 2, 1)
    # turn 2's prompt and output: 5 full blocks of its 5 * 16 + 9 tokens, all hits
    assert hits == 5 * BLOCK
    assert cold_hits == 0  # without sessions the filler evicted it all
    assert cold.scheduler.feather.sessions is None
    (holder, blocks), = sessions.pinned.items()
    assert holder == "t3" and refs(h) == {b.block_id: 1 for b in blocks}


def test_without_sessions_option_nothing_changes() -> None:
    """``sessions`` off: no component, every priority vLLM's own."""
    h, _ = harness(sessions=False)
    assert h.scheduler.feather.sessions is None
    assert h.scheduler.feather.runtime.view.warm is None
    assert h.scheduler.kv_cache_manager.allocate_slots.__func__ is \
        type(h.scheduler.kv_cache_manager).allocate_slots


def test_a_held_turns_blocks_keep_one_reference_each_until_released() -> None:
    h, clock = harness()
    prompt = [1 + t for t in range(2 * BLOCK + 3)]
    serve(h, turn(h, "a1", prompt))
    clock.now += 2.0
    second = next_prompt(prompt, 4, [500 + t for t in range(BLOCK)])
    serve(h, turn(h, "a2", second))
    sessions = h.scheduler.feather.sessions
    (holder, blocks), = sessions.pinned.items()
    assert holder == "a2" and len(blocks) == len(second) // BLOCK  # its full blocks
    assert refs(h) == {b.block_id: 1 for b in blocks}  # held, nothing else
    assert sessions.sessions.held_blocks == len(blocks)
    pool = h.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 - len(blocks)
    assert h.scheduler.reset_prefix_cache()  # vLLM resets only with every hold released
    assert not refs(h) and not sessions.pinned


def test_lapsed_holds_yield_to_a_running_requests_growth() -> None:
    """A pool of 16 blocks: a hold of 5, lapsed; a request that grows past the rest gets
    the hold's blocks instead of being preempted."""
    h, clock = harness(num_blocks=17)
    prompt = [1 + t for t in range(4 * BLOCK + 3)]
    serve(h, turn(h, "a1", prompt))
    clock.now += 1.0
    serve(h, turn(h, "a2", next_prompt(prompt, 4, [500 + t for t in range(BLOCK)])))
    sessions = h.scheduler.feather.sessions
    assert len(sessions.pinned["a2"]) == 6
    clock.now += 100.0  # past any TTL: lapsed
    grower = turn(h, "g", [30_000 + t for t in range(8 * BLOCK)], output=3 * BLOCK)
    serve(h, grower)
    assert grower.num_preemptions == 0 and grower.num_output_tokens == 3 * BLOCK
    assert not sessions.pinned and sessions.sessions.counts.expired == 1


def test_a_pass_that_can_schedule_nothing_releases_a_hold() -> None:
    h, clock = harness(num_blocks=17)
    prompt = [1 + t for t in range(4 * BLOCK + 3)]
    serve(h, turn(h, "a1", prompt))
    clock.now += 1.0
    serve(h, turn(h, "a2", next_prompt(prompt, 4, [500 + t for t in range(BLOCK)])))
    big = turn(h, "big", [40_000 + t for t in range(14 * BLOCK)], output=1)
    serve(h, big)  # needs 15 of 16 blocks: only once the live hold is released
    assert big.is_finished() and h.scheduler.feather.sessions.sessions.counts.reclaimed == 1
    assert not refs(h)


def test_the_reload_cost_is_measured_per_token() -> None:
    cost = ReloadCost(min_tokens=10, weight=0.5)
    cost.observe(5, 1.0)  # too few tokens to say
    cost.observe(100, 1.0)
    cost.observe(100, 2.0)
    assert cost.seconds(10) == pytest.approx(10 * 0.015)


def test_a_block_names_its_pool_in_every_release() -> None:
    h, _ = harness()
    pool = h.scheduler.kv_cache_manager.block_pool
    assert pool_of(pool.blocks[1]) in (None, pool)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sessions_keep_the_bound_and_end_every_request_once(seed: int) -> None:
    """Sessions that come back or never do, aborts mid-turn, a pool under pressure: after
    every pass the holds keep at most their share of the pool, each block's references
    are the running requests' plus the holds'; every request ends exactly once; at the
    end every reference is returned."""
    rng = random.Random(seed)
    h, clock = harness(num_blocks=48, session_held_share=0.25)
    scheduler = h.scheduler
    sessions = scheduler.feather.sessions
    ended: Counter[str] = Counter()
    freed = scheduler.feather.freed
    scheduler.feather.freed = lambda request: (ended.update([request.request_id]),
                                               freed(request))[1]
    programs = {p: [1 + 1000 * p + t for t in range(rng.randint(1, 3) * BLOCK + 3)]
                for p in range(8)}
    submitted, live, turns = [], {}, Counter()
    for step in range(400):
        clock.now += rng.uniform(0.05, 1.5)
        done = [p for p, rid in live.items() if scheduler.requests.get(rid) is None]
        for p in done:
            del live[p]
            if rng.random() < 0.25:
                programs.pop(p)  # never returns
        for p in list(programs):
            if p not in live and rng.random() < 0.3 and turns[p] < 5:
                turns[p] += 1
                programs[p] = next_prompt(programs[p], 3, [rng.randint(100, 30_000)
                                                         for _ in range(rng.randint(4, 40))])
                rid = f"p{p}t{turns[p]}"
                h.add(turn(h, rid, programs[p][-4 * BLOCK:] if turns[p] > 4 else programs[p],
                           output=3))
                submitted.append(rid)
                live[p] = rid
        if live and rng.random() < 0.05:
            victim = rng.choice(list(live.values()))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        if scheduler.has_requests():
            h.step()
        held = {b.block_id for blocks in sessions.pinned.values() for b in blocks}
        assert len(held) <= sessions.sessions.bound_blocks
        assert held_refs_add_up(h)
    h.drain(limit=h.steps + 500)
    assert sorted(ended) == sorted(submitted) and set(ended.values()) == {1}
    assert sessions.sessions.counts.held > 0
    scheduler.shutdown()
    assert not refs(h)


def held_refs_add_up(h: Harness) -> bool:
    """Each block's references: one per live request that holds it, one per hold."""
    expected: Counter[int] = Counter()
    manager = h.scheduler.kv_cache_manager
    for rid in h.scheduler.requests:
        for group in manager.get_blocks(rid).blocks:
            expected.update(b.block_id for b in group if not b.is_null)
    for blocks in h.scheduler.feather.sessions.pinned.values():
        expected.update(b.block_id for b in blocks)
    return refs(h) == dict(expected)


def test_the_fcfs_baseline_has_no_sessions() -> None:
    """The instrumented baseline ignores the option: nothing where Feather is not chosen."""
    from feather_sched.integrations.vllm.scheduler import InstrumentedScheduler

    h = Harness(scheduler_cls=InstrumentedScheduler, feather={"sessions": True})
    assert not hasattr(h.scheduler.feather, "sessions")
    assert isinstance(FeatherScheduler, type)
