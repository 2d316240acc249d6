"""Shared-prefix decode attention inside vLLM's CPU backend (vLLM 0.32-0.34).

The plug-in ``plugins.register_attention`` points vLLM's ``CPU_ATTN`` backend, by name,
at ``SharedPrefixCPUBackend``: a subclass that behaves exactly as vLLM's own in an engine
that did not choose Feather (``choice.feather_chosen``), and otherwise unless
``shared_prefix_attention`` turns it on (``on``, or ``auto`` with ``FeatherScheduler``
where the self-check at engine start, ``self_check``, measured the path exact and
faster).  Where on, each step's builder finds the decode rows that share leading KV
blocks (``attention.groups``) and hands vLLM's kernel the batch with those rows cut to one
token; each layer then runs vLLM's kernel once and replaces the grouped rows' outputs
with the exact merge of each group's prefix, attended once, and each row's suffix.

Where it cannot act, vLLM's path runs unchanged and the engine log says why, once
(``attention.eligibility`` for layers).  docs/vllm.md, "Shared-prefix attention".
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import CrossAttentionSpec, EncoderOnlyAttentionSpec

from feather_sched.attention import cpu_kernel
from feather_sched.attention.eligibility import CPU_KERNEL, LayerTraits, layer_problem
from feather_sched.attention.groups import BySize, StepPlan, min_blocks, plan_step
from feather_sched.attention.isolation import run_isolated
from feather_sched.attention.selfcheck import Verdict, cached_check
from feather_sched.integrations.vllm import compat
from feather_sched.integrations.vllm.attention_choice import (
    announce,
    attention_options,
    checked,
    decide,
)
from feather_sched.integrations.vllm.choice import feather_chosen


def self_check(vllm_config: Any, kv_cache_spec: Any, isa: str) -> Verdict:
    """``auto``'s verdict for this engine's shapes (``attention.selfcheck``: vLLM's CPU
    kernel against the path on a random cache), cached per CPU, versions and shapes (this
    rank's; ``checked`` has the ranks agree)."""
    from feather_sched.integrations.vllm.attention_check import CpuSubject, Geometry, versions

    model = vllm_config.model_config
    geometry = Geometry(model.get_num_attention_heads(vllm_config.parallel_config),
                        kv_cache_spec.num_kv_heads, kv_cache_spec.head_size)
    subject = CpuSubject(geometry, model.dtype, kv_cache_spec.block_size,
                         vllm_config.scheduler_config.max_num_seqs, model.max_model_len,
                         versions())
    if subject.shapes.layout != isa:
        raise RuntimeError(f"the self-check would measure layout {subject.shapes.layout}, "
                           f"the engine uses {isa}")
    if cpu_kernel.tiles_need_isolation():
        return cached_check(subject.recipe(), run_isolated)
    return cached_check(subject)


@dataclass
class SharedPrefixMetadata(CPUAttentionMetadata):
    """vLLM's CPU metadata for the batch with grouped rows cut to one token, the step's
    plan, and the unmodified metadata for layers that cannot act."""

    plan: StepPlan | None = None
    original: CPUAttentionMetadata | None = None
    use_tiles: bool = False
    """Multiply in the kernel's AMX tiles (``cpu_kernel.tiles_proven``)."""


class SharedPrefixCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's builder, plus the step's prefix groups where shared prefixes are on."""

    shared_prefixes = False
    """Whether this engine's steps are grouped (never where it did not choose Feather)."""
    use_tiles = False
    """Whether the kernel multiplies in AMX tiles (only where a verdict measured them)."""
    by_size: BySize = ()
    """The verdict's break-even per group size (none where the option sets the length)."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if feather_chosen(vllm_config):
            self._choose(vllm_config, kv_cache_spec)

    def _choose(self, vllm_config: Any, kv_cache_spec: Any) -> None:
        """Decide, once, whether this engine's steps are grouped, and say so."""
        try:
            mode, min_tokens = attention_options(vllm_config)
        except ValueError as error:
            announce(f"off: {error}")
            return
        reason = decide(vllm_config, mode) or self._layout_problem(kv_cache_spec)
        default_tokens = cpu_kernel.MIN_SHARED_TOKENS_BY_LAYOUT.get(self.isa, 0)
        verdict = None
        if reason is None and mode == "auto":
            verdict, reason = checked(lambda: self_check(vllm_config, kv_cache_spec, self.isa))
            default_tokens = (verdict and verdict.min_shared_tokens) or default_tokens
        self.shared_prefixes = reason is None
        self.use_tiles = cpu_kernel.tiles_proven(verdict)
        self.min_shared_blocks = min_blocks(self.block_size, min_tokens or default_tokens)
        self.by_size = () if min_tokens or verdict is None else verdict.by_size
        kernel = "" if reason else f"kernel in {cpu_kernel.path(self.use_tiles)}"
        announce(reason or (verdict.line(kernel) if verdict else
                            f"on (isa {self.isa}, {self.dtype}, block size {self.block_size}, "
                            f"{kernel}, groups from {self.min_shared_blocks} shared blocks)"))

    def _layout_problem(self, kv_cache_spec: Any) -> str | None:
        if isinstance(kv_cache_spec, CrossAttentionSpec | EncoderOnlyAttentionSpec):
            return "off for cross and encoder-only attention"
        if self.isa not in cpu_kernel.LAYOUT_CODES:
            return (f"off: the kernel reads the {sorted(cpu_kernel.LAYOUT_CODES)} KV layouts, "
                    f"this engine uses '{self.isa}'")
        if self.kv_cache_dtype != "auto" or self.dtype not in cpu_kernel.DTYPE_CODES:
            return f"off: KV cache dtype {self.kv_cache_dtype} / {self.dtype}"
        try:
            cpu_kernel.vectorized()
        except cpu_kernel.KernelUnavailable as error:
            return f"off: {error}"
        return None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CPUAttentionMetadata:
        original = super().build(common_prefix_len, common_attn_metadata, fast_build)
        plan = self._plan(common_attn_metadata)
        if plan is None:
            return original
        cut = replace(common_attn_metadata, seq_lens=plan.seq_lens)
        metadata = super().build(common_prefix_len, cut, fast_build)
        values = {f.name: getattr(metadata, f.name) for f in fields(CPUAttentionMetadata)}
        return SharedPrefixMetadata(**values, plan=plan, original=original,
                                    use_tiles=self.use_tiles)

    def _plan(self, common: CommonAttentionMetadata) -> StepPlan | None:
        """The step's groups; None at once where no row is long enough to hold a group's
        shortest prefix (``max_seq_len`` bounds every row: O(1), where an "amx" cache's
        8K-token threshold is above every prompt of most workloads)."""
        if not self.shared_prefixes or common.causal is not True or \
                common.max_seq_len < self.min_shared_blocks * self.block_size:
            return None
        return plan_step(common.block_table_tensor, common.seq_lens,
                         common.query_start_loc_cpu, common.num_reqs, self.block_size,
                         self.min_shared_blocks, self.by_size)


class SharedPrefixCPUImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, then the grouped rows from their prefix and suffix parts."""

    acts: bool | None = None
    """Whether this layer can act (decided at its first grouped step)."""

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(attn_metadata, SharedPrefixMetadata) or attn_metadata.plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if not self._acts(layer, query, kv_cache):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata.original,
                                   output, output_scale, output_block_scale)
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                        output_scale, output_block_scale)
        cpu_kernel.attend_groups(attn_metadata.plan, query, kv_cache, self.scale, output,
                                 layer.isa, attn_metadata.use_tiles)
        return output

    def _acts(self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        if self.acts is None:
            reason = self._layer_problem(layer, query, kv_cache)
            self.acts = reason is None
            if reason:
                announce(f"off for layers with {reason} (vLLM's kernel serves them)")
        return self.acts

    def _layer_problem(self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
        """What in this layer the CPU kernel does not compute (``eligibility``), or None."""
        return layer_problem(LayerTraits(
            head_size=self.head_size, cache_dtype=kv_cache.dtype, query_dtype=query.dtype,
            decoder_self_attention=self.attn_type == AttentionType.DECODER,
            sliding_window=self.sliding_window != -1, alibi=self.alibi_slopes is not None,
            soft_cap=bool(self.logits_soft_cap), sinks=self.sinks is not None,
            quantized_kv=compat.is_quantized_kv_cache(self.kv_cache_dtype),
            kv_layout=getattr(layer, "isa", None), cache_contiguous=kv_cache.is_contiguous(),
            query_packed=query.stride(2) == 1 and query.stride(1) == query.shape[2]),
            CPU_KERNEL)


class SharedPrefixCPUBackend(CPUAttentionBackend):
    """vLLM's CPU_ATTN backend with Feather's builder and forward (same name, so vLLM's
    checks on the backend name, e.g. the NIXL connector's, still hold)."""

    @staticmethod
    def get_impl_cls() -> type[SharedPrefixCPUImpl]:
        return SharedPrefixCPUImpl

    @staticmethod
    def get_builder_cls() -> type[SharedPrefixCPUMetadataBuilder]:
        return SharedPrefixCPUMetadataBuilder
