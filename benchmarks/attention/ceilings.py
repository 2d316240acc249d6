"""This machine's ceilings for one decode step's prefix attention, measured beside it.

A cell's prefix work is, per (group, KV head), the group's rows (its requests x the query
heads of that KV head) against the prefix: ``rows x prefix`` scores from ``head_dim``-long
dot products, then their product with V, so 4 x rows x prefix x head_dim FLOPs; its bytes
are the prefix's K and V once. The kernel cannot beat the larger of those FLOPs at the
GEMM peak and those bytes at the streaming rate (the floor).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from feather_sched.integrations.vllm.attention_check import CpuBatch

GEMM_SIDE = 2048  # a 2048^3 product: 17 GFLOP, ~0.1 s at 200 GFLOP/s


def prefix_flop(batch: CpuBatch) -> float:
    """Multiply-adds x 2 of the cell's prefix attention (scores and their product with V)."""
    cell, g = batch.cell, batch.geometry
    return 4.0 * cell.rows * g.q_heads * cell.prefix * g.head_dim


def prefix_bytes(batch: CpuBatch) -> float:
    """The groups' prefix K and V, each read once."""
    cell, g = batch.cell, batch.geometry
    return 2.0 * cell.groups * cell.prefix * g.kv_heads * g.head_dim * batch.cache.element_size()


def gemm_peak_gflops(dtype: torch.dtype, reps: int = 3) -> float:
    """A large ``torch.matmul`` in ``dtype`` (oneDNN's), on torch's threads: the best of
    ``reps`` after a warm-up."""
    a = torch.randn(GEMM_SIDE, GEMM_SIDE).to(dtype)
    b = torch.randn(GEMM_SIDE, GEMM_SIDE).to(dtype)
    torch.matmul(a, b)
    best = min(_seconds(lambda: torch.matmul(a, b)) for _ in range(reps))
    return 2.0 * GEMM_SIDE ** 3 / best / 1e9


def same_bytes_and_shapes(batch: CpuBatch) -> list[tuple[str, Callable[[], object]]]:
    """Two timed paths: ``stream`` reads a fresh buffer of the prefix's bytes once;
    ``matmul_same_shapes`` multiplies, per (group, KV head), the rows by a prefix-long K^T
    and the scores by V in ``torch.matmul`` (no softmax: the GEMM part alone)."""
    cell, g = batch.cell, batch.geometry
    rows = cell.per_group * g.q_heads // g.kv_heads
    stream = torch.ones(int(prefix_bytes(batch)) // 8, dtype=torch.int64)
    dtype = batch.cache.dtype
    query = torch.randn(cell.groups * g.kv_heads, rows, g.head_dim).to(dtype)
    keys_t = torch.randn(cell.groups * g.kv_heads, g.head_dim, cell.prefix).to(dtype)
    values = torch.randn(cell.groups * g.kv_heads, cell.prefix, g.head_dim).to(dtype)

    def products() -> None:
        for item in range(len(query)):
            scores = torch.matmul(query[item], keys_t[item])
            torch.matmul(scores, values[item])

    return [("stream", lambda: stream.sum()), ("matmul_same_shapes", products)]


def against_the_limit(records: list[dict]) -> dict:
    """Per configuration, medians over rounds: the prefix kernel's GFLOP/s and GB/s, the
    floor its ceilings imply, and the kernel over that floor."""
    kernel = statistics.median(r["seconds"]["prefix_kernel"] for r in records)
    stream = statistics.median(r["seconds"]["stream"] for r in records)
    peak = statistics.median(r["gemm_peak_gflops"] for r in records)
    gflop, gb = records[0]["gflop"], records[0]["prefix_gb"]
    floor = max(gflop / peak, stream)  # the stream reads the prefix's bytes once
    return {"kernel_gflops": gflop / kernel, "kernel_gbps": gb / kernel,
            "stream_gbps": gb / stream, "gemm_peak_gflops": peak,
            "floor_ms": 1e3 * floor, "kernel_over_floor": kernel / floor}


def cpu_name() -> str:
    """``lscpu``'s model name, for the records."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines()
             if line.startswith("Model name")]
    return names[0] if names else "unknown"


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start
