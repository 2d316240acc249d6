"""A small Mooncake-format trace and the prefix-cache hit rate its hash ids imply, for
replays on the real engine, offline and against a server."""

from __future__ import annotations

import json
from pathlib import Path

TRACE_BLOCK, SCALE, ENGINE_BLOCK = 512, 0.25, 128
"""512-token hash blocks replayed as 128 tokens: one vLLM CPU block each."""
REQUESTS = [  # (hash ids, input length in the trace's tokens)
    ([1, 2, 3, 4], 2048),
    ([1, 2, 3, 5], 2048),
    ([1, 2, 6], 1536),
    ([7, 8, 9], 1536),
    ([7, 8, 9, 10], 2048),
    ([1, 2, 3, 4], 2048),  # a whole repeat: the engine computes its last block again
    ([7, 11], 1024),
    ([12], 512),
    ([1, 2, 3, 13], 3 * 512 + 100),  # a partial last block: 25 tokens at the scale
]
REPLAY_FLAGS = ["--token-scale", str(SCALE), "--trace-speed", "4"]
"""Arrivals 0.25 s apart: each request finds the earlier ones computed and cached."""


def write_trace(path: Path) -> Path:
    """The trace, one request a second."""
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": length,
                                        "output_length": 2, "hash_ids": hash_ids}) + "\n"
                            for i, (hash_ids, length) in enumerate(REQUESTS)))
    return path


def replayed_length(hash_ids: list[int], length: int) -> int:
    """Tokens of a request at the scale: whole blocks, and the last block's share."""
    last = length - (len(hash_ids) - 1) * TRACE_BLOCK
    return (len(hash_ids) - 1) * ENGINE_BLOCK + -(-last * ENGINE_BLOCK // TRACE_BLOCK)


def implied_hit_rate() -> float:
    """Of the replayed prompt tokens, the share an unbounded cache of engine blocks holds
    when each request arrives: the leading blocks whose hash-id chain an earlier request
    had, as whole blocks, less the last token, which the engine always computes."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for hash_ids, length in REQUESTS:
        tokens = replayed_length(hash_ids, length)
        chains = [tuple(hash_ids[:i + 1]) for i in range(tokens // ENGINE_BLOCK)]
        cached = 0
        while (cached < len(chains) and chains[cached] in seen
               and (cached + 1) * ENGINE_BLOCK < tokens):
            cached += 1
        hits += cached * ENGINE_BLOCK
        total += tokens
        seen.update(chains)
    return hits / total
