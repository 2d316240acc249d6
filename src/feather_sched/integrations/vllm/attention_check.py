"""The self-check's subject on vLLM's CPU engine: vLLM's own CPU attention kernel against
Feather's shared-prefix path, on a random paged cache at the engine's shapes.

``CpuBatch`` is one decode step of the grid (``attention.selfcheck.Cell``): a KV cache
written through vLLM's own ``cpu_attn_reshape_and_cache`` (the layout vLLM picks for the
dtype and head size on this CPU: "vec", or "amx" where the CPU has AMX), block ids shuffled
over the cache, each group's prefix shared by its rows' block-table rows, and each row's
suffix of its own; ``CpuSubject`` builds them for ``selfcheck.check``.  The engine's
kernel is ``cpu_attention_with_kv_cache`` on the whole batch; the path is the same kernel
on the batch with the grouped rows cut to one token, then ``cpu_kernel.attend_groups``,
exactly what ``SharedPrefixCPUImpl.forward`` runs per layer.  ``benchmarks/attention/
cpu_decode.py`` times the same batches over a larger grid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from feather_sched.attention import cpu_kernel
from feather_sched.attention.gpu_check import PagedBatch, graph_timer, sync_seconds
from feather_sched.attention.groups import StepPlan, plan_step
from feather_sched.attention.isolation import Recipe
from feather_sched.attention.partials import reference_attention
from feather_sched.attention.selfcheck import (
    CPU_SOURCES,
    Cell,
    Shapes,
    device_facts,
    device_name,
    kernel_digest,
    median_seconds,
)
from feather_sched.integrations.vllm.compat import cpu_ops
from feather_sched.integrations.vllm.host_tables import HostRows


def versions() -> tuple[tuple[str, str], ...]:
    """What the CPU kernels come from: torch, vLLM, Feather and a digest of its kernel's
    sources (so a changed kernel is checked again)."""
    import vllm

    from feather_sched import __version__

    return (("torch", torch.__version__), ("vllm", vllm.__version__),
            ("feather-sched", __version__), ("kernel", kernel_digest(CPU_SOURCES)))


REFERENCE_TOKENS = 1 << 16
"""Cells whose rows x context are at most this get a float64 reference (it is slow)."""


@dataclass(frozen=True)
class Geometry:
    """The attention shapes of one layer on one rank."""

    q_heads: int
    kv_heads: int
    head_dim: int


class CpuBatch:
    """One decode step of ``cell`` on vLLM's CPU cache layout (see the module docstring)."""

    def __init__(self, cell: Cell, geometry: Geometry, dtype: torch.dtype, block: int,
                 seed: int) -> None:
        g, m = cell.groups, cell.per_group
        generator = torch.Generator().manual_seed(seed)
        self.cell, self.geometry, self.dtype, self.block = cell, geometry, dtype, block
        self.isa = _get_attn_isa(dtype, block, geometry.head_dim, "auto")
        if self.isa == "amx" and not torch.cpu._init_amx():
            # vLLM's worker has the AMX tile permission by the time attention runs (oneDNN
            # asks for it with the first bf16 matmul); without it AMX raises SIGILL.
            raise RuntimeError("this process may not use AMX tiles")
        # Only full blocks are shared (as vLLM's prefix cache shares them): a prefix ending
        # mid-block has its last tokens, the same in every row, in each row's own blocks.
        shared_blocks = cell.prefix // block
        length = cell.length
        own_blocks = -(-(length - shared_blocks * block) // block)
        blocks = g * shared_blocks + g * m * own_blocks
        heads, dim = geometry.kv_heads, geometry.head_dim
        self.cache = torch.zeros(blocks, heads, block, 2 * dim, dtype=dtype)
        ids = torch.randperm(blocks, generator=generator).int()
        prefixes = ids[:g * shared_blocks].view(g, shared_blocks)
        suffixes = ids[g * shared_blocks:].view(g * m, own_blocks)
        self._kv: list[tuple[torch.Tensor, ...]] = []
        """Per row: its group's prefix K and V, its own K and V (for the reference)."""
        rows: list[torch.Tensor] = []
        for group in range(g):
            key, value = self._random(cell.prefix, generator)
            self._write(prefixes[group], key[:shared_blocks * block],
                        value[:shared_blocks * block])
            for _ in range(m):
                row = len(rows)
                own_key, own_value = self._random(length - cell.prefix, generator)
                self._kv.append((key, value, own_key, own_value))
                tail = slice(shared_blocks * block, None)
                self._write(suffixes[row], torch.cat([key[tail], own_key]),
                            torch.cat([value[tail], own_value]))
                rows.append(torch.cat([prefixes[group], suffixes[row]]))
        self.table = torch.stack(rows).contiguous()
        self.seq_lens = torch.full((g * m,), length, dtype=torch.int32)
        self.starts = torch.arange(g * m + 1, dtype=torch.int32)
        self.query = torch.randn(g * m, geometry.q_heads, dim, generator=generator).to(dtype)
        self.scale = dim ** -0.5
        self.plan: StepPlan | None = plan_step(self.table, self.seq_lens, self.starts, g * m,
                                               block, 1)
        self._engine_meta = self.metadata(self.seq_lens)
        self._cut_meta = self.metadata(self.plan.seq_lens) if self.plan else None
        self.out = torch.empty_like(self.query)

    def _random(self, tokens: int, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (tokens, self.geometry.kv_heads, self.geometry.head_dim)
        return (torch.randn(shape, generator=generator).to(self.dtype),
                torch.randn(shape, generator=generator).to(self.dtype))

    def _write(self, blocks: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """K/V of consecutive tokens, from a block boundary on, through vLLM's writer into
        ``blocks`` in order."""
        heads, dim, block = self.geometry.kv_heads, self.geometry.head_dim, self.block
        slots = (blocks.long()[:, None] * block + torch.arange(block)).flatten()[:len(key)]
        view = self.cache.view(len(self.cache), heads, 2 * block, dim)
        key_cache, value_cache = view.chunk(2, dim=2)
        cpu_ops().cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, self.isa)

    def metadata(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """vLLM's CPU scheduler metadata for the batch with these sequence lengths."""
        g = self.geometry
        return cpu_ops().cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=g.q_heads, num_kv_heads=g.kv_heads,
            head_dim=g.head_dim, seq_lens=seq_lens, dtype=self.dtype,
            query_start_loc=self.starts, causal=True, sliding_window_size=-1, isa=self.isa,
            enable_kv_split=False, dynamic_causal=None, kv_cache_dtype="auto")

    def kernel(self, seq_lens: torch.Tensor, metadata: torch.Tensor,
               table: torch.Tensor | None = None) -> None:
        """vLLM's kernel on the batch into ``out`` (``table``: the rows' blocks in another
        order, for timing an unordered batch; the outputs are then not the batch's)."""
        heads, dim = self.geometry.kv_heads, self.geometry.head_dim
        key_cache, value_cache = self.cache.view(len(self.cache), heads, 2 * self.block,
                                                 dim).chunk(2, dim=2)
        cpu_ops().cpu_attention_with_kv_cache(
            query=self.query, key_cache=key_cache, value_cache=value_cache, output=self.out,
            query_start_loc=self.starts, seq_lens=seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=-1,
            block_table=self.table if table is None else table, softcap=0.0,
            scheduler_metadata=metadata, s_aux=None, dynamic_causal=None)

    # ---- selfcheck.Trial ----------------------------------------------------------------

    def engine(self) -> torch.Tensor:
        self.kernel(self.seq_lens, self._engine_meta)
        return self.out

    def shared(self, use_tiles: bool = True) -> torch.Tensor:
        """The shared-prefix path (``use_tiles``: as ``cpu_kernel.segment_attention``)."""
        if self.plan is None:  # no group: the path is the engine's kernel
            return self.engine()
        self.kernel(self.plan.seq_lens, self._cut_meta)
        cpu_kernel.attend_groups(self.plan, self.query, self.cache, self.scale, self.out,
                                 self.isa, use_tiles)
        return self.out

    def reference(self) -> torch.Tensor | None:
        if not self.cell.referenced(REFERENCE_TOKENS):
            return None
        return torch.stack([
            reference_attention(self.query[row], torch.cat([key, own_key]),
                                torch.cat([value, own_value]), self.scale)[0]
            for row, (key, value, own_key, own_value) in enumerate(self._kv)])


class CpuSubject:
    """vLLM's CPU attention at one engine's shapes, for ``selfcheck.check``."""

    idle_cost = False
    """Where nothing groups the path is vLLM's kernel alone (no plan, no launch)."""

    def __init__(self, geometry: Geometry, dtype: torch.dtype, block: int, max_rows: int,
                 max_model_len: int, versions: tuple[tuple[str, str], ...]) -> None:
        self.geometry, self.dtype, self.block, self.versions = geometry, dtype, block, versions
        layout = _get_attn_isa(dtype, block, geometry.head_dim, "auto")
        self.shapes = Shapes(device=device_name("cpu"), q_heads=geometry.q_heads,
                             kv_heads=geometry.kv_heads, head_dim=geometry.head_dim,
                             dtype=str(dtype).removeprefix("torch."), block_size=block,
                             layout=layout, max_rows=max_rows, max_context=max_model_len,
                             versions=(*versions, ("threads", str(torch.get_num_threads())),
                                       ("kernel build", cpu_kernel.isa())))

    def trial(self, cell: Cell, seed: int) -> CpuBatch:
        return CpuBatch(cell, self.geometry, self.dtype, self.block, seed)

    def seconds(self, run: Callable[[], object], reps: int) -> float:
        return median_seconds(run, reps)

    def recipe(self) -> Recipe:
        """This check as a child process builds it (``isolation.run_isolated``: plain
        values, the engine's thread count), kept for these shapes."""
        return Recipe(self.shapes, f"{__name__}:cpu_subject",
                      {"geometry": astuple(self.geometry), "dtype": self.shapes.dtype,
                       "block": self.block, "max_rows": self.shapes.max_rows,
                       "max_model_len": self.shapes.max_context, "versions": self.versions,
                       "threads": torch.get_num_threads()})


def cpu_subject(geometry: tuple[int, int, int], dtype: str, threads: int,
                **options: Any) -> CpuSubject:
    """``CpuSubject`` from a recipe's plain values, on the engine's threads."""
    torch.set_num_threads(threads)
    return CpuSubject(Geometry(*geometry), getattr(torch, dtype), **options)


class GpuTrial:
    """A ``gpu_check.PagedBatch`` through vLLM's own backend: the engine is its builder and
    forward on the whole batch, the path Feather's builder and forward (the engine's
    kernel on the batch with grouped rows cut, then the grouped decode).  Each builder
    builds the step once, as for every layer of a step: what is timed is one layer's
    forward."""

    def __init__(self, subject: GpuSubject, batch: PagedBatch) -> None:
        self.subject, self.batch = subject, batch
        rows = batch.cell.rows
        device = batch.query.device
        starts = torch.from_numpy(batch.starts_host)
        self.common = CommonAttentionMetadata(
            query_start_loc=batch.starts, query_start_loc_cpu=starts, seq_lens=batch.seq_lens,
            num_reqs=rows, num_actual_tokens=rows, max_query_len=1,
            max_seq_len=int(batch.seq_lens_host.max()), block_table_tensor=batch.table,
            slot_mapping=torch.zeros(rows, dtype=torch.int64, device=device),
            seq_lens_cpu_upper_bound=torch.from_numpy(batch.seq_lens_host))
        self.cell = batch.cell
        self._engine = subject.engine_builder.build(0, self.common)
        self._shared = subject.builder.build_with(self.common, False,
                                                  HostRows(batch.table_host, np.arange(rows)))

    def _forward(self, forward: Callable[..., object], metadata: object) -> torch.Tensor:
        b, layer = self.batch, self.subject.layer
        forward(layer.impl, layer, b.query, None, None, b.kv_cache, metadata, b.out)
        return b.out

    def engine(self) -> torch.Tensor:
        return self._forward(self.subject.engine_forward, self._engine)

    def shared(self) -> torch.Tensor:
        return self._forward(type(self.subject.layer.impl).forward, self._shared)

    def reference(self) -> torch.Tensor | None:
        return self.batch.reference()


class GpuSubject:
    """vLLM's GPU attention backend (FLASH_ATTN or TRITON_ATTN, the one the engine chose)
    at one engine's shapes, on its device, for ``selfcheck.check``; built inside
    Feather's builder at engine start, before the KV cache is allocated."""

    idle_cost = True
    """On a step where nothing groups the path still launches (empty work, in graphs)."""
    host_seconds: Callable[[Callable[[], object], int], float] | None = None
    """On a GPU: the host cost of an eager call (``timing.GraphTimer``)."""

    def __init__(self, builder: Any, vllm_config: Any, kv_cache_spec: Any,
                 layer_names: list[str], layer: Any = None) -> None:
        self.builder = builder
        self.layer = layer or engine_layer(vllm_config, layer_names)
        engine_cls = builder.engine_cls
        self.engine_builder = engine_cls(kv_cache_spec, layer_names, vllm_config,
                                         builder.device)
        self.engine_forward = builder.engine_impl_cls.forward
        self.geometry = (builder.num_heads_q, kv_cache_spec.num_kv_heads, kv_cache_spec.head_size,
                         kv_cache_spec.dtype, kv_cache_spec.block_size)
        self.device = builder.device
        self.kv_layout = resolved_layout(vllm_config)
        self.shapes = gpu_shapes(builder, vllm_config, kv_cache_spec)
        timer = graph_timer(self.device)
        self._seconds = timer.seconds if timer else sync_seconds(self.device)
        self.host_seconds = timer.host_seconds if timer else None

    def seconds(self, run: Callable[[], object], reps: int) -> float:
        return self._seconds(run, reps)

    def trial(self, cell: Cell, seed: int) -> GpuTrial:
        physical = "HND" if self.kv_layout.startswith("HND") else "NHD"
        return GpuTrial(self, PagedBatch(cell, *self.geometry, self.device, seed, physical))


def gpu_shapes(builder: Any, vllm_config: Any, kv_cache_spec: Any) -> Shapes:
    """The shapes (and versions) a GPU verdict is kept for: this engine's, read from its
    configuration; nothing allocated, nothing run."""
    return Shapes(
        device=device_name(builder.device), q_heads=builder.num_heads_q,
        kv_heads=kv_cache_spec.num_kv_heads, head_dim=kv_cache_spec.head_size,
        dtype=str(kv_cache_spec.dtype).removeprefix("torch."),
        block_size=kv_cache_spec.block_size, layout=builder.name,
        max_rows=vllm_config.scheduler_config.max_num_seqs,
        max_context=vllm_config.model_config.max_model_len,
        versions=gpu_versions(builder, kv_cache_spec, resolved_layout(vllm_config)))


def resolved_layout(vllm_config: Any) -> str:
    """vLLM's resolved KV-cache layout as the check lays its cache out: "NHD" (tokens,
    then heads, in a block) or "HND", with vLLM's name ("NHD (LBNHC)")."""
    try:
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    except (AttributeError, ValueError):  # not resolved: vLLM's default for these backends
        return "NHD (default)"
    heads, tokens = layout.value.index(2), layout.value.index(3)
    return f"{'NHD' if tokens < heads else 'HND'} ({layout.name})"


def gpu_versions(builder: Any, kv_cache_spec: Any, kv_layout: str
                 ) -> tuple[tuple[str, str], ...]:
    """What a GPU verdict depends on beyond its shapes: vLLM's and Feather's versions and
    kernels, the FlashAttention version the builder runs (FA2, FA3 and FA4 share a
    backend name), Triton's version, the SM count and driver, and the resolved KV
    layout. Not the CUDA-graph mode: vLLM resolves it after the builders are made."""
    flash = "-"
    if builder.name == "FlashAttention":
        from vllm.v1.attention.backends import flash_attn

        flash = str(flash_attn.get_flash_attn_version(
            head_size=kv_cache_spec.head_size, kv_cache_block_size=kv_cache_spec.block_size))
    return (*versions(), ("gpu kernel", kernel_digest()), ("flash-attn", flash),
            *device_facts(builder.device), ("kv layout", kv_layout))


def engine_layer(vllm_config: Any, layer_names: list[str]) -> Any:
    """The first attention layer of ``layer_names`` in the engine's model (its impl is the
    backend's, with the layer's scale and features)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    return next(iter(get_layers_from_vllm_config(vllm_config, Attention, layer_names).values()))
