"""Shared-prefix decode attention on vLLM's GPU path (0.32-0.34), inside vLLM's own
default backends: FLASH_ATTN (FlashAttention 3 on Hopper, 2 on Ampere) and TRITON_ATTN.

Imported only when vLLM resolves one of them under an engine's configuration; their
builders behave exactly as vLLM's where the engine did not choose Feather, or where
``shared_prefix_attention`` leaves the path off (``auto`` acts only on a passing kernel
self-check and, on CUDA, an end-to-end proof on this machine).  Where on, each step finds
the decode rows sharing leading KV blocks from the host's block ids (``host_tables``),
stages the work in persistent device buffers (``attention.gpu_decode``), lets vLLM's
kernel run with the grouped rows cut to one token, then overwrites them with the exact
LSE merge of each group's prefix, attended once, and each row's suffix.  Every launch has
a fixed grid, so FULL decode CUDA graphs capture it, and a step that does not group
replays the same graph with empty work.  Where it cannot act, vLLM's path runs unchanged
and the log says why, once.  In full: docs/vllm.md#on-gpus.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import Tensor
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from feather_sched.attention import end_to_end
from feather_sched.attention.eligibility import TRITON_KERNEL, LayerTraits
from feather_sched.attention.eligibility import layer_problem as layer_problem_of
from feather_sched.attention.end_to_end import EndToEnd
from feather_sched.attention.gpu_decode import DecodeLimits, GroupedDecode
from feather_sched.attention.groups import (
    MIN_ROWS,
    MIN_SHARED_TOKENS,
    BySize,
    Groups,
    find_groups,
    min_blocks,
    worth_by_size,
)
from feather_sched.attention.selfcheck import Shapes, Verdict
from feather_sched.integrations.vllm import host_tables
from feather_sched.integrations.vllm.attention_choice import (
    announce,
    attention_options,
    checked,
    decide,
)
from feather_sched.integrations.vllm.choice import feather_chosen
from feather_sched.integrations.vllm.compat import is_quantized_kv_cache
from feather_sched.integrations.vllm.host_tables import HostRows

logger = logging.getLogger("vllm.feather_sched")

if TYPE_CHECKING:  # the mixins' attributes and super() calls are those of vLLM's classes
    from vllm.v1.attention.backend import AttentionImpl as _VllmImpl
    from vllm.v1.attention.backend import AttentionMetadataBuilder as _VllmBuilder
else:
    _VllmBuilder = _VllmImpl = object


def decide_gpu(vllm_config: Any, kv_cache_spec: Any) -> str | None:
    """Why a KV-cache group's configuration keeps vLLM's path whatever the option says,
    or None where Feather's can act."""
    import vllm.envs as envs

    parallel = vllm_config.parallel_config
    pass_config = getattr(vllm_config.compilation_config, "pass_config", None)
    problems = {
        "off with fused output quantization (compilation_config.pass_config."
        "fuse_attn_quant: the output is quantized, the path writes it unscaled)":
            bool(getattr(pass_config, "fuse_attn_quant", False)),
        "off in batch-invariant mode (VLLM_BATCH_INVARIANT: a grouped row's numerics "
        "would depend on its neighbours)": bool(envs.VLLM_BATCH_INVARIANT),
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


def layer_problem(impl: Any, model_dtype: torch.dtype, cache_dtype: torch.dtype,
                  v_head_size: int | None = None) -> str | None:
    """What in one layer's attention (a vLLM FLASH_ATTN or TRITON_ATTN impl) Feather's
    Triton kernels do not compute (``eligibility``), or None."""
    return layer_problem_of(LayerTraits(
        head_size=impl.head_size, cache_dtype=cache_dtype, query_dtype=model_dtype,
        decoder_self_attention=impl.attn_type == AttentionType.DECODER,
        sliding_window=tuple(impl.sliding_window or (-1, -1)) != (-1, -1),
        alibi=impl.alibi_slopes is not None, soft_cap=bool(impl.logits_soft_cap),
        sinks=getattr(impl, "sinks", None) is not None,
        quantized_kv=is_quantized_kv_cache(impl.kv_cache_dtype), v_head_size=v_head_size),
        TRITON_KERNEL)


def group_problem(vllm_config: Any, kv_cache_spec: Any, layer_names: list[str]) -> str | None:
    """``decide_gpu``, then the first layer of the group the kernels cannot serve: the
    whole group then keeps vLLM's path (one metadata per step serves all its layers)."""
    if reason := decide_gpu(vllm_config, kv_cache_spec):
        return reason
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    model_dtype = vllm_config.model_config.dtype
    for name, layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).items():
        if reason := layer_problem(layer.impl, model_dtype, kv_cache_spec.dtype,
                                   getattr(kv_cache_spec, "head_size_v", None)):
            return f"off for layers with {reason} ({name})"
    return None


END_TO_END_COMMAND = "feather attention-check --end-to-end --model DIR"
"""What turns ``auto`` on for a CUDA engine: its end-to-end proof (``attention.end_to_end``)."""


DECIDED: list[Shapes] = []
"""The shapes (the kernel check's key) of each GPU builder of this process the path acts
in: what ``attention_proof`` keeps its verdict by."""


@dataclass(frozen=True)
class Decision:
    """Whether the path may act (``reason``: why not), and whether ``auto``'s kernel check
    is still to decide (``check``)."""

    reason: str | None
    check: bool = False


def decision(mode: str, refused: str | None) -> Decision:
    """The decision before any check, from the option (``on``, ``auto``) and why the
    engine's configuration refuses the path (``decide``, ``group_problem``; None: it
    does not): pure."""
    if refused is not None:
        return Decision(refused)
    return Decision(None, check=mode == "auto")


def proven(reason: str | None, cuda: bool, proof: EndToEnd | None) -> str | None:
    """Why ``auto`` keeps vLLM's path after its kernel check (``reason``: the check's,
    None where it passed), or None where it acts: on CUDA only where an end-to-end proof
    kept for the same key passed (FULL-graph replay and the host mirror are not in the
    kernel check).  Pure."""
    if reason is not None or not cuda:
        return reason
    if proof is None:
        return (f"off (auto on CUDA: the kernel check passed, no end-to-end check has on "
                f"this machine; run {END_TO_END_COMMAND} to turn it on, or set "
                "shared_prefix_attention on)")
    return None if proof.passed else f"off (auto: {proof.line()})"


def full_graphs(compilation: Any) -> bool:
    """Whether the engine's CUDA-graph mode (read at each step: vLLM resolves it after
    the builders are made) has FULL graphs, which may replay any step's launches."""
    mode = compilation.cudagraph_mode
    return bool(mode and mode.has_full_cudagraphs())


@dataclass(frozen=True)
class Outcome:
    """The decision once ``auto``'s checks ran: why the path keeps vLLM's (``reason``;
    None: it acts), groups from ``min_tokens`` shared tokens (None: the default) and as
    ``by_size`` asks of their size, and the kernel check's verdict and the end-to-end
    proof where they ran."""

    reason: str | None
    min_tokens: int | None
    verdict: Verdict | None = None
    proof: EndToEnd | None = None
    by_size: BySize = ()


@dataclass(frozen=True)
class Step:
    """One build of a builder the path acts in, read once at its start: the decode rows'
    groups (``find_groups``; None: none formed, or no host rows), whether vLLM is
    capturing a graph, and whether the engine's mode has FULL graphs now."""

    groups: Groups | None
    capturing: bool
    full_graphs: bool

    @property
    def carries_work(self) -> bool:
        """Whether the metadata carries the work: groups to run, or a graph that may
        capture or replay the launches (then the work is cleared); otherwise it is
        vLLM's, and Feather stages, cuts and launches nothing.  Pure."""
        return self.groups is not None or self.capturing or self.full_graphs


@dataclass(frozen=True)
class GroupedPath:
    """What a builder keeps where the path acts, made once at engine start: the
    persistent work buffers (``decode``), the cut ``seq_lens`` buffer its graphs read
    (``cut``), how rows group (``block_size``, ``min_shared_blocks``, ``by_size``), and
    vLLM's compilation config, whose graph mode each step reads."""

    decode: GroupedDecode
    cut: Tensor
    block_size: int
    min_shared_blocks: int
    compilation: Any
    by_size: BySize = ()

    def step(self, common: CommonAttentionMetadata, host: HostRows | None,
             capturing: bool) -> Step:
        """The step's state: its groups read from ``host`` (None: no host block ids)."""
        groups = self.groups(common, host) if host is not None else None
        return Step(groups, capturing, full_graphs(self.compilation))

    def groups(self, common: CommonAttentionMetadata, host: HostRows) -> Groups | None:
        """The step's groups, or None where none can form (decided before any grouping
        where the batch is too short or has too few decode rows)."""
        if (common.causal is not True or common.mm_req_doc_ranges is not None
                or common.seq_lens_cpu_upper_bound is None
                or common.max_seq_len <= self.min_shared_blocks * self.block_size):
            return None
        num_reqs = len(host.rows)
        query_lens = np.diff(common.query_start_loc_cpu[:num_reqs + 1].numpy())
        if np.count_nonzero(query_lens == 1) < MIN_ROWS:
            return None
        groups = find_groups(host.table, host_seq_lens(common)[:num_reqs], query_lens,
                             self.block_size, self.min_shared_blocks, table_rows=host.rows)
        groups = worth_by_size(groups, self.by_size, self.block_size)
        return groups if len(groups) else None

    def cut_seq_lens(self, common: CommonAttentionMetadata, step: Step) -> Tensor:
        """Stage the step's groups into the work (cleared where there are none) and
        return the lengths vLLM's kernel reads, grouped rows cut to one token, in
        ``cut``."""
        if step.groups is None:
            self.decode.clear()
        else:
            self.decode.stage(step.groups, host_seq_lens(common),
                              common.query_start_loc_cpu.numpy(), self.block_size)
        return self.decode.cut_seq_lens(common.seq_lens, self.cut)


def host_seq_lens(common: CommonAttentionMetadata) -> np.ndarray:
    """The rows' exact lengths on the host (exact without speculative decoding, which
    ``decide_gpu`` refuses)."""
    return common.seq_lens_cpu_upper_bound.numpy()


def carrying(metadata_cls: type, metadata: Any, work: GroupedDecode) -> Any:
    """vLLM's metadata of the step as ``metadata_cls`` (its subclass adding ``work``):
    every init field as vLLM built it, as ``dataclasses.replace`` copies (which keeps
    the type).  vLLM 0.32-0.34's FlashAttention and Triton metadata are plain dataclasses,
    every field an init field."""
    kept = {f.name: getattr(metadata, f.name) for f in fields(metadata) if f.init}
    return metadata_cls(**kept, work=work)


class SharedPrefixBuilder(_VllmBuilder):
    """What Feather adds to a vLLM GPU metadata builder (a mixin placed before it)."""

    name: ClassVar[str]
    """The backend, as the log line names it."""
    metadata_cls: ClassVar[type]
    """The base metadata class with ``work``: what ``build`` returns where it acts."""
    engine_cls: ClassVar[type]
    engine_impl_cls: ClassVar[type]
    """vLLM's own builder and impl: the self-check's reference."""
    path: GroupedPath | None = None
    """What each step reads where the path acts (None: vLLM's builder, exactly)."""
    _capturing = False
    """Inside vLLM's ``build_for_cudagraph_capture`` (which calls ``build``): the work is
    carried, empty."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if feather_chosen(vllm_config):
            self._choose(vllm_config, kv_cache_spec, layer_names, device)

    def _choose(self, vllm_config: Any, kv_cache_spec: Any, layer_names: list[str],
                device: torch.device) -> None:
        """Decide, once, whether this engine's decode steps are grouped (``decision``),
        then its steps: ``auto``'s check (``_check``), ``_act``, ``_announce``."""
        try:
            mode, min_tokens = attention_options(vllm_config)
        except ValueError as error:
            announce(f"off: {error}")
            return
        choice = decision(mode, decide(vllm_config, mode)
                          or group_problem(vllm_config, kv_cache_spec, layer_names))
        outcome = Outcome(choice.reason, min_tokens)
        if choice.check:
            outcome = self._check(min_tokens, vllm_config, kv_cache_spec, layer_names, device)
        self._act(outcome, vllm_config, kv_cache_spec, device)
        self._announce(outcome, kv_cache_spec.block_size, vllm_config.compilation_config)

    def _check(self, min_tokens: int | None, vllm_config: Any, kv_cache_spec: Any,
               layer_names: list[str], device: torch.device) -> Outcome:
        """``auto``'s kernel check (``_self_check``), then ``proven`` by the end-to-end
        proof kept for its key; groups from the option's length, else the verdict's
        break-even.  On a GPU the check's batches are freed before vLLM allocates the KV."""
        verdict, reason = checked(lambda: self._self_check(vllm_config, kv_cache_spec,
                                                           layer_names, device))
        proof = end_to_end.kept(verdict.shapes) if verdict else None
        reason = proven(reason, device.type == "cuda", proof)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        measured = verdict.min_shared_tokens if verdict else None
        by_size = () if min_tokens or verdict is None else verdict.by_size
        return Outcome(reason, min_tokens or measured, verdict, proof, by_size)

    def _act(self, outcome: Outcome, vllm_config: Any, kv_cache_spec: Any,
             device: torch.device) -> None:
        """The decision's side effects: the grouped path and the host mirror where the
        path acts (``outcome.reason`` None), vLLM's builder exactly where it does not."""
        if outcome.reason is not None:
            self.path = None
            return
        min_shared_blocks = min_blocks(kv_cache_spec.block_size,
                                       outcome.min_tokens or MIN_SHARED_TOKENS)
        path = self.path or self._grouped_path(vllm_config, kv_cache_spec, device,
                                               min_shared_blocks)  # or the CPU check's
        self.path = replace(path, min_shared_blocks=min_shared_blocks, by_size=outcome.by_size)
        # The V1 runner's reuse of one group's metadata for another would pair this
        # group's work with another table; MRV2's block ids mirrored on the host.
        self.supports_update_block_table = False
        host_tables.install()
        if device.type == "cuda":  # the key an end-to-end proof of this engine is kept by
            from feather_sched.integrations.vllm.attention_check import gpu_shapes

            DECIDED.append(gpu_shapes(self, vllm_config, kv_cache_spec))

    def _announce(self, outcome: Outcome, block_size: int, compilation: Any) -> None:
        """The engine log's one line: why the path is off, or on with the check's figures
        (or the option's grouping), and whether FULL decode graphs are kept."""
        graphs = "FULL decode CUDA graphs kept" if full_graphs(compilation) else \
            "no FULL CUDA graphs"
        if outcome.reason is not None:
            announce(outcome.reason)
        elif outcome.verdict is not None:
            notes = (graphs, outcome.proof.line()) if outcome.proof else (graphs,)
            announce(outcome.verdict.line(*notes))
        elif self.path is not None:
            announce(f"on ({self.name}, block size {block_size}, groups from "
                     f"{self.path.min_shared_blocks} shared blocks; {graphs})")

    def _self_check(self, vllm_config: Any, kv_cache_spec: Any, layer_names: list[str],
                    device: torch.device) -> Verdict:
        """``auto``'s verdict (``attention_subject.engine_check``). On a GPU the check runs
        in its own process, so Feather's kernels first compile and run in this worker
        only once the path is decided on; elsewhere (Triton's interpreter) it runs here,
        on this builder's path, grouping every prefix of its grid (one shared block)."""
        from feather_sched.integrations.vllm.attention_subject import engine_check

        if device.type != "cuda":
            self.path = self._grouped_path(vllm_config, kv_cache_spec, device, 1)
        return engine_check(self, vllm_config, kv_cache_spec, layer_names)

    def _grouped_path(self, vllm_config: Any, kv_cache_spec: Any, device: torch.device,
                      min_shared_blocks: int) -> GroupedPath:
        """The persistent work buffers for this engine's largest step, and the cut
        ``seq_lens`` buffer its graphs read (as long as the longest padded batch, plus a
        scratch element); on a GPU, every kernel compiled (on a small cache of the engine's
        layout), so none compiles while serving."""
        from vllm.platforms import current_platform

        scheduler, compilation = vllm_config.scheduler_config, vllm_config.compilation_config
        q_heads, block_size = self.num_heads_q, kv_cache_spec.block_size  # vLLM's, per group
        kv_heads, head_dim = kv_cache_spec.num_kv_heads, kv_cache_spec.head_size
        num_sms = (current_platform.num_compute_units(device.index or 0)
                   if device.type == "cuda" else 1)
        decode = GroupedDecode(DecodeLimits.for_device(num_sms, scheduler.max_num_seqs,
                                                       q_heads, kv_heads, head_dim), device)
        max_graph_tokens = compilation.max_cudagraph_capture_size or 0
        cut = torch.zeros(max(scheduler.max_num_seqs, max_graph_tokens) + 1,
                          dtype=torch.int32, device=device)
        if device.type == "cuda":  # compiles happen there (Triton's interpreter has none)
            dtype = kv_cache_spec.dtype
            kv_cache = torch.zeros(1, block_size, kv_heads, 2 * head_dim, dtype=dtype,
                                   device=device).transpose(1, 2)
            key_cache, value_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
            query = torch.zeros(1, q_heads, head_dim, dtype=dtype, device=device)
            decode.warm_up(query, key_cache, value_cache,
                           torch.zeros(1, 1, dtype=torch.int32, device=device), query.clone())
        return GroupedPath(decode, cut, block_size, min_shared_blocks, compilation)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> Any:
        if self.path is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        host = None if self._capturing else self._host_rows(common_attn_metadata)
        return self.build_with(common_attn_metadata, fast_build, host)

    def _host_rows(self, common: CommonAttentionMetadata) -> HostRows | None:
        """The step's rows' block ids on the host (``host_tables``), or None, said once
        where the table is not one Feather mirrors."""
        host = host_tables.lookup(common.block_table_tensor, common.req_idx, common.num_reqs)
        if host is None and host_tables.seen_any() \
                and not host_tables.known(common.block_table_tensor):
            announce(f"no groups in this {self.name} KV-cache group: its block table is "
                     "not one whose block ids Feather sees on the host (host_tables: "
                     "e.g. a kernel-block table, prefill context parallelism's)")
        return host

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> Any:
        """vLLM's capture metadata, carrying the (empty) work where the path is on, so the
        captured graph holds Feather's launches."""
        self._capturing = True
        try:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._capturing = False

    def build_with(self, common: CommonAttentionMetadata, fast_build: bool,
                   host: HostRows | None) -> Any:
        """The step's metadata, its groups read from ``host`` (None: no host block ids)."""
        base, path = super().build, self.path
        if path is None:
            return base(0, common, fast_build)
        step = path.step(common, host, self._capturing)
        if not step.carries_work:
            return base(0, common, fast_build)
        cut = replace(common, seq_lens=path.cut_seq_lens(common, step))
        return carrying(self.metadata_cls, base(0, cut, fast_build), path.decode)


class SharedPrefixImpl(_VllmImpl):
    """What Feather adds to a vLLM GPU attention impl (a mixin placed before it)."""

    def forward(self, layer: Any, query: Tensor, key: Tensor, value: Tensor,
                kv_cache: Tensor, attn_metadata: Any, output: Tensor,
                output_scale: Tensor | None = None,
                output_block_scale: Tensor | None = None) -> Tensor:
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                        output_scale, output_block_scale)
        work = getattr(attn_metadata, "work", None)
        if work is not None:
            key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            work.run(query, key_cache, value_cache, attn_metadata.block_table, self.scale,
                     output)
        return output


@dataclass
class SharedPrefixFlashMetadata(FlashAttentionMetadata):
    """FLASH_ATTN's metadata for the batch with grouped rows cut, and their work."""

    work: GroupedDecode | None = None


@dataclass
class SharedPrefixTritonMetadata(TritonAttentionMetadata):
    """TRITON_ATTN's metadata for the batch with grouped rows cut, and their work."""

    work: GroupedDecode | None = None


class SharedPrefixFlashBuilder(SharedPrefixBuilder, FlashAttentionMetadataBuilder):
    name, metadata_cls = "FlashAttention", SharedPrefixFlashMetadata
    engine_cls, engine_impl_cls = FlashAttentionMetadataBuilder, FlashAttentionImpl


class SharedPrefixTritonBuilder(SharedPrefixBuilder, TritonAttentionMetadataBuilder):
    name, metadata_cls = "Triton", SharedPrefixTritonMetadata
    engine_cls, engine_impl_cls = TritonAttentionMetadataBuilder, TritonAttentionImpl


class SharedPrefixFlashImpl(SharedPrefixImpl, FlashAttentionImpl):
    pass


class SharedPrefixTritonImpl(SharedPrefixImpl, TritonAttentionImpl):
    pass


class SharedPrefixFlashBackend(FlashAttentionBackend):
    """vLLM's FLASH_ATTN backend with Feather's builder and forward (same name, so vLLM's
    checks on the backend name still hold)."""

    @staticmethod
    def get_impl_cls() -> type[SharedPrefixFlashImpl]:
        return SharedPrefixFlashImpl

    @staticmethod
    def get_builder_cls() -> type[SharedPrefixFlashBuilder]:
        return SharedPrefixFlashBuilder


class SharedPrefixTritonBackend(TritonAttentionBackend):
    """vLLM's TRITON_ATTN backend with Feather's builder and forward."""

    @staticmethod
    def get_impl_cls() -> type[SharedPrefixTritonImpl]:
        return SharedPrefixTritonImpl

    @staticmethod
    def get_builder_cls() -> type[SharedPrefixTritonBuilder]:
        return SharedPrefixTritonBuilder


BACKENDS = {"FLASH_ATTN": SharedPrefixFlashBackend, "TRITON_ATTN": SharedPrefixTritonBackend}
"""vLLM's backend names Feather extends, and its subclass of each."""
