"""The exact merge of partial attentions, against the float64 reference."""

from __future__ import annotations

import torch

from feather_sched.attention.partials import reference_attention
from tests.helpers.merge import merge_partials


def test_merging_two_parts_gives_attention_over_their_union():
    torch.manual_seed(0)
    q = torch.randn(8, 32) * 3
    keys, values = torch.randn(50, 2, 32), torch.randn(50, 2, 32)
    whole, whole_lse = reference_attention(q, keys, values, 0.2)
    first, first_lse = reference_attention(q, keys[:37], values[:37], 0.2)
    rest, rest_lse = reference_attention(q, keys[37:], values[37:], 0.2)
    merged = merge_partials(first.float()[None], first_lse.float()[None],
                            rest.float()[None], rest_lse.float()[None])
    assert merged.dtype == torch.float32
    assert torch.allclose(merged[0].double(), whole, atol=1e-6)
    assert torch.allclose(torch.logaddexp(first_lse, rest_lse), whole_lse)


def test_a_part_without_tokens_weighs_nothing():
    q = torch.randn(4, 16)
    keys, values = torch.randn(9, 4, 16), torch.randn(9, 4, 16)
    out, lse = reference_attention(q, keys, values, 0.25)
    empty, empty_lse = reference_attention(q, keys[:0], values[:0], 0.25)
    assert torch.isinf(empty_lse).all() and not empty.any()
    merged = merge_partials(empty.float()[None], empty_lse.float()[None],
                            out.float()[None], lse.float()[None])
    assert torch.allclose(merged[0].double(), out, atol=1e-6)
    nothing = merge_partials(empty.float()[None], empty_lse.float()[None],
                             empty.float()[None], empty_lse.float()[None])
    assert not nothing.isnan().any() and not nothing.any()


def test_lse_is_natural_log():
    q = torch.zeros(1, 8)
    keys, values = torch.zeros(5, 1, 8), torch.ones(5, 1, 8)
    _, lse = reference_attention(q, keys, values, 1.0)
    assert torch.allclose(lse, torch.log(torch.tensor([5.0], dtype=torch.float64)))
