"""Which attention layers Feather's shared-prefix kernels can serve: one rule for every
engine.

An engine adapter translates one of its layers into ``LayerTraits`` (what the layer
computes and how its KV and queries are laid out) and asks ``layer_problem`` with the
kernel it would run (``CPU_KERNEL``, ``TRITON_KERNEL``); the answer is the first thing
the kernel does not compute, worded for the engine's log line ("off for layers with
{reason}"), or None where the kernel serves the layer.  The kernels compute plain causal
softmax attention of a decoder over its own cache (``partials.reference_attention``): any
term beyond it (a window, ALiBi, soft-capping, sinks, a query temperature) makes a layer
the engine's own kernel keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from feather_sched.attention import cpu_kernel, triton_kernels


@dataclass(frozen=True)
class LayerTraits:
    """One attention layer as the kernels see it: an engine's layer, translated."""

    head_size: int
    """Each query and key head's width."""
    cache_dtype: torch.dtype
    """The dtype the KV cache's tensors hold."""
    query_dtype: torch.dtype
    """The dtype of the queries the layer attends with."""
    decoder_self_attention: bool = True
    """A decoder's causal attention over its own tokens (not cross, encoder or
    bidirectional attention)."""
    sliding_window: bool = False
    alibi: bool = False
    soft_cap: bool = False
    sinks: bool = False
    query_temperature: bool = False
    """Queries scaled by a per-position temperature (SGLang's ``xai_temperature_len``)."""
    quantized_kv: bool = False
    """The engine stores the KV cache quantized (fp8 or int8: its scales live outside the
    tensors the kernels read)."""
    v_head_size: int | None = None
    """The value heads' width where the layer has its own (None: ``head_size``)."""
    kv_layout: str | None = None
    """The engine's name for its KV cache layout where a kernel reads named layouts
    (``cpu_kernel.LAYOUT_CODES``); None: paged ``[blocks, block_size, heads, dim]`` tensors
    of any strides (what the Triton kernels read)."""
    cache_contiguous: bool = True
    """The KV cache tensor is contiguous."""
    query_packed: bool = True
    """Each query token's heads are packed (head stride ``head_size``, dim stride 1)."""
    pool_slots: int | None = None
    """The slots of a token-major KV pool whose pages the kernels read whole (SGLang's);
    None: a block cache."""
    page_size: int = 1
    """Tokens per page of that pool."""


@dataclass(frozen=True)
class Kernel:
    """What one of Feather's kernels reads, beyond plain causal attention."""

    name: str
    head_sizes: str
    """Its head sizes, as the log line names them."""
    head_size_fits: Callable[[int], bool]
    dtypes: frozenset[torch.dtype]
    """The cache and query dtypes it reads (one dtype for both)."""
    layouts: frozenset[str] | None
    """The KV layouts it reads by name; None: any paged tensors' strides."""
    strided: bool
    """Whether it reads a strided cache and unpacked query heads."""


CPU_KERNEL = Kernel("CPU", cpu_kernel.HEAD_SIZES, cpu_kernel.head_size_fits,
                    frozenset(cpu_kernel.DTYPE_CODES), frozenset(cpu_kernel.LAYOUT_CODES),
                    strided=False)
"""``cpu_kernel``: vLLM's CPU cache layouts and token-major pools."""
TRITON_KERNEL = Kernel("Triton", triton_kernels.HEAD_SIZES, triton_kernels.head_size_fits,
                       frozenset(triton_kernels.DTYPES), None, strided=True)
"""``triton_kernels`` (through ``gpu_decode``): paged GPU caches of any strides."""


def layer_problem(layer: LayerTraits, kernel: Kernel) -> str | None:
    """The first thing in ``layer`` that ``kernel`` does not compute, as the engine's log
    line says it ("off for layers with ..."), or None where the kernel serves it."""
    return next((reason for reason, present in _problems(layer, kernel) if present), None)


def _problems(layer: LayerTraits, kernel: Kernel) -> list[tuple[str, bool]]:
    """Each reason with whether ``layer`` has it: what it computes, then its dtypes and
    shapes, then its memory layout."""
    size, v_size = layer.head_size, layer.v_head_size
    pages = layer.pool_slots is not None and layer.pool_slots % layer.page_size != 0
    return [
        ("cross or non-decoder attention", not layer.decoder_self_attention),
        ("a sliding window", layer.sliding_window),
        ("ALiBi", layer.alibi),
        ("soft-capping", layer.soft_cap),
        ("attention sinks", layer.sinks),
        ("a per-position query temperature", layer.query_temperature),
        ("a quantized KV cache", layer.quantized_kv),
        (f"a {layer.cache_dtype} KV cache", layer.cache_dtype not in kernel.dtypes),
        ("a query dtype unlike the cache's", layer.query_dtype != layer.cache_dtype),
        ("unequal K and V head sizes", v_size is not None and v_size != size),
        (f"head size {size} (the {kernel.name} kernel takes {kernel.head_sizes})",
         not kernel.head_size_fits(size)),
        (f"KV layout '{layer.kv_layout}'",
         kernel.layouts is not None and layer.kv_layout not in kernel.layouts),
        ("a strided KV cache", not kernel.strided and not layer.cache_contiguous),
        ("query heads not packed", not kernel.strided and not layer.query_packed),
        (f"a pool of {layer.pool_slots} slots, not whole pages", pages),
    ]
