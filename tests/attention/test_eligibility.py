"""The one rule for which layers Feather's kernels serve (``attention.eligibility``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from feather_sched.attention import cpu_kernel, triton_kernels
from feather_sched.attention.eligibility import (
    CPU_KERNEL,
    TRITON_KERNEL,
    LayerTraits,
    layer_problem,
)

PLAIN = LayerTraits(head_size=128, cache_dtype=torch.bfloat16, query_dtype=torch.bfloat16)
CPU_PLAIN = replace(PLAIN, kv_layout="vec")


@pytest.mark.parametrize(("change", "reason"), [
    ({"decoder_self_attention": False}, "cross or non-decoder attention"),
    ({"sliding_window": True}, "a sliding window"),
    ({"alibi": True}, "ALiBi"),
    ({"soft_cap": True}, "soft-capping"),
    ({"sinks": True}, "attention sinks"),
    ({"query_temperature": True}, "a per-position query temperature"),
    ({"quantized_kv": True}, "a quantized KV cache"),
    ({"cache_dtype": torch.float8_e4m3fn, "query_dtype": torch.float8_e4m3fn},
     "a torch.float8_e4m3fn KV cache"),
    ({"query_dtype": torch.float32}, "a query dtype unlike the cache's"),
    ({"v_head_size": 64}, "unequal K and V head sizes"),
    ({"pool_slots": 100, "page_size": 16}, "a pool of 100 slots, not whole pages"),
])
@pytest.mark.parametrize("kernel", [CPU_KERNEL, TRITON_KERNEL], ids=["cpu", "triton"])
def test_each_term_beyond_plain_causal_attention_is_named(change, reason, kernel):
    layer = CPU_PLAIN if kernel is CPU_KERNEL else PLAIN
    assert layer_problem(layer, kernel) is None
    assert layer_problem(replace(layer, **change), kernel) == reason


def test_the_first_problem_is_the_one_named():
    layer = replace(PLAIN, sliding_window=True, soft_cap=True, query_dtype=torch.float32)
    assert layer_problem(layer, TRITON_KERNEL) == "a sliding window"


def test_equal_value_heads_and_whole_pages_are_served():
    layer = replace(CPU_PLAIN, v_head_size=128, pool_slots=4096, page_size=16, kv_layout="nhd")
    assert layer_problem(layer, CPU_KERNEL) is None


@pytest.mark.parametrize(("size", "cpu", "triton"), [
    (16, True, True), (64, True, True), (80, True, False), (96, True, False),
    (128, True, True), (256, True, True), (8, False, False), (72, False, False),
])
def test_head_sizes_are_each_kernels_own(size, cpu, triton):
    """The CPU kernel reads multiples of 16 (its 16-lane loop), the Triton kernels powers
    of two from 16 (``tl.arange``, ``tl.dot``): vLLM's CPU sizes 80, 96 and 112 are served
    there, not on a GPU."""
    layer = replace(PLAIN, head_size=size)
    assert (layer_problem(replace(layer, kv_layout="vec"), CPU_KERNEL) is None) == cpu
    assert (layer_problem(layer, TRITON_KERNEL) is None) == triton
    if not cpu:
        assert layer_problem(replace(layer, kv_layout="vec"), CPU_KERNEL) == (
            f"head size {size} (the CPU kernel takes {cpu_kernel.HEAD_SIZES})")
    if not triton:
        assert layer_problem(layer, TRITON_KERNEL) == (
            f"head size {size} (the Triton kernel takes {triton_kernels.HEAD_SIZES})")


def test_the_cpu_kernel_reads_its_named_layouts_packed():
    assert layer_problem(replace(PLAIN, kv_layout="amx"), CPU_KERNEL) is None
    assert layer_problem(replace(PLAIN, kv_layout="neon"), CPU_KERNEL) == "KV layout 'neon'"
    assert layer_problem(PLAIN, CPU_KERNEL) == "KV layout 'None'"
    assert layer_problem(replace(CPU_PLAIN, cache_contiguous=False), CPU_KERNEL) == (
        "a strided KV cache")
    assert layer_problem(replace(CPU_PLAIN, query_packed=False), CPU_KERNEL) == (
        "query heads not packed")


def test_the_triton_kernels_read_any_strides_of_any_paged_cache():
    layer = replace(PLAIN, kv_layout="NHD", cache_contiguous=False, query_packed=False)
    assert layer_problem(layer, TRITON_KERNEL) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_both_kernels_read_the_float_caches(dtype):
    layer = replace(CPU_PLAIN, cache_dtype=dtype, query_dtype=dtype)
    assert layer_problem(layer, CPU_KERNEL) is None
    assert layer_problem(layer, TRITON_KERNEL) is None
