"""Partial attentions and the float64 reference the tests and the self-check compare with.

A partial is attention over part of a query's context: its output normalised over that
part and the part's log-sum-exp of scaled scores, in natural log (vLLM's convention:
``merge_attn_states`` and ``lse_base_on_e``; FlashInfer's cascade uses base 2, and
mixing the two silently corrupts outputs). Merging partials over disjoint parts by
their LSE gives exactly the attention over the union (the CPU kernel's
``feather_merge_halves``, the Triton kernels' ``merge_partials``).
"""

from __future__ import annotations

import torch


def reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention of one query token over a token list, and its LSE.

    ``query`` ``[q_heads, head_dim]``; ``keys``/``values`` ``[tokens, kv_heads, head_dim]``
    (query heads share KV heads in order, GQA). Returns ``([q_heads, head_dim],
    [q_heads])``; no tokens gives zeros and -inf.
    """
    q_heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    if not len(keys):
        return (torch.zeros(q_heads, head_dim, dtype=torch.float64),
                torch.full((q_heads,), -torch.inf, dtype=torch.float64))
    q = query.double().view(kv_heads, q_heads // kv_heads, head_dim)
    scores = torch.einsum("hgd,thd->hgt", q, keys.double()) * scale
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hgt,thd->hgd", torch.softmax(scores, -1), values.double())
    return out.reshape(q_heads, head_dim), lse.reshape(q_heads)
