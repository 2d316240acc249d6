"""A float64 stand-in for FlashAttention's paged varlen call, where FA3 cannot run.

``float64_flash_attn_varlen_func`` takes the keyword arguments vLLM 0.32's FLASH_ATTN
forward passes to ``vllm_flash_attn.flash_attn_varlen_func`` (through
``FA4DenseAttentionKernel``) and writes what that call computes for the features
Feather's path serves (causal paged attention, no window, ALiBi, soft-capping, sinks or
mask), in float64, rounded once into ``out``.  Tests put it in place of the real call,
so vLLM's own FLASH_ATTN builder and forward run on this CPU around it.
"""

from __future__ import annotations

import torch

from feather_sched.attention.partials import reference_attention


def float64_flash_attn_varlen_func(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   out: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                   seqused_k: torch.Tensor, softmax_scale: float,
                                   causal: bool, block_table: torch.Tensor,
                                   window_size: list[int] | None = None,
                                   alibi_slopes: torch.Tensor | None = None,
                                   softcap: float = 0.0, s_aux: torch.Tensor | None = None,
                                   mask_mod: object = None, **_: object) -> torch.Tensor:
    """``out[t]`` = attention of query token ``t`` over its sequence's first ``seqused_k``
    tokens (causal: the last query token sees them all, earlier ones one fewer each),
    read through ``block_table`` from ``k``/``v`` ``[blocks, block_size, kv_heads, dim]``."""
    if window_size not in (None, [-1, -1]) or alibi_slopes is not None or softcap or \
            s_aux is not None or mask_mod is not None:
        raise NotImplementedError("the float64 stand-in computes plain causal attention")
    block_size = k.shape[1]
    starts = cu_seqlens_q.tolist()
    for i, length in enumerate(seqused_k[:len(starts) - 1].tolist()):
        blocks = block_table[i, :-(-length // block_size)].long()
        keys = k[blocks].flatten(0, 1)[:length]
        values = v[blocks].flatten(0, 1)[:length]
        count = starts[i + 1] - starts[i]
        for j in range(count):
            visible = length - (count - 1 - j) if causal else length
            row = starts[i] + j
            out[row] = reference_attention(q[row], keys[:visible], values[:visible],
                                           softmax_scale)[0].to(out.dtype)
    return out
