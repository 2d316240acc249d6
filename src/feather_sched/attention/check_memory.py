"""The self-check's memory, worked out before anything runs: what an operator reads before
the first start (``feather attention-check --plan``), and the bound the check keeps.

The check runs in a process of its own (``isolation``): the host peak counts that whole
process, its interpreter with what the subject imports (``CHILD_INTERPRETER_BYTES``) and,
on a GPU, the CUDA context's host side (``CUDA_HOST_ALLOWANCE``), on each tensor-parallel
rank (each runs its own). The check holds one cell at a time (``selfcheck.check``): that
cell's paged batch (``gpu_check.PagedBatch``: the cache, query and output on the device
in the engine's dtype; the block table and the step's groups on the host), the check's
copies of both paths' outputs, and, for small cells only, a float64 reference computed
one row at a time on the host. Beside it, for the whole check, the grouped decode's
buffers (``gpu_decode.GroupedDecode``) and an allowance for the engine's own attention
builder (vLLM's Triton backend keeps split-softmax scratch of up to ``ENGINE_ALLOWANCE``).
The peaks are the fixed part plus the largest cell. Engine-agnostic: torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from feather_sched.attention.gpu_check import REFERENCE_TOKENS
from feather_sched.attention.gpu_decode import DecodeLimits, GroupedDecode
from feather_sched.attention.isolation import ChildLimits
from feather_sched.attention.selfcheck import Cell, Shapes, cells_to_run

HOST_LIMIT = 1 << 30
"""The most host memory the check may use (1 GiB), whatever the model."""
ENGINE_ALLOWANCE = 256 << 20
"""Device memory allowed for the engine's attention builder and its per-batch scratch
(vLLM's Triton backend: split-softmax buffers sized by its 3D-launch threshold; FA3: its
scheduler metadata and split-KV accumulators)."""
PLAN_SMS = 256
"""SMs assumed where the device is not known yet (a plan): more than any GPU has, so the
grouped decode's split-K workspace is at its largest."""
CHILD_INTERPRETER_BYTES = 640 << 20
"""The check process's own peak resident memory before any cell's data: a fresh Python
with torch, Triton, Feather's kernels and the engine's modules the subject imports.
Measured with ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` around a real child
(``isolation.run_isolated``, tiny cells, torch 2.13 CPU, Triton's interpreter, on the
project's 2-core CPU machine): SGLang 0.5.23's Triton subject 620 MiB, vLLM 0.32's
TRITON_ATTN subject 613 MiB (importing torch alone: 220 MiB); rounded up.
``tests/integrations/sglang/test_attention_triton.py`` measures it again."""
CUDA_HOST_ALLOWANCE = 256 << 20
"""Host memory a CUDA context and the CUDA build's libraries add to the check's process:
an estimate, NOT measured (no GPU has run the check yet); the kit
(``benchmarks/gpu_decode/kit.py``) records the child's real peak on a GPU
(``measured_child_peak_host_bytes``) to check it."""
LIMIT_HEADROOM = 1.5
"""The check process's memory limit (``child_limits``) over its planned host peak: the
plan's process figures are measured on a CPU and estimated for CUDA, so the limit stops
a runaway check, not a plan a few hundred MiB off."""
HOST_GROUPING_BYTES = 64
"""Host bytes per block-table entry while the step's groups are found (the table, its
sorted copies and masks)."""


@dataclass(frozen=True)
class CellMemory:
    """One cell's memory at its peak."""

    cell: Cell
    host_bytes: int
    device_bytes: int
    reference: bool
    """Whether the cell has a float64 reference (small cells only)."""


@dataclass(frozen=True)
class MemoryPlan:
    """The check's cells and its peak memory, on the host and on the device."""

    shapes: Shapes
    cells: tuple[CellMemory, ...]
    fixed_host_bytes: int
    """The grouped decode's host buffers and the check process itself."""
    fixed_device_bytes: int

    @property
    def peak_host_bytes(self) -> int:
        return self.fixed_host_bytes + max((c.host_bytes for c in self.cells), default=0)

    @property
    def peak_device_bytes(self) -> int:
        return self.fixed_device_bytes + max((c.device_bytes for c in self.cells), default=0)

    def to_json(self) -> dict:
        return {"shapes": asdict(self.shapes), "peak_host_bytes": self.peak_host_bytes,
                "peak_device_bytes": self.peak_device_bytes,
                "host_limit_bytes": HOST_LIMIT, "fixed_host_bytes": self.fixed_host_bytes,
                "cells": [{**asdict(c.cell), "rows": c.cell.rows, "host_bytes": c.host_bytes,
                           "device_bytes": c.device_bytes, "reference": c.reference}
                          for c in self.cells]}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as ``Shapes.dtype`` names it."""
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def cell_memory(cell: Cell, shapes: Shapes) -> CellMemory:
    """What one cell holds (see the module docstring), in bytes."""
    size, block = itemsize(shapes.dtype), shapes.block_size
    q, kv, d, rows = shapes.q_heads, shapes.kv_heads, shapes.head_dim, cell.rows
    length = cell.length
    shared = cell.prefix // block
    own = -(-(length - shared * block) // block)
    blocks = cell.groups * shared + rows * own
    columns = shared + own
    outputs = rows * q * d
    device = (blocks * block * kv * 2 * d * size   # the cache
              + 4 * outputs * size                 # query, output, the check's two copies
              + 3 * outputs * 8                    # the relative error in float64
              + rows * q * (d + 1) * 4             # a stand-in engine's fp32 partials
              + rows * (columns + 16) * 8)         # table, lengths, slots, segments
    host = HOST_GROUPING_BYTES * rows * columns + 12 * blocks + 64 * rows
    reference = cell.referenced(REFERENCE_TOKENS)
    if reference:
        context = length * kv * 2 * d
        device += context * size                   # one row's context gathered
        host += (outputs * (size + 8)              # the query on the host, the reference
                 + context * (size + 8)            # one row's context, and in float64
                 + 2 * q * length * 8)             # its scores and probabilities
    return CellMemory(cell, host, device, reference)


def memory_plan(shapes: Shapes, cells: Sequence[Cell], limits: DecodeLimits,
                cuda: bool = True) -> MemoryPlan:
    """The check's peak memory for ``shapes`` over ``cells`` (``selfcheck.cells_to_run``)
    with the grouped decode of ``limits``, its process included (``cuda``: on a GPU, with
    a CUDA context); allocates nothing (the decode's buffers are sized on the ``meta``
    device)."""
    decode = GroupedDecode(limits, "meta")
    process = CHILD_INTERPRETER_BYTES + (CUDA_HOST_ALLOWANCE if cuda else 0)
    return MemoryPlan(shapes, tuple(cell_memory(cell, shapes) for cell in cells),
                      fixed_host_bytes=decode.host_bytes + process,
                      fixed_device_bytes=decode.device_bytes + ENGINE_ALLOWANCE)


def child_limits(plan: MemoryPlan) -> ChildLimits:
    """The limits the check's process runs under (``isolation.ChildLimits``): its memory
    ``LIMIT_HEADROOM`` times the plan's host peak, the out-of-memory killer's first."""
    return ChildLimits(int(plan.peak_host_bytes * LIMIT_HEADROOM))


def planned_limits(shapes: Shapes, cuda: bool) -> ChildLimits:
    """``child_limits`` of the full check at ``shapes`` (every cell ``selfcheck`` runs;
    the grouped decode sized for ``PLAN_SMS``), computed without a device."""
    limits = DecodeLimits.for_device(PLAN_SMS, shapes.max_rows, shapes.q_heads,
                                     shapes.kv_heads, shapes.head_dim)
    return child_limits(memory_plan(shapes, cells_to_run(shapes), limits, cuda))


def table(plan: MemoryPlan) -> str:
    """The plan's cells as a markdown table: cell, rows, host and device MiB, reference."""
    lines = ["| prefix | groups x rows | suffix | host MiB | device MiB | float64 reference |",
             "|---|---|---|---|---|---|"]
    lines.extend(f"| {c.cell.prefix} | {c.cell.groups} x {c.cell.per_group} | "
                 f"{c.cell.suffix} | {c.host_bytes / (1 << 20):.1f} | "
                 f"{c.device_bytes / (1 << 20):.1f} | {'yes' if c.reference else 'no'} |"
                 for c in plan.cells)
    return "\n".join(lines)
