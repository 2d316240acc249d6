"""vLLM's CPU KV cache layouts, written out from token-major K/V and read back, for tests.

Within one (block, KV head) a cache ``[num_blocks, kv_heads, block_size, 2 * head_dim]``
holds K in its first ``block_size * head_dim`` elements and V in the rest; ``offsets``
says where each (token, dim) of the block goes in the two halves. The kernel reads these
layouts (``attention/cpu_prefix_kernel.cpp``); ``tests/integrations/vllm/test_attention.py``
checks them against vLLM's own cache writer.
"""

from __future__ import annotations

import torch


def offsets(layout: str, block_size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[block_size, dim] element offsets of K and of V within their half of a block."""
    t = torch.arange(block_size).view(-1, 1)
    d = torch.arange(dim).view(1, -1)
    if layout == "vec":  # K column-major, V row-major
        return d * block_size + t, t * dim + d
    if layout == "amx":  # K in 16-token groups of dim pairs, V in 16-dim groups of token pairs
        return (2 * ((t // 16) * 8 * dim + (d // 2) * 16 + t % 16) + d % 2,
                (d // 16) * 16 * block_size + (t // 2) * 32 + (d % 16) * 2 + t % 2)
    raise ValueError(layout)


def write_cache(keys: torch.Tensor, values: torch.Tensor, block_size: int,
                layout: str) -> torch.Tensor:
    """The cache of token-major K/V ``[tokens, kv_heads, dim]`` in consecutive blocks
    (the last padded with zeros)."""
    tokens, heads, dim = keys.shape
    blocks = -(-tokens // block_size)
    k_at, v_at = offsets(layout, block_size, dim)
    cache = keys.new_zeros(blocks, heads, 2, block_size * dim)
    for name, source, at in (("k", keys, k_at), ("v", values, v_at)):
        padded = torch.cat([source, source.new_zeros(blocks * block_size - tokens, heads, dim)])
        by_block = padded.view(blocks, block_size, heads, dim).permute(0, 2, 1, 3)
        half = cache[:, :, 0 if name == "k" else 1]
        half[:, :, at.reshape(-1)] = by_block.reshape(blocks, heads, -1)
    return cache.view(blocks, heads, block_size, 2 * dim)


def read_tokens(kv_cache: torch.Tensor, blocks: torch.Tensor, length: int,
                layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a block-table row's first ``length`` tokens, ``[tokens, kv_heads, dim]``."""
    num_blocks, heads, block_size, double = kv_cache.shape
    dim = double // 2
    halves = kv_cache.view(num_blocks, heads, 2, block_size * dim)
    n = -(-length // block_size)
    index = blocks[:n].long()
    k_at, v_at = offsets(layout, block_size, dim)
    out = []
    for half, at in ((0, k_at), (1, v_at)):
        picked = halves[index, :, half][:, :, at.reshape(-1)]  # [n, heads, block_size * dim]
        out.append(picked.view(n, heads, block_size, dim).permute(0, 2, 1, 3)
                   .reshape(-1, heads, dim)[:length])
    return out[0], out[1]
