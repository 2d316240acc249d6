"""vLLM's KV events into the router's cache index over ZMQ, from the real engine (CPU, tiny
model, in-process) and from vLLM's own scheduler driven without one (fabricated model
outputs, so on every release): the index holds exactly the blocks the engine's pool
caches, through evictions; the router's own hashes name them; a router whose hashes
differ is told."""

from __future__ import annotations

import os
import threading
import time

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm", reason="the vllm extra is not installed")

import numpy as np  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash  # noqa: E402

from feather_sched.integrations.vllm.block_hash import VLLMBlockHasher  # noqa: E402
from feather_sched.integrations.vllm.kv_events import KVEventSubscriber  # noqa: E402
from feather_sched.models import TINY_LLAMA  # noqa: E402
from feather_sched.routing.cache_index import CacheIndex  # noqa: E402
from tests.helpers.servers import free_port  # noqa: E402
from tests.helpers.vllm_engines import shut_down  # noqa: E402
from tests.integrations.vllm.test_scheduler import Harness  # noqa: E402

BLOCK = 128
KV_BYTES_PER_TOKEN = 2 * 8 * 64 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16
KV_BLOCKS = 24  # fewer than the prompts' blocks: the pool evicts


@pytest.fixture(scope="module")
def engine():
    """The engine publishing on free ports; its endpoints."""
    events, endpoint, replay = publishing()
    llm = LLM(model=str(TINY_LLAMA), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, seed=0, max_model_len=2048, block_size=BLOCK,
              kv_cache_memory_bytes=KV_BLOCKS * BLOCK * KV_BYTES_PER_TOKEN,
              kv_events_config=events)
    yield llm, endpoint, replay
    shut_down(llm)


def publishing() -> tuple[KVEventsConfig, str, str]:
    """vLLM's ZMQ publisher on free ports; the endpoints to subscribe to."""
    pub, replay = free_port(), free_port()
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{replay}")
    return events, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"


def scheduler_of(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.scheduler


def cached(scheduler) -> set[int]:
    """The block hashes the scheduler's pool caches now, as its events name them."""
    pool = scheduler.kv_cache_manager.block_pool
    return {maybe_convert_block_hash(get_block_hash(key))
            for key in pool.cached_block_hash_to_block._cache}


def prompts(seed: int, groups: int = 3, per_group: int = 2) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, 32000, 4 * BLOCK).tolist() for _ in range(groups)]
    return [p + rng.integers(1, 32000, 40).tolist() for p in prefixes for _ in range(per_group)]


def settle(subscriber: KVEventSubscriber, replica: str, index: CacheIndex,
           lock: threading.Lock, want: set[int]) -> set[int]:
    """The replica's blocks in the index once it holds ``want`` (or after 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        with lock:
            held = set(index._held[replica])
        if held == want or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


@pytest.mark.real_engine
def test_the_index_holds_exactly_what_the_engine_caches_through_evictions(engine) -> None:
    llm, endpoint, replay = engine
    index, lock = CacheIndex(), threading.Lock()
    hasher = VLLMBlockHasher(BLOCK)
    mismatches: list[str] = []
    checked: list[str | None] = []

    def check(event) -> str | None:
        checked.append(hasher.check(event))
        return checked[-1]

    subscriber = KVEventSubscriber(index, lock, check,
                                   lambda replica, why: mismatches.append(why))
    try:
        llm.generate([TokensPrompt(prompt_token_ids=prompts(0)[0])],
                     SamplingParams(max_tokens=1))  # before the router subscribed
        subscriber.add("r", endpoint, replay)
        assert settle(subscriber, "r", index, lock, cached(scheduler_of(llm))) == \
            cached(scheduler_of(llm))
        for seed in (1, 2, 3):  # 12 prefix blocks a round: the pool of 24 evicts
            batch = prompts(seed)
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch],
                         SamplingParams(max_tokens=4, ignore_eos=True))
            assert settle(subscriber, "r", index, lock, cached(scheduler_of(llm))) == \
            cached(scheduler_of(llm))
        feed = subscriber.feeds["r"]
        assert feed.clears == 0 and feed.replayed >= 1  # the first batch came by replay
        last = batch[-1]
        with lock:  # the router's own hashes find what the engine just cached
            assert index.depths(hasher(last))["r"] >= 4
        assert checked == [None] and mismatches == []  # checked once, and agreed
    finally:
        subscriber.close()


@pytest.mark.real_engine
def test_a_router_hashing_otherwise_is_told_and_applies_nothing(engine) -> None:
    llm, endpoint, replay = engine
    index, lock = CacheIndex(), threading.Lock()
    mismatches: list[tuple[str, str]] = []
    subscriber = KVEventSubscriber(index, lock, VLLMBlockHasher(BLOCK, seed="other").check,
                                   lambda replica, why: mismatches.append((replica, why)))
    try:
        subscriber.add("r", endpoint, replay)
        llm.generate([TokensPrompt(prompt_token_ids=prompts(9)[0])],
                     SamplingParams(max_tokens=1))
        deadline = time.monotonic() + 10
        while not mismatches and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mismatches and mismatches[0][0] == "r" and "seed" in mismatches[0][1]
        time.sleep(0.3)
        with lock:
            assert index.blocks("r") == 0
    finally:
        subscriber.close()


def test_the_schedulers_own_events_reach_the_index_without_an_engine() -> None:
    """vLLM's own scheduler and block pool, no model (``Harness``: fabricated outputs),
    publishing through vLLM's own ZMQ publisher: what the pool caches is what the index
    holds, wave after wave of new prefix groups (40 blocks: the pool evicts), and the
    router's hashes agree. No compiled op of vLLM's: this runs on every release."""
    events, endpoint, replay = publishing()
    harness = Harness(num_blocks=40, kv_events_config=events)
    index, lock = CacheIndex(), threading.Lock()
    hasher = VLLMBlockHasher(16)
    checked: list[str | None] = []

    def check(event) -> str | None:
        checked.append(hasher.check(event))
        return checked[-1]

    subscriber = KVEventSubscriber(index, lock, check)
    try:
        subscriber.add("r", endpoint, replay)
        evicted = False
        for wave in range(4):
            before = cached(harness.scheduler)
            harness.add(*(harness.request(f"w{wave}-{i}", group=2 * wave + i % 2,
                                          max_tokens=3) for i in range(4)))
            harness.drain()
            now = cached(harness.scheduler)
            evicted |= bool(before - now)
            assert settle(subscriber, "r", index, lock, now) == now
        assert evicted and checked == [None]
    finally:
        subscriber.close()
        harness.scheduler.shutdown()
