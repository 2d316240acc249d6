"""VLLMBlockHasher computes vLLM's own block hashes (every algorithm, odd block sizes, the
token widths each encoding distinguishes) and tells an engine that disagrees."""

from __future__ import annotations

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="the vllm extra is not installed")

from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402

from feather_sched.integrations.vllm.block_hash import ALGORITHMS, VLLMBlockHasher  # noqa: E402
from feather_sched.routing.cache_index import BlockStored  # noqa: E402

EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1]
"""Token ids where pickle's or CBOR's integer encodings change width."""


def tokens(seed: int, count: int = 200) -> list[int]:
    rng = np.random.default_rng(seed)
    values = np.concatenate([rng.integers(0, 300, count // 2),
                             rng.integers(0, 1 << 20, count // 2), EDGES])
    rng.shuffle(values)
    return values.tolist()


def vllm_hashes(algorithm: str, block_size: int, prompt: list[int], monkeypatch,
                seed: str | None) -> list[bytes]:
    """vLLM's own chain (``hash_block_tokens`` from ``NONE_HASH``), as its engine computes
    a plain request's block hashes."""
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    function = get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(function)
    parent, out = None, []
    for start in range(0, len(prompt) // block_size * block_size, block_size):
        parent = kv_cache_utils.hash_block_tokens(function, parent,
                                                  prompt[start:start + block_size], None)
        out.append(parent)
    return out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 16, 128])
def test_the_hashes_are_vllms(algorithm: str, block_size: int, monkeypatch) -> None:
    seed = "1234" if algorithm.startswith("xxhash") else None
    prompt = tokens(block_size)
    expected = vllm_hashes(algorithm, block_size, prompt, monkeypatch, seed)
    whole = VLLMBlockHasher(block_size, algorithm, seed, int_hashes=False)
    assert whole.full_hashes(prompt) == expected
    assert whole(prompt) == expected and whole(prompt) == expected  # memoized: the same
    events = VLLMBlockHasher(block_size, algorithm, seed)
    assert events(np.asarray(prompt)) == [kv_cache_utils.maybe_convert_block_hash(h)
                                          for h in expected]


def test_a_prompt_sharing_a_known_prefix_reuses_its_hashes(monkeypatch) -> None:
    hasher = VLLMBlockHasher(16)
    prefix = tokens(0, 256)[:256]
    first = hasher(prefix + [5] * 40)
    assert len(hasher._memo) == 2  # two 128-token chunks (8 blocks each) of 18 blocks
    second = hasher(prefix + [6] * 40)
    assert second[:16] == first[:16] and second[16:] != first[16:]
    expected = vllm_hashes("sha256", 16, prefix + [6] * 40, monkeypatch, None)
    assert second == [kv_cache_utils.maybe_convert_block_hash(h) for h in expected]
    small = VLLMBlockHasher(16, memo_chunks=1)
    small(prefix)
    assert len(small._memo) == 1


def test_the_check_tells_a_differing_engine_and_passes_what_it_cannot_recompute() -> None:
    prompt = tokens(1)[:64]
    router = VLLMBlockHasher(16)
    event = BlockStored(router(prompt), None, prompt, 16)
    assert router.check(event) is None
    assert router.check(event._replace(parent=1)) is None  # not a prompt's start
    assert "seed" in VLLMBlockHasher(16, seed="other").check(event)
    assert "sha256_cbor" in VLLMBlockHasher(16, "sha256_cbor").check(event)
    assert "hold 16 tokens, the router's 32" in VLLMBlockHasher(32).check(event)
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        VLLMBlockHasher(16, "xxhash")
    with pytest.raises(ValueError, match="unknown"):
        VLLMBlockHasher(16, "md5")


@pytest.mark.parametrize("fields", [{"cache_salt": "tenant-a"},
                                    {"lora_name": "adapter"},
                                    {"cache_salt": "s", "lora_name": "adapter"}])
def test_a_salted_or_adapted_requests_hashes_are_vllms(fields: dict, monkeypatch) -> None:
    """The router names the blocks of a request with a cache boundary as vLLM's engine does
    (its own ``Request`` and block hasher), so the precise index matches salted and LoRA
    requests only with their own kind."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from feather_sched.integrations.vllm.scheduler import boundary

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    function = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(function)
    lora = fields.get("lora_name")
    prompt = tokens(7)
    request = Request("r", prompt, SamplingParams(max_tokens=1), None, arrival_time=0.0,
                      cache_salt=fields.get("cache_salt"),
                      lora_request=lora and LoRARequest(lora, 1, "/adapters/a"),
                      block_hasher=kv_cache_utils.get_request_block_hasher(16, function))
    hasher = VLLMBlockHasher(16, int_hashes=False)
    assert hasher(prompt, boundary(request)) == request.block_hashes
    assert hasher(prompt, boundary(request)) == request.block_hashes  # memoized: the same
    assert hasher(prompt)[0] != request.block_hashes[0]  # the plain prompt's differ
    with pytest.raises(ValueError, match="'mm'"):
        hasher(prompt, (("mm", "image-hash", 0),))
