"""Shared-prefix decode attention on vLLM 0.32's GPU path: a variant of its TRITON_ATTN backend
(a vLLM general plugin, selected with ``--attention-backend CUSTOM``).  Never run on a GPU:
``auto`` leaves it off there.

Where on, each step's builder (``SharedPrefixTritonMetadataBuilder``) finds the decode rows
sharing leading KV blocks (``feather_sched.attention.groups``) and hands vLLM's Triton
kernel the batch with those rows cut to one token; each layer's forward
(``SharedPrefixTritonImpl``) then overwrites the grouped rows with the exact LSE merge of
Feather's Triton kernels (``attention.triton_kernels``): one segment per group over its
prefix, one per grouped row over its suffix (``attend_groups``).

Invariants: with ``auto`` (default) or ``off``, CUSTOM behaves exactly as TRITON_ATTN (same
``get_name``, same metadata); ungrouped rows, and KV-cache groups or layers that cannot act
(``decide_gpu``, ``_layer_problem``), keep vLLM's kernel and values exactly; while on,
attention is never captured in a CUDA graph (``AttentionCGSupport.NEVER``).  Cost while on:
per step that can group, one device-to-host copy of the block table's used columns (its
synchronisation loses that step's host/GPU overlap) and one host-to-device copy of the
grouped work.  Why each choice, and what is not verified: docs/vllm.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from feather_sched.attention import triton_kernels
from feather_sched.attention.groups import (
    MIN_ROWS,
    MIN_SHARED_TOKENS,
    Groups,
    find_groups,
    min_blocks,
    table_segments,
)
from feather_sched.attention.triton_kernels import TableSegments
from feather_sched.integrations.vllm.attention import announce, attention_options, decide

logger = logging.getLogger("vllm.feather_sched")

AUTO_OFF = "off: not yet verified on a GPU; shared_prefix_attention: on enables it"


def register() -> None:
    """Entry point: make ``--attention-backend CUSTOM`` select ``SharedPrefixTritonBackend``
    (leaves a CUSTOM backend another plugin registered in place, with a warning)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    ours = f"{__name__}.{SharedPrefixTritonBackend.__qualname__}"
    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != ours:
        logger.warning("Feather shared-prefix attention not registered: --attention-backend "
                       "CUSTOM already selects %s", custom.get_path())
        return
    register_backend(custom, ours)


def decide_gpu(vllm_config: Any, kv_cache_spec: Any) -> str | None:
    """Why a KV-cache group's attention stays on vLLM's path, or None where Feather's acts."""
    mode, _ = attention_options(vllm_config)
    if mode == "auto":
        return AUTO_OFF
    if reason := decide(vllm_config, mode):
        return reason
    parallel = vllm_config.parallel_config
    problems = {
        "off without prefix caching (no two rows can share a block)":
            not vllm_config.cache_config.enable_prefix_caching,
        "off with speculative decoding": vllm_config.speculative_config is not None,
        "off with context parallelism": max(parallel.decode_context_parallel_size,
                                            parallel.prefill_context_parallel_size) > 1,
        f"off: KV cache dtype {vllm_config.cache_config.cache_dtype}":
            is_quantized_kv_cache(vllm_config.cache_config.cache_dtype),
        f"off for {type(kv_cache_spec).__name__} layers":
            type(kv_cache_spec) is not FullAttentionSpec,
        "off for sliding-window, chunked or non-causal layers":
            bool(getattr(kv_cache_spec, "sliding_window", None)
                 or getattr(kv_cache_spec, "attention_chunk_size", None)
                 or getattr(kv_cache_spec, "non_causal", False)),
    }
    return next((name for name, present in problems.items() if present), None)


@dataclass(frozen=True)
class GroupWork:
    """One step's grouped rows, on the device: the Triton kernels' input."""

    tokens: Tensor
    """int32 [n]: query token (output row) of each grouped row, in ``groups.rows`` order."""
    prefix: TableSegments
    suffix: TableSegments
    longest: tuple[int, int]
    """Longest prefix and longest suffix (tokens): the split counts' bound."""
    num_sms: int


@dataclass
class SharedPrefixTritonMetadata(TritonAttentionMetadata):
    """vLLM's Triton metadata for the batch with grouped rows cut to one token, the step's
    grouped work, and the unmodified metadata (also for layers that cannot act)."""

    work: GroupWork | None = None
    original: TritonAttentionMetadata | None = None


class SharedPrefixTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    """vLLM's Triton builder, plus the step's prefix groups where shared prefixes are on."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        reason = decide_gpu(vllm_config, kv_cache_spec)
        self.shared_prefixes = reason is None
        _, min_tokens = attention_options(vllm_config)
        self.min_shared_blocks = min_blocks(self.block_size, min_tokens or MIN_SHARED_TOKENS)
        if self.shared_prefixes:
            from vllm.platforms import current_platform

            self.num_sms = current_platform.num_compute_units(device.index or 0)
        announce(reason or f"on (Triton, block size {self.block_size}, groups from "
                            f"{self.min_shared_blocks} shared blocks; attention without FULL "
                            "CUDA graphs; a device-to-host table copy per step that may group)")

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        """NEVER where the grouped path acts (host-side per step); TRITON_ATTN's otherwise."""
        if decide_gpu(vllm_config, kv_cache_spec) is None:
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TritonAttentionMetadata:
        original = super().build(common_prefix_len, common_attn_metadata, fast_build)
        found = self._groups(common_attn_metadata)
        if found is None:
            return original
        cut, work = self._device_work(*found, common_attn_metadata)
        metadata = super().build(common_prefix_len, cut, fast_build)
        values = {f.name: getattr(metadata, f.name) for f in fields(TritonAttentionMetadata)}
        return SharedPrefixTritonMetadata(**values, work=work, original=original)

    def _groups(self, common: CommonAttentionMetadata) -> tuple[Groups, Tensor] | None:
        """The step's groups and the batch's host ``seq_lens``, from host copies; None,
        without copying, where no group can form."""
        if (not self.shared_prefixes or common.causal is not True
                or common.mm_req_doc_ranges is not None
                or common.max_seq_len <= self.min_shared_blocks * self.block_size):
            return None
        num_reqs = common.num_reqs
        query_lens = np.diff(common.query_start_loc_cpu[:num_reqs + 1].numpy())
        if np.count_nonzero(query_lens == 1) < MIN_ROWS:
            return None
        width = -(-common.max_seq_len // self.block_size)
        table = common.block_table_tensor[:num_reqs, :width].cpu()  # waits for the GPU's queue
        seq_lens = common.seq_lens_cpu_upper_bound
        seq_lens = (common.seq_lens if seq_lens is None else seq_lens)[:num_reqs].cpu()
        groups = find_groups(table.numpy(), seq_lens.numpy(), query_lens, self.block_size,
                             self.min_shared_blocks)
        return (groups, seq_lens) if len(groups) else None

    def _device_work(self, groups: Groups, seq_lens: Tensor, common: CommonAttentionMetadata
                     ) -> tuple[CommonAttentionMetadata, GroupWork]:
        """The batch with grouped rows cut to one token, and their work, on the device."""
        prefix, suffix = table_segments(groups, seq_lens, self.block_size)
        tokens = common.query_start_loc_cpu.numpy()[groups.rows]
        tokens_d, *segments = _to_device(self.device, torch.from_numpy(tokens).to(torch.int32),
                                         *_tensors(prefix), *_tensors(suffix))
        prefix_d, suffix_d = TableSegments(*segments[:4]), TableSegments(*segments[4:])
        cut = common.seq_lens.index_fill(0, suffix_d.table_rows.long(), 1)
        longest = (int(prefix.lengths.max()), int(suffix.lengths.max()))
        work = GroupWork(tokens_d, prefix_d, suffix_d, longest, self.num_sms)
        return replace(common, seq_lens=cut), work


def _tensors(segments: TableSegments) -> list[Tensor]:
    return [getattr(segments, f.name) for f in fields(TableSegments)]


def _to_device(device: torch.device, *tensors: Tensor) -> list[Tensor]:
    """The int32 host ``tensors`` on ``device``, in one copy."""
    flat = torch.cat([t.flatten() for t in tensors]).to(device)
    return [part.view(t.shape) for part, t in
            zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]


def attend_groups(work: GroupWork, query: Tensor, key_cache: Tensor, value_cache: Tensor,
                  block_table: Tensor, scale: float, output: Tensor) -> None:
    """Overwrite the grouped rows of ``output`` (``[tokens, q_heads, head_dim]``) with their
    attention over the original ``block_table``: each group's prefix once for its queries,
    each row's suffix, merged by LSE in fp32 and cast once. Caches ``[blocks, block_size,
    kv_heads, head_dim]``. Cost: a gather of the grouped queries, two attention launches (each
    split-K where the grid is small, plus a merge of its splits) and one merge launch; no
    host synchronisation."""
    grouped = query.index_select(0, work.tokens)
    rows, heads, head_dim = grouped.shape
    parts = grouped.new_empty((2, rows, heads, head_dim), dtype=torch.float32)
    lse = grouped.new_empty((2, rows, heads), dtype=torch.float32)
    for i, (segments, longest) in enumerate(zip((work.prefix, work.suffix), work.longest,
                                                strict=True)):
        splits = triton_kernels.split_count(segments, grouped, key_cache.shape[2], longest,
                                            work.num_sms)
        triton_kernels.segment_attention(grouped, key_cache, value_cache, block_table,
                                         segments, scale, parts[i], lse[i], splits)
    triton_kernels.merge_partials(parts, lse, output, rows=work.tokens)


class SharedPrefixTritonImpl(TritonAttentionImpl):
    """vLLM's Triton attention, then the grouped rows from their prefix and suffix parts."""

    acts: bool | None = None
    """Whether this layer can act (decided at its first grouped step)."""

    def forward(self, layer: Any, query: Tensor, key: Tensor, value: Tensor,
                kv_cache: Tensor, attn_metadata: Any, output: Tensor,
                output_scale: Tensor | None = None,
                output_block_scale: Tensor | None = None) -> Tensor:
        if not isinstance(attn_metadata, SharedPrefixTritonMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if not self._acts(query, kv_cache, output_scale):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata.original,
                                   output, output_scale, output_block_scale)
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                        output_scale, output_block_scale)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        attend_groups(attn_metadata.work, query, key_cache, value_cache,
                      attn_metadata.original.block_table, self.scale, output)
        return output

    def _acts(self, query: Tensor, kv_cache: Tensor, output_scale: Tensor | None) -> bool:
        if self.acts is None:
            reason = self._layer_problem(query, kv_cache, output_scale)
            self.acts = reason is None
            if reason:
                announce(f"off for layers with {reason} (vLLM's kernel serves them)")
        return self.acts

    def _layer_problem(self, query: Tensor, kv_cache: Tensor,
                       output_scale: Tensor | None) -> str | None:
        size = self.head_size
        features = {"non-decoder attention": self.attn_type != AttentionType.DECODER,
                    "a sliding window": self.sliding_window != (-1, -1),
                    "ALiBi": self.alibi_slopes is not None,
                    "soft-capping": bool(self.logits_soft_cap),
                    "attention sinks": self.sinks is not None,
                    "a quantized KV cache": is_quantized_kv_cache(self.kv_cache_dtype),
                    "fused output quantization": output_scale is not None,
                    "a query dtype unlike the cache's": query.dtype != kv_cache.dtype,
                    f"head size {size} (not a power of two >= 16)": size < 16 or size & size - 1}
        return next((name for name, present in features.items() if present), None)


class SharedPrefixTritonBackend(TritonAttentionBackend):
    """vLLM's TRITON_ATTN backend with Feather's builder and forward (same name, so vLLM's
    checks on the backend name still hold)."""

    @staticmethod
    def get_impl_cls() -> type[SharedPrefixTritonImpl]:
        return SharedPrefixTritonImpl

    @staticmethod
    def get_builder_cls() -> type[SharedPrefixTritonMetadataBuilder]:
        return SharedPrefixTritonMetadataBuilder
