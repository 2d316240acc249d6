"""Router overhead per request: keys of a 10K-token prompt, route, finish.

    .venv/bin/python benchmarks/replicas/router_overhead.py [--set NAME]

8 replicas, 64 prefix groups of 10,240 tokens plus 32 unique tokens each (int32 numpy
prompts, as a router holding token ids has them), 256 requests in flight (each request
finishes 256 routes later).  Per router: the median over 5 repeats of the mean time per
request of ``route_tokens`` (its keys included) plus its ``finished``; and, for
FeatherRouter, the chunk keys alone.  FeatherRouter on the precise index
(``feather-precise-B``: vLLM's sha256 block hashes of B-token blocks, 128 as vLLM's CPU
engine, 16 as its GPU engines) routes over a cache index that holds what each request's
replica would cache: after each route its replica's engine reports the request's blocks
stored (``BlockStored``, not timed: the event thread's work, timed apart as
``events_us``, per request).  ``cold_hash_us``: vLLM's hashes of a prompt no request
shared before (no memo).  Prints the figures and writes router_overhead.json into the
run set's folder, results/NAME/ (``--set``, default the commit).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from feather_sched.bench.study import Study, parser
from feather_sched.core.cht import token_chunk_keys
from feather_sched.core.prefix import keys_per_chunk
from feather_sched.integrations.vllm.block_hash import VLLMBlockHasher
from feather_sched.routing.baselines import ROUTER_CLASSES, make_router
from feather_sched.routing.cache_index import BlockStored, PreciseIndex
from feather_sched.routing.feather import FeatherRouter

HERE = Path(__file__).parent
REPLICAS = 8
GROUPS = 64
PREFIX = 10240
SUFFIX = 32
REQUESTS = 4000
IN_FLIGHT = 256
REPEATS = 5


def prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1, 32000, PREFIX, dtype=np.int32) for _ in range(GROUPS)]
    return [np.concatenate([prefixes[rng.integers(GROUPS)],
                            rng.integers(1, 32000, SUFFIX, dtype=np.int32)])
            for _ in range(REQUESTS)]


def per_request_us(name: str, tokens: list[np.ndarray]) -> float:
    """Mean microseconds per request of route (with chunk keys) plus finish."""
    router = make_router(name, range(REPLICAS), seed=0)
    started = time.perf_counter()
    for i, prompt in enumerate(tokens):
        router.route_tokens(i, prompt)
        if i >= IN_FLIGHT:
            router.finished(i - IN_FLIGHT)
    return (time.perf_counter() - started) / len(tokens) * 1e6


def precise_us(block_size: int, tokens: list[np.ndarray]) -> tuple[float, float]:
    """Mean microseconds per request of route (with vLLM's block hashes) plus finish on
    the precise index, and of applying the request's ``BlockStored`` event."""
    index = PreciseIndex(VLLMBlockHasher(block_size), keys_per_chunk(block_size))
    router = FeatherRouter(range(REPLICAS), seed=0, index=index)
    routing = events = 0.0
    for i, prompt in enumerate(tokens):
        started = time.perf_counter()
        replica = router.route_tokens(i, prompt)
        if i >= IN_FLIGHT:
            router.finished(i - IN_FLIGHT)
        routing += time.perf_counter() - started
        event = [BlockStored(router.keys(prompt), None, (), block_size)]
        started = time.perf_counter()
        index.cache.apply(replica, event)
        events += time.perf_counter() - started
    return routing / len(tokens) * 1e6, events / len(tokens) * 1e6


def cold_hash_us(block_size: int, tokens: list[np.ndarray]) -> float:
    hasher = VLLMBlockHasher(block_size)
    started = time.perf_counter()
    for prompt in tokens[:200]:
        hasher.full_hashes(prompt)
    return (time.perf_counter() - started) / 200 * 1e6


def keys_us(tokens: list[np.ndarray]) -> float:
    started = time.perf_counter()
    for prompt in tokens:
        token_chunk_keys(prompt)
    return (time.perf_counter() - started) / len(tokens) * 1e6


def main() -> None:
    args = parser(__doc__).parse_args()
    tokens = prompts()
    figures = {name: statistics.median(per_request_us(name, tokens) for _ in range(REPEATS))
               for name in ROUTER_CLASSES}
    events, cold = {}, {}
    for block in (128, 16):
        runs = [precise_us(block, tokens) for _ in range(REPEATS)]
        figures[f"feather-precise-{block}"] = statistics.median(r[0] for r in runs)
        events[block] = statistics.median(r[1] for r in runs)
        cold[block] = statistics.median(cold_hash_us(block, tokens) for _ in range(REPEATS))
    keys = statistics.median(keys_us(tokens) for _ in range(REPEATS))
    for name, us in figures.items():
        print(f"{name:20s} {us:6.1f} us per request (route + finish, keys included)")
    print(f"{'chunk keys alone':20s} {keys:6.1f} us per {PREFIX + SUFFIX}-token prompt")
    for block in events:
        print(f"precise, {block}-token blocks: its BlockStored event {events[block]:.1f} us "
              f"per request; vLLM's hashes of a prompt never seen {cold[block]:.0f} us")
    document = {"config": {"replicas": REPLICAS, "groups": GROUPS,
                           "prompt_tokens": PREFIX + SUFFIX, "requests": REQUESTS,
                           "in_flight": IN_FLIGHT, "repeats": REPEATS},
                "us_per_request": figures, "chunk_keys_us": keys,
                "precise_events_us": events, "precise_cold_hash_us": cold,
                "target_us": {"approximate": 50, "precise": 100}}
    Study(__file__, set_name=args.set).write_json("router_overhead", document)


if __name__ == "__main__":
    main()
