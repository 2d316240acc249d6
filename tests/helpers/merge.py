"""The exact merge of two partial attentions in torch: the reference the CPU kernel's
in-place merge (``feather_merge_halves``) is tested against; itself tested against the
float64 reference in ``tests/attention/test_partials.py``."""

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
