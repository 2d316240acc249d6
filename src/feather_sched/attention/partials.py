"""Partial attentions and their exact merge; the float64 reference the tests compare with.

A partial is attention over part of a query's context: its output normalised over that
part and the part's log-sum-exp of scaled scores, in natural log (vLLM's convention:
``merge_attn_states`` and ``lse_base_on_e``; FlashInfer's cascade uses base 2, and
mixing the two silently corrupts outputs). Merging partials over disjoint parts by
their LSE gives exactly the attention over the union.
"""

from __future__ import annotations

import torch


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint parts, in fp32.

    ``out_*``: ``[rows, heads, head_dim]`` fp32 partials; ``lse_*``: ``[rows, heads]``
    natural-log LSE, -inf for a part with no tokens (its weight is then 0; a row with no
    tokens in either part gives 0). Cost: a few elementwise passes over the partials.
    """
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight_a = torch.exp(lse_a - top).unsqueeze(-1)
    weight_b = torch.exp(lse_b - top).unsqueeze(-1)
    total = weight_a + weight_b
    merged = (weight_a * out_a + weight_b * out_b) / torch.where(total > 0, total, 1.0)
    return merged


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
