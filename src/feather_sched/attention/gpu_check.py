"""The self-check's batches in vLLM's GPU KV layout, and its subject where no engine is
installed (the GPU kit).

``PagedBatch`` is one decode step of a ``selfcheck.Cell`` on a device: a paged KV cache in
the logical layout vLLM's FLASH_ATTN and TRITON_ATTN backends hand a layer (``[blocks,
kv_heads, block_size, 2 x head_dim]``, K then V), block ids permuted over the cache, each
group's full prefix blocks shared by its rows' block-table rows (a prefix ending mid-block
has its tail copied into each row's own blocks, as vLLM's prefix cache leaves it), each
row's suffix of its own; the block table on the device and on the host, the step's groups
(``groups.find_groups`` on the host table, as the builder finds them), and a float64
reference.  ``integrations.vllm.attention_check.GpuSubject`` runs vLLM's backends on it;
``KitSubject`` runs Feather's own per-row Triton decode as the stand-in for an engine's
kernel (named so in every figure it produces), for a GPU with torch and Triton only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from feather_sched.attention import triton_kernels
from feather_sched.attention.gpu_decode import DecodeLimits, GroupedDecode
from feather_sched.attention.groups import Groups, find_groups
from feather_sched.attention.partials import reference_attention
from feather_sched.attention.selfcheck import (
    Cell,
    Shapes,
    Verdict,
    check,
    device_facts,
    device_name,
    kernel_digest,
    median_seconds,
)
from feather_sched.attention.timing import GraphTimer
from feather_sched.attention.triton_kernels import TableSegments

REFERENCE_TOKENS = 1 << 15
"""Cells whose rows x context are at most this get a float64 reference (it is slow, and
its host memory grows with the context: only small cells have one)."""


def random_source(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator on ``device`` (so random K/V is drawn where it is kept, in its dtype,
    never through the host)."""
    device = torch.device(device)
    if device.type == "meta":
        return torch.Generator().manual_seed(seed)
    return torch.Generator(device=device).manual_seed(seed)


class PagedBatch:
    """One decode step of ``cell`` in vLLM's GPU cache layout (see the module docstring).

    Memory (``check_memory.cell_bytes`` counts it): the cache, query and output on
    ``device`` in ``dtype``, drawn there; on the host only the block table and the step's
    groups. ``physical``: the cache's order in memory, vLLM's resolved KV layout ("NHD":
    token-major, what FLASH_ATTN and TRITON_ATTN allocate by default; "HND": head-major);
    the logical shape handed to the backend is the same."""

    def __init__(self, cell: Cell, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, block: int, device: torch.device | str, seed: int,
                 physical: str = "NHD") -> None:
        generator = torch.Generator().manual_seed(seed)
        g, m = cell.groups, cell.per_group
        self.cell, self.block, self.kv_heads = cell, block, kv_heads
        shared_blocks = cell.prefix // block
        self.length = length = cell.length
        own_blocks = -(-(length - shared_blocks * block) // block)
        blocks = g * shared_blocks + g * m * own_blocks
        ids = torch.randperm(blocks, generator=generator).int()
        prefixes = ids[:g * shared_blocks].view(g, shared_blocks)
        suffixes = ids[g * shared_blocks:].view(g * m, own_blocks)
        self.kv_cache = _random_cache(blocks, block, kv_heads, head_dim, dtype, device,
                                      random_source(device, seed), physical)
        self._copy_prefix_tails(cell, shared_blocks, suffixes.long())
        self.table_host = torch.cat([prefixes.repeat_interleave(m, 0), suffixes], 1).numpy()
        self.seq_lens_host = np.full(g * m, length, dtype=np.int32)
        self.starts_host = np.arange(g * m + 1, dtype=np.int32)
        self.groups: Groups = find_groups(self.table_host, self.seq_lens_host,
                                          np.ones(g * m, dtype=np.int64), block, 1)
        self.key_cache, self.value_cache = self.kv_cache.transpose(1, 2).split(head_dim, -1)
        self.table = torch.from_numpy(self.table_host).to(device)
        self.seq_lens = torch.from_numpy(self.seq_lens_host).to(device)
        self.starts = torch.from_numpy(self.starts_host).to(device)
        self.query = torch.empty(g * m, q_heads, head_dim, dtype=dtype, device=device)
        self.query.normal_(generator=random_source(device, seed + 1))
        self.scale = head_dim ** -0.5
        self.out = torch.empty_like(self.query)

    def _copy_prefix_tails(self, cell: Cell, shared_blocks: int, suffixes: torch.Tensor
                           ) -> None:
        """A prefix ending mid-block: its last tokens, the same in each row of a group, in
        each row's first own block (as vLLM's prefix cache leaves them)."""
        tail = cell.prefix - shared_blocks * self.block
        if not tail:
            return
        nhd = self.kv_cache.transpose(1, 2)  # [blocks, block, kv_heads, 2 x head_dim]
        first = suffixes[:, 0].to(nhd.device).view(cell.groups, cell.per_group)
        for group in first:
            nhd[group[1:], :tail] = nhd[group[0], :tail]

    def reference(self) -> torch.Tensor | None:
        """Float64 attention of every row over its whole context, computed one row at a
        time on the host (small cells only: ``Cell.referenced``)."""
        if not self.cell.referenced(REFERENCE_TOKENS):
            return None
        query = self.query.cpu()
        table = torch.from_numpy(self.table_host).long()
        positions = torch.arange(self.length)
        nhd = self.kv_cache.transpose(1, 2)
        rows = []
        for row in range(self.cell.rows):
            slots = table[row, positions // self.block].to(nhd.device), positions % self.block
            context = nhd[slots[0], slots[1].to(nhd.device)].cpu()
            key, value = context.split(self.key_cache.shape[-1], -1)
            rows.append(reference_attention(query[row], key, value, self.scale)[0])
        return torch.stack(rows)


def _random_cache(blocks: int, block: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device | str, generator: torch.Generator,
                  physical: str) -> torch.Tensor:
    """A KV cache of random values, logical ``[blocks, kv_heads, block, 2 x head_dim]``
    (K then V), token-major ("NHD") or head-major ("HND") in memory."""
    if physical == "NHD":
        cache = torch.empty(blocks, block, kv_heads, 2 * head_dim, dtype=dtype, device=device)
        return cache.normal_(generator=generator).transpose(1, 2)
    if physical == "HND":
        cache = torch.empty(blocks, kv_heads, block, 2 * head_dim, dtype=dtype, device=device)
        return cache.normal_(generator=generator)
    raise ValueError(f"KV layout {physical!r}: NHD or HND")


def sync_seconds(device: torch.device | str) -> Callable[[Callable[[], object], int], float]:
    """``Subject.seconds`` for ``device``: wall time with the device's queue drained."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    return lambda run, reps: median_seconds(run, reps, sync)


def graph_timer(device: torch.device | str) -> GraphTimer | None:
    """How a subject on ``device`` times as the engine runs: graph replays and eager host
    cost on a GPU (``timing.GraphTimer``); None elsewhere (wall time, ``sync_seconds``)."""
    if torch.device(device).type != "cuda":
        return None
    return GraphTimer(torch.cuda.synchronize)


class KitTrial:
    """A ``PagedBatch`` with Feather's per-row decode as the engine and the grouped decode
    as the path (the per-row decode on the batch with grouped rows cut, then the groups).
    The step's work is staged once, as a builder stages it once for every layer: what is
    timed is one layer's attention."""

    def __init__(self, batch: PagedBatch, decode: GroupedDecode) -> None:
        self.batch, self.decode, self.cell = batch, decode, batch.cell
        device = batch.query.device
        rows = torch.arange(batch.cell.rows, dtype=torch.int32, device=device)
        decode.stage(batch.groups, batch.seq_lens_host, batch.starts_host, batch.block)
        cut = decode.cut_seq_lens(batch.seq_lens, torch.zeros(
            max(len(rows), decode.limits.max_rows) + 1, dtype=torch.int32, device=device))
        self._whole, self._cut = (TableSegments(rows, torch.zeros_like(rows), lengths,
                                                rows[:, None])
                                  for lengths in (batch.seq_lens, cut))
        heads, dim = batch.query.shape[1:]
        self._part = batch.query.new_empty((len(rows), heads, dim), dtype=torch.float32)
        self._lse = batch.query.new_empty((len(rows), heads), dtype=torch.float32)

    def _per_row(self, segments: TableSegments) -> None:
        b = self.batch
        triton_kernels.segment_attention(b.query, b.key_cache, b.value_cache, b.table,
                                         segments, b.scale, self._part, self._lse)
        b.out.copy_(self._part)

    def engine(self) -> torch.Tensor:
        self._per_row(self._whole)
        return self.batch.out

    def shared(self) -> torch.Tensor:
        b = self.batch
        self._per_row(self._cut)
        self.decode.run(b.query, b.key_cache, b.value_cache, b.table, b.scale, b.out)
        return b.out

    def reference(self) -> torch.Tensor | None:
        return self.batch.reference()


class KitSubject:
    """The self-check where no engine is installed: Feather's per-row Triton decode stands
    in for the engine's kernel (so a speed-up here is over that kernel, not vLLM's)."""

    idle_cost = True
    """On a step where nothing groups the path still launches (empty work, in graphs)."""
    host_seconds: Callable[[Callable[[], object], int], float] | None = None

    def __init__(self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 block: int, max_rows: int, max_context: int, device: str) -> None:
        self.geometry = (q_heads, kv_heads, head_dim, dtype, block)
        self.device = device
        num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                   if torch.device(device).type == "cuda" else 1)
        self.decode = GroupedDecode(DecodeLimits.for_device(num_sms, max_rows, q_heads,
                                                            kv_heads, head_dim), device)
        self.shapes = Shapes(device=device_name(device), q_heads=q_heads, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=str(dtype).removeprefix("torch."),
                             block_size=block, layout="vllm-gpu (Feather's per-row decode "
                             "as the engine)", max_rows=max_rows, max_context=max_context,
                             versions=(("torch", torch.__version__), *device_facts(device),
                                       ("kernel", kernel_digest())))
        timer = graph_timer(device)
        self.seconds = timer.seconds if timer else sync_seconds(device)
        self.host_seconds = timer.host_seconds if timer else None

    def trial(self, cell: Cell, seed: int) -> KitTrial:
        return KitTrial(PagedBatch(cell, *self.geometry, self.device, seed), self.decode)


def check_measuring_memory(subject: Any, **options: Any) -> Verdict:
    """``selfcheck.check`` of a subject on a GPU, with the peak device memory it
    allocated (torch's allocator, from a reset) in the verdict; as ``check`` elsewhere."""
    cuda = torch.device(subject.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(subject.device)
        before = torch.cuda.memory_allocated(subject.device)
    verdict = check(subject, **options)
    if not cuda:
        return verdict
    peak = torch.cuda.max_memory_allocated(subject.device) - before
    return replace(verdict, peak_device_bytes=int(peak))
