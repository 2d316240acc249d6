"""Shared-prefix decode in SGLang's Triton backend: on SGLang's own pools, SGLang's own
Triton decode kernel (``decode_attention_fwd``) over the batch with grouped rows cut, then
Feather's grouped decode over the pool, in Triton's interpreter, against float64.

The cache is fp16 and the tolerance bf16's: SGLang's decode kernel returns garbage for
bf16 in the interpreter (its bf16 arithmetic is numpy's there, not the GPU's), and
Feather's kernels are checked in bf16 on their own (``tests/attention``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from feather_sched.bench.cht.sglang_policy import sglang_installed
from tests.helpers.triton_interpreter import INTERPRETED, run_interpreted

if not sglang_installed():
    pytest.skip("SGLang is not installed (scripts/setup.sh --sglang)", allow_module_level=True)

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

from feather_sched.attention.gpu_decode import DecodeLimits, GroupedDecode
from feather_sched.attention.partials import reference_attention
from feather_sched.integrations.sglang import attention

interpreted = pytest.mark.skipif(not INTERPRETED, reason="run by the fresh process that "
                                 "test_kernels_in_the_triton_interpreter starts")
DIM, SLOTS = 64, 4096


def test_kernels_in_the_triton_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("this is that process")
    result = run_interpreted(__file__)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def sglang_decode(q, keys, values, out, slot_rows, lens, page):
    """SGLang's Triton decode kernel over rows of slots, with the metadata its backend
    builds for a decode batch (``kv_indptr`` from the lengths, ``kv_indices`` the rows'
    slots, fp32 split logits and LSE)."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    splits = 4
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    indices = torch.cat([row[:n] for row, n in zip(slot_rows, lens.tolist(), strict=True)])
    rows, heads = q.shape[:2]
    decode_attention_fwd(q, keys, values, out, indptr, indices.long(),
                         torch.empty(rows, heads, splits, DIM), torch.empty(rows, heads, splits),
                         torch.full((rows,), splits, dtype=torch.int32), splits, DIM ** -0.5,
                         1.0, 1.0, page_size=page)


@interpreted
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("page", [1, 16])
def test_grouped_rows_by_feathers_kernels_and_the_rest_by_sglangs(q_heads, kv_heads, page):
    from feather_sched.integrations.sglang.attention_triton import TritonStep

    rng = np.random.default_rng(page)
    generator = torch.Generator().manual_seed(q_heads)
    pool = MHATokenToKVPool(size=SLOTS, page_size=page, dtype=torch.float16,
                            head_num=kv_heads, head_dim=DIM, layer_num=1, device="cpu",
                            enable_memory_saver=False)
    keys, values = pool.k_buffer[0], pool.v_buffer[0]
    for buffer in (keys, values):
        buffer.copy_(torch.randn(buffer.shape, generator=generator).to(torch.float16))
    free = rng.permutation(np.arange(1, SLOTS // page)).tolist()  # page 0: padding

    def allocate(tokens: int) -> list[int]:
        pages = [free.pop() for _ in range(-(-tokens // page))]
        return [p * page + i for p in pages for i in range(page)][:tokens]

    a, b = allocate(160), allocate(96)
    rows = [a + allocate(21), allocate(130), b + allocate(5), a + allocate(1),
            b + allocate(40), a + allocate(33), b + allocate(70)]
    grouped = {0, 2, 3, 4, 5, 6}
    req_to_token = ReqToTokenPool(size=16, max_context_len=512, device="cpu",
                                  enable_memory_saver=False)
    table = req_to_token.req_to_token
    table[:] = torch.from_numpy(rng.integers(1, SLOTS, table.shape).astype(np.int32))
    pool_rows = torch.from_numpy(rng.permutation(np.arange(1, 17))[:len(rows)].astype(np.int64))
    for at, row in zip(pool_rows.tolist(), rows, strict=True):
        table[at, :len(row)] = torch.tensor(row, dtype=torch.int32)
    lens = torch.tensor([len(r) for r in rows])
    decode = GroupedDecode(DecodeLimits.for_device(1, 16, q_heads, kv_heads, DIM), "cpu")
    step = TritonStep.plan(decode, table, pool_rows, lens, page, 64)
    assert step is not None and set(step.groups.rows.tolist()) == grouped
    assert sorted(step.groups.shared.tolist()) == [96 // page, 160 // page]  # pages
    assert step.cut_lens.tolist() == [1 if i in grouped else n for i, n in enumerate(lens)]

    query = torch.randn(len(rows), q_heads, DIM, generator=generator).to(torch.float16)
    out = torch.empty_like(query)
    sglang_decode(query, keys, values, out, [table[r] for r in pool_rows], step.cut_lens, page)
    sglangs = out.clone()
    step.attend(decode, query, keys, values, DIM ** -0.5, out)
    for row, slots in enumerate(rows):
        index = torch.tensor(slots)
        expected, _ = reference_attention(query[row], keys[index], values[index], DIM ** -0.5)
        error = (out[row].double() - expected).norm() / expected.norm()
        assert error < 2e-2, (row, float(error))
        if row not in grouped:  # SGLang's kernel served it, untouched
            assert torch.equal(out[row], sglangs[row])


def test_fa3_and_flashinfer_stay_sglangs_with_the_reason_logged(monkeypatch, caplog):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    monkeypatch.setattr(attention, "_announced", set())
    caplog.set_level(logging.INFO, logger=attention.logger.name)
    attention.register()
    attention.register()  # idempotent: SGLang's factory stays the one wrapped
    made = []
    monkeypatch.setattr(ATTENTION_BACKENDS["fa3"], "sglangs", made.append)
    runner = SimpleNamespace()
    ATTENTION_BACKENDS["fa3"](runner)
    assert made == [runner]
    assert "off for the fa3 backend: its decode is FlashAttention-3's" in caplog.text
    assert ATTENTION_BACKENDS["triton"].__name__ == "create_feather_triton_backend"


def test_triton_acts_only_on_a_cuda_device():
    runner = SimpleNamespace(device="cpu", use_mla_backend=False, token_to_kv_pool=None)
    assert attention.decide("triton", runner, "on", True).startswith(
        "off for device cpu (the triton path runs on CUDA devices)")
    assert attention.decide("triton", runner, "auto", True).startswith(
        "off (auto: not verified on the triton backend")
