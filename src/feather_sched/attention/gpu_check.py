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

import numpy as np
import torch

from feather_sched.attention import triton_kernels
from feather_sched.attention.gpu_decode import DecodeLimits, GroupedDecode
from feather_sched.attention.groups import Groups, find_groups
from feather_sched.attention.partials import reference_attention
from feather_sched.attention.selfcheck import (
    Cell,
    Shapes,
    device_name,
    kernel_digest,
    median_seconds,
)
from feather_sched.attention.triton_kernels import TableSegments

REFERENCE_TOKENS = 1 << 15
"""Cells whose rows x context are at most this get a float64 reference (it is slow)."""


class PagedBatch:
    """One decode step of ``cell`` in vLLM's GPU cache layout (see the module docstring)."""

    def __init__(self, cell: Cell, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, block: int, device: torch.device | str, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        g, m = cell.groups, cell.per_group
        self.cell, self.block, self.kv_heads = cell, block, kv_heads
        shared_blocks = cell.prefix // block
        length = cell.prefix + cell.suffix + 1
        own_blocks = -(-(length - shared_blocks * block) // block)
        blocks = g * shared_blocks + g * m * own_blocks
        ids = torch.randperm(blocks, generator=generator).int()
        prefixes = ids[:g * shared_blocks].view(g, shared_blocks)
        suffixes = ids[g * shared_blocks:].view(g * m, own_blocks)
        cache = torch.zeros(blocks, block, kv_heads, 2 * head_dim, dtype=torch.float64)
        self._contexts: list[torch.Tensor] = []
        """Per row: its K and V, ``[2, length, kv_heads, head_dim]`` float64."""
        rows = []
        for group in range(g):
            prefix = torch.randn(2, cell.prefix, kv_heads, head_dim, generator=generator)
            for _ in range(m):
                row = len(rows)
                own = torch.randn(2, length - cell.prefix, kv_heads, head_dim,
                                  generator=generator)
                context = torch.cat([prefix, own], 1).to(dtype).double()
                self._contexts.append(context)
                table = torch.cat([prefixes[group], suffixes[row]])
                positions = torch.arange(length)
                slots = table.long()[positions // block], positions % block
                cache[slots] = torch.cat([context[0], context[1]], -1)
                rows.append(table)
        self.table_host = torch.stack(rows).numpy()
        self.seq_lens_host = np.full(g * m, length, dtype=np.int32)
        self.starts_host = np.arange(g * m + 1, dtype=np.int32)
        self.groups: Groups = find_groups(self.table_host, self.seq_lens_host,
                                          np.ones(g * m, dtype=np.int64), block, 1)
        self.kv_cache = cache.transpose(1, 2).to(device=device, dtype=dtype)
        self.key_cache, self.value_cache = self.kv_cache.transpose(1, 2).split(head_dim, -1)
        self.table = torch.from_numpy(self.table_host).to(device)
        self.seq_lens = torch.from_numpy(self.seq_lens_host).to(device)
        self.starts = torch.from_numpy(self.starts_host).to(device)
        self.query = torch.randn(g * m, q_heads, head_dim, generator=generator).to(
            device=device, dtype=dtype)
        self.scale = head_dim ** -0.5
        self.out = torch.empty_like(self.query)

    def reference(self) -> torch.Tensor | None:
        """Float64 attention of every row over its whole context (small cells only)."""
        if self.cell.rows * int(self.seq_lens_host[0]) > REFERENCE_TOKENS:
            return None
        query = self.query.cpu()
        return torch.stack([reference_attention(query[row], context[0], context[1],
                                                self.scale)[0]
                            for row, context in enumerate(self._contexts)])


def sync_seconds(device: torch.device | str) -> Callable[[Callable[[], object], int], float]:
    """``Subject.seconds`` for ``device``: wall time with the device's queue drained."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    return lambda run, reps: median_seconds(run, reps, sync)


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

    def __init__(self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 block: int, max_rows: int, max_context: int, device: str) -> None:
        self.geometry = (q_heads, kv_heads, head_dim, dtype, block)
        self.device = device
        num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                   if torch.device(device).type == "cuda" else 1)
        self.decode = GroupedDecode(DecodeLimits.for_device(num_sms, max_rows, q_heads,
                                                            kv_heads, head_dim), device)
        import triton

        self.shapes = Shapes(device=device_name(device), q_heads=q_heads, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=str(dtype).removeprefix("torch."),
                             block_size=block, layout="vllm-gpu (Feather's per-row decode "
                             "as the engine)", max_rows=max_rows, max_context=max_context,
                             versions=(("torch", torch.__version__),
                                       ("triton", triton.__version__),
                                       ("kernel", kernel_digest())))
        self.seconds = sync_seconds(device)

    def trial(self, cell: Cell, seed: int) -> KitTrial:
        return KitTrial(PagedBatch(cell, *self.geometry, self.device, seed), self.decode)
