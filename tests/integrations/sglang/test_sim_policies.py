"""Decision equivalence: the simulator's SGLang ``hrrn`` and ``routing-key``
(``sim.policies``) against SGLang 0.5.23's own ``SchedulePolicy.calc_priority``, on the
same waiting requests and the same cache: SGLang's ``RadixCache`` and the simulator's
block pool both hold the same warm prompts (block-aligned prefixes, so both match alike).
"""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import pytest

from feather_sched.bench.cht.sglang_policy import published_server_args, sglang_installed

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams

from feather_sched.sim.block_pool import BlockPool
from feather_sched.sim.engine import EngineConfig, SimRequest
from feather_sched.sim.policies import HrrnPolicy, RoutingKeyPolicy
from feather_sched.workloads.spec import RequestSpec

BLOCK = 16
FAMILIES = 5
"""Prefix families 0-4; the even ones are warm (cached), the odd ones cold."""


def tokens(family: int, count: int) -> list[int]:
    return [1_000 * (family + 1) + t for t in range(count)]


def prompts(seed: int, count: int) -> dict[str, tuple[int, list[int]]]:
    """``count`` waiting prompts (rid: family, tokens), in a seeded mix: a family's
    prefix of 0-6 blocks, then a tail of its own that is not block-aligned."""
    rng = random.Random(seed)
    made = {}
    for i in range(count):
        family = rng.randrange(FAMILIES)
        prefix = tokens(family, BLOCK * rng.randint(0, 6))
        tail = tokens(50 + i, rng.randint(3, 200))
        made[f"r{rng.randrange(10**6):06d}"] = (family, prefix + tail)
    return made


def caches(seed: int) -> tuple[RadixCache, BlockPool]:
    """SGLang's cache and the simulator's pool, each holding the warm families' prompts."""
    radix, pool = RadixCache.create_simulated(), BlockPool(1024, BLOCK)
    config = EngineConfig(block_tokens=BLOCK)
    for family in range(0, FAMILIES, 2):
        prompt = tokens(family, BLOCK * (2 + (seed + family) % 5))
        radix.insert(InsertParams(key=RadixKey(token_ids=array("q", prompt)),
                                  value=torch.arange(len(prompt), dtype=torch.int64)))
        sim = SimRequest.create(RequestSpec(f"warm{family}", prompt, 1, 0.0), 0, config)
        pool.allocate(sim.request_id, sim.keys, len(prompt))
        pool.cache_full_blocks(sim.request_id, sim.keys, len(prompt))
        pool.free(sim.request_id)
    return radix, pool


def sim_request(rid: str, family: int, prompt: list[int], keyed: bool) -> SimRequest:
    spec = RequestSpec(rid, prompt, 4, 0.0, group=family if keyed else -1)
    return SimRequest.create(spec, 0, EngineConfig(block_tokens=BLOCK))


def sglang_order(policy_name: str, radix: RadixCache, reqs: list[Req], **kwargs) -> list[str]:
    policy = SchedulePolicy(policy_name, radix, False, False, False)
    queue = list(reqs)
    with published_server_args():
        policy.calc_priority(queue, **kwargs)
    return [req.rid for req in queue]


def drained(policy, running=()) -> list[str]:
    policy.begin_pass(list(running))
    order = []
    while (offer := policy.decide()) is not None:
        order.append(offer.request_id)
        policy.admit(next(r for r in policy._queue if r.request_id == offer.request_id))
    return order


@pytest.mark.parametrize("seed", range(6))
def test_hrrn_orders_as_sglangs(seed: int) -> None:
    """Requests that entered at different prefill counts, some warm, some duplicates of
    one another's first 32 tokens: the replay's order is SGLang's."""
    waiting = prompts(seed, 24)
    radix, pool = caches(seed)
    rng = random.Random(seed)
    entered = {rid: rng.randrange(0, 5000) for rid in waiting}
    processed = 6000
    reqs = []
    for rid, (_, prompt) in waiting.items():
        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=4))
        req.arrival_processed_tokens = entered[rid]
        reqs.append(req)
    expected = sglang_order("hrrn", radix, reqs, processed_tokens=processed)

    policy = HrrnPolicy(SimpleNamespace(pool=pool), match_s=0.0)
    for rid, (family, prompt) in waiting.items():
        policy.processed_tokens = entered[rid]
        policy.enter_waiting(sim_request(rid, family, prompt, keyed=False))
    policy.processed_tokens = processed
    assert drained(policy) == expected
    assert expected != list(waiting)


@pytest.mark.parametrize("seed", range(6))
def test_routing_key_orders_as_sglangs(seed: int) -> None:
    """Keys the running batch holds (two of family 1, one of family 3) first, by count,
    then the rest by key, requests without a key (a seeded third) first among them."""
    waiting = prompts(seed, 20)
    radix, _ = caches(seed)
    keyed = {rid: random.Random(rid).random() > 0.33 for rid in waiting}
    running_keys = [1, 1, 3]
    reqs = [Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=4),
                routing_key=str(family) if keyed[rid] else None)
            for rid, (family, prompt) in waiting.items()]
    batch = ScheduleBatch(reqs=[
        Req(f"run{i}", "", array("q", tokens(k, 40)), SamplingParams(max_new_tokens=4),
            routing_key=str(k)) for i, k in enumerate(running_keys)])
    expected = sglang_order("routing-key", radix, reqs, running_batch=batch)

    policy = RoutingKeyPolicy()
    for rid, (family, prompt) in waiting.items():
        policy.enter_waiting(sim_request(rid, family, prompt, keyed[rid]))
    running = [sim_request(f"run{i}", k, tokens(k, 40), True) for i, k in enumerate(running_keys)]
    assert drained(policy, running) == expected
    assert expected != list(waiting)
