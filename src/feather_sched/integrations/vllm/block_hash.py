"""vLLM's prefix-cache block hashes, computed at the router exactly as vLLM 0.32-0.34 do.

``VLLMBlockHasher`` serializes and digests each full block as vLLM does for each
``--prefix-caching-hash-algo`` (``pickle``, ``cbor2``; SHA-256 or XXH3-128) from the seed
vLLM uses, and remembers the hashes of the prefixes it has seen by a cheap XXH3-64 digest
of their tokens: a prompt whose prefix came before costs that digest and a dict look-up
per chunk.  ``check`` recomputes a ``BlockStored`` event's hashes to catch a router and an
engine that disagree (block size, algorithm, seed).  A request's cache boundary is
modelled where it is a LoRA adapter or a ``cache_salt``; multimodal and prompt-embedding
requests are a ValueError (the router routes them by load).  vLLM's scheme in full:
docs/replicas.md, "vLLM's block hashes".
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import numpy as np
import xxhash

from feather_sched.core import Namespace, token_keys
from feather_sched.routing.cache_index import BlockStored

DEFAULT_SEED = "vllm-none-hash"
"""vLLM's ``NONE_HASH`` seed for SHA-256 algorithms without ``PYTHONHASHSEED``."""
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
MEMO_TOKENS = 128
"""Tokens per memoized chunk (rounded to whole blocks)."""

_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "xxhash": xxhash.xxh3_128_digest,
}


def _pickle(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def extra_keys(boundary: tuple) -> tuple[tuple | None, tuple | None]:
    """vLLM's extra keys of a request's first block and of the others, given its cache
    ``boundary`` (LoRA, then the salt, as vLLM orders them; None where there are none).
    ValueError for a part it cannot model (multimodal items, prompt embeddings)."""
    unknown = [part for part in boundary if part[0] not in ("lora", "cache_salt")]
    if unknown:
        raise ValueError(f"the router cannot hash blocks with extra keys {unknown[0][0]!r}")
    lora = tuple(part for part in boundary if part[0] == "lora")
    salt = tuple(part for part in boundary if part[0] == "cache_salt")
    return lora + salt or None, lora or None


class VLLMBlockHasher:
    """vLLM's block hashes of a prompt, as its KV events name the blocks.

    ``__call__(tokens)`` returns one per full block of ``block_size`` tokens: the hash's
    low 64 bits as an int (``int_hashes``, vLLM's default for events) or the whole digest.
    Cost: an XXH3-64 digest per chunk of about ``MEMO_TOKENS`` tokens and a look-up; for
    chunks not seen before, one serialization and digest per block (measured:
    docs/results.md#replicas).  Remembers up to ``memo_chunks`` chunks (oldest forgotten
    first).
    """

    def __init__(self, block_size: int, algorithm: str = "sha256", seed: str | None = None,
                 *, int_hashes: bool = True, memo_chunks: int = 1 << 18) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown prefix caching hash algorithm {algorithm!r}: use "
                             f"{', '.join(ALGORITHMS)}")
        if seed is None and algorithm.startswith("xxhash"):
            raise ValueError(f"{algorithm}: vLLM draws a random seed unless PYTHONHASHSEED "
                             "is set; give the engines' PYTHONHASHSEED as the seed")
        self.block_size = block_size
        self.algorithm = algorithm
        self.seed = DEFAULT_SEED if seed is None else seed
        self.int_hashes = int_hashes
        digest = _DIGESTS[algorithm.split("_")[0]]
        serialize = _cbor if algorithm.endswith("_cbor") else _pickle
        self._hash: Callable[[Any], bytes] = lambda value: digest(serialize(value))
        self.none_hash = self._hash(self.seed)
        self.memo_blocks = max(1, MEMO_TOKENS // block_size)
        self.memo_chunks = memo_chunks
        self._memo: dict[int, tuple[bytes, tuple[Any, ...]]] = {}
        """Prefix digest through a chunk -> that chunk's last full hash, its block names."""

    def describe(self) -> dict[str, Any]:
        """What must equal the engines' settings."""
        return {"block_size": self.block_size, "algorithm": self.algorithm,
                "seed": self.seed, "int_hashes": self.int_hashes}

    def _name(self, digest: bytes) -> Any:
        return int.from_bytes(digest[-8:], "big") if self.int_hashes else digest

    def full_hashes(self, tokens: np.ndarray | Sequence[int], parent: bytes | None = None,
                    boundary: tuple = ()) -> list[bytes]:
        """Whole digests of the full blocks of ``tokens``, chained from ``parent`` (None:
        a prompt's start) with the extra keys of ``boundary`` (``extra_keys``).  No memo."""
        size = self.block_size
        values = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
        first, rest = extra_keys(boundary)
        extra = first if parent is None else rest
        hash_block, chain, out = self._hash, self.none_hash if parent is None else parent, []
        for start in range(0, len(values) // size * size, size):
            chain = hash_block((chain, tuple(values[start:start + size]), extra))
            out.append(chain)
            extra = rest
        return out

    def __call__(self, tokens: Sequence[int], boundary: tuple = ()) -> list[Any]:
        """Names of the full blocks of ``tokens`` for a request of cache ``boundary``."""
        extra_keys(boundary)  # ValueError before any work for one not modelled
        array = np.ascontiguousarray(tokens, dtype=np.int32)
        per_chunk = self.memo_blocks
        chunk_tokens = per_chunk * self.block_size
        memo = self._memo
        names: list[Any] = []
        parent: bytes | None = None
        done = 0  # tokens whose blocks are named
        keys = token_keys(array, chunk_tokens, Namespace(boundary)) \
            if len(array) >= chunk_tokens else []
        for key in keys:
            known = memo.get(key)
            if known is None:
                break
            parent = known[0]
            names.extend(known[1])
            done += chunk_tokens
        rest = self.full_hashes(array[done:], parent, boundary)
        if rest:
            for j, key in enumerate(keys[done // chunk_tokens:]):
                chunk = rest[j * per_chunk:(j + 1) * per_chunk]
                memo[key] = (chunk[-1], tuple(self._name(h) for h in chunk))
            while len(memo) > self.memo_chunks:
                del memo[next(iter(memo))]
            names.extend(self._name(h) for h in rest)
        return names

    def check(self, event: BlockStored) -> str | None:
        """Why a ``BlockStored`` event's hashes are not this hasher's, or None when they
        agree.  Only an event from a prompt's start (no parent) with every block's tokens
        can be recomputed; others pass."""
        if event.block_size != self.block_size:
            return (f"the engine's blocks hold {event.block_size} tokens, the router's "
                    f"{self.block_size}")
        count = len(event.hashes)
        if event.parent is not None or len(event.token_ids) < count * self.block_size:
            return None
        mine = [self._name(h) for h in self.full_hashes(event.token_ids)[:count]]
        if mine != list(event.hashes):
            return (f"the engine's block hashes differ from the router's ({self.algorithm}, "
                    f"seed {self.seed!r}, {'low 64 bits' if self.int_hashes else 'whole'}): "
                    "set the router's hash algorithm and seed (PYTHONHASHSEED) to the "
                    "engines'")
        return None
