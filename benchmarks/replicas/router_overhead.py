"""Router overhead per request: chunk keys of a 10K-token prompt, route, finish.

    .venv/bin/python benchmarks/replicas/router_overhead.py

8 replicas, 64 prefix groups of 10,240 tokens plus 32 unique tokens each (int32 numpy
prompts, as a router holding token ids has them), 256 requests in flight (each request
finishes 256 routes later).  Per router: the median over 5 repeats of the mean time per
request of ``route_tokens`` (chunk keys included) plus its ``finished``; and, for
FeatherRouter, the chunk keys alone.  Prints the figures and writes
router_overhead.json beside this file.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from feather_sched.cht import token_chunk_keys
from feather_sched.routers import ROUTERS, make_router

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


def keys_us(tokens: list[np.ndarray]) -> float:
    started = time.perf_counter()
    for prompt in tokens:
        token_chunk_keys(prompt)
    return (time.perf_counter() - started) / len(tokens) * 1e6


def main() -> None:
    tokens = prompts()
    figures = {name: statistics.median(per_request_us(name, tokens) for _ in range(REPEATS))
               for name in ROUTERS}
    keys = statistics.median(keys_us(tokens) for _ in range(REPEATS))
    for name, us in figures.items():
        print(f"{name:20s} {us:6.1f} us per request (route + finish, chunk keys included)")
    print(f"{'chunk keys alone':20s} {keys:6.1f} us per {PREFIX + SUFFIX}-token prompt")
    document = {"config": {"replicas": REPLICAS, "groups": GROUPS,
                           "prompt_tokens": PREFIX + SUFFIX, "requests": REQUESTS,
                           "in_flight": IN_FLIGHT, "repeats": REPEATS},
                "us_per_request": figures, "chunk_keys_us": keys, "target_us": 50}
    (HERE / "router_overhead.json").write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
