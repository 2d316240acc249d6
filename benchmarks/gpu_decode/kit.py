"""Decode-attention kit: how much does batch order cost a paged decode kernel on a real GPU?

One decode step's attention over a paged bf16 KV pool (Llama-3-8B per-layer geometry),
for batches of G prefix groups x M requests whose prefix blocks are shared physical blocks,
in three orders (``mixed``: groups interleaved round-robin; ``sorted``: group by group;
``homogeneous``: each group its own batch) plus a cascade kernel (each group's prefix
attended once for all its requests, merged with the per-request suffix by log-sum-exp).
Every variant is checked against a float64 reference before it is timed, and the timings
are written as a calibration CSV for ``feather calibrate``.

Needs only PyTorch (and Triton on CUDA). ``python kit.py --help`` for options; the
README next to this file explains the method and the output files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

# The step-log format comes from the package's source tree, which has no dependencies
# beyond the standard library: the GPU machine needs nothing installed but torch/Triton.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from feather_sched import steplog

TOLERANCE = 1e-2
"""Largest accepted relative error of one (request, head) output row vs float64."""
BLOCK_T = 64
"""Tokens per inner-loop iteration of the Triton kernel (any block size: each token's
block is looked up in the table)."""
MAX_SPLITS = 32
"""Most split-K partitions of one token range."""
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- geometry and sizes ----------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    """Per-layer model shapes: attention heads, KV block size, dense-layer widths."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    hidden: int
    intermediate: int
    layers: int

    @property
    def gqa(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def block_bytes(self) -> int:
        """One KV block of one layer: K and V, bf16."""
        return 2 * self.block_size * self.kv_heads * self.head_dim * 2

    def weight_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each weight matrix of one layer (qkv and gate/up fused)."""
        qkv = (self.q_heads + 2 * self.kv_heads) * self.head_dim
        return {"qkv": (self.hidden, qkv), "o": (self.q_heads * self.head_dim, self.hidden),
                "gate_up": (self.hidden, 2 * self.intermediate),
                "down": (self.intermediate, self.hidden)}


LLAMA3_8B = Geometry("llama-3-8b", q_heads=32, kv_heads=8, head_dim=128, block_size=16,
                     hidden=4096, intermediate=14336, layers=32)
TINY = Geometry("tiny", q_heads=4, kv_heads=2, head_dim=16, block_size=16, hidden=64,
                intermediate=128, layers=2)


class Config(NamedTuple):
    prefix: int
    groups: int
    per_group: int


@dataclass(frozen=True)
class Sweep:
    """Sizes to measure and how: repetitions, KV pools rotated, memory cap."""

    prefixes: tuple[int, ...]
    groups: tuple[int, ...]
    per_group: tuple[int, ...]
    suffix: int = 20
    warmup: int = 5
    reps: int = 50
    pools: int = 4
    memory_cap: float = 60e9

    def configs(self) -> list[Config]:
        return [Config(p, g, m) for p in self.prefixes for g in self.groups
                for m in self.per_group]


FULL = Sweep((1024, 4096, 10240), (1, 2, 4, 8, 16), (8, 32, 100))
QUICK = Sweep((1024, 10240), (1, 4), (32,), reps=20)
CPU = Sweep((64,), (1, 2), (2,), warmup=1, reps=5)


def blocks_needed(config: Config, suffix: int, geometry: Geometry) -> int:
    """Physical blocks of one population: a prefix copy per group, private suffixes."""
    if config.prefix % geometry.block_size:
        raise ValueError(f"prefix {config.prefix} is not a multiple of the block size")
    suffix_blocks = _cdiv(suffix, geometry.block_size)
    return config.groups * (config.prefix // geometry.block_size
                            + config.per_group * suffix_blocks)


# --- batches -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Segments:
    """Query rows attending one token range of block-table rows: one segment per request
    for plain decode and cascade suffixes, one per group for cascade prefixes."""

    rows: Tensor
    """[n] int32: the block-table row each segment reads."""
    col0: int
    """First block-table column read."""
    length: int
    """Tokens attended."""
    members: Tensor
    """[n, k] int32: batch positions whose queries attend the segment."""

    def __len__(self) -> int:
        return self.rows.shape[0]


@dataclass
class Population:
    """G groups x M requests; the ground truth the reference reads (not the block table)."""

    config: Config
    suffix: int
    prefix_blocks: Tensor
    """[G, P/bs] int32: physical blocks of each group's shared prefix."""
    suffix_blocks: Tensor
    """[G*M, ceil(S/bs)] int32: each request's private blocks, group-major."""
    q: Tensor
    """[G*M, q_heads, head_dim] bf16: each request's query, group-major."""


@dataclass
class Batch:
    """One decode batch in engine form: a block table and its per-variant segments."""

    name: str
    rows: Tensor
    """[R] population index of each position."""
    groups: list[int]
    block_table: Tensor
    """[R, blocks] int32; prefix columns point at the group's shared blocks."""
    q: Tensor
    decode: Segments
    prefix: Segments
    suffix: Segments

    def __len__(self) -> int:
        return len(self.groups)


def make_population(config: Config, suffix: int, geometry: Geometry, pool_blocks: int,
                    device: str) -> Population:
    """Random queries and a random placement of the population's blocks in the pool."""
    g, m = config.groups, config.per_group
    prefix_cols = config.prefix // geometry.block_size
    blocks = torch.randperm(pool_blocks)[:blocks_needed(config, suffix, geometry)].int()
    q = torch.randn(g * m, geometry.q_heads, geometry.head_dim, dtype=torch.bfloat16)
    return Population(config, suffix, blocks[:g * prefix_cols].view(g, -1).to(device),
                      blocks[g * prefix_cols:].view(g * m, -1).to(device), q.to(device))


def orders(config: Config) -> dict[str, Tensor]:
    """Population indices per batch: mixed, sorted, and one homogeneous batch per group."""
    grid = torch.arange(config.groups * config.per_group).view(config.groups, -1)
    named = {"mixed": grid.t().flatten(), "sorted": grid.flatten()}
    named.update({f"homogeneous/{g}": grid[g] for g in range(config.groups)})
    return named


def make_batch(population: Population, rows: Tensor, name: str) -> Batch:
    """The engine's view of ``rows``: block table and segments for decode and cascade."""
    device = population.q.device
    groups = (rows // population.config.per_group).tolist()
    rows = rows.to(device)
    table = torch.cat([population.prefix_blocks[groups], population.suffix_blocks[rows]], 1)
    first_seen = list(dict.fromkeys(groups))
    members = torch.stack([torch.tensor([i for i, g in enumerate(groups) if g == group])
                           for group in first_seen]).int().to(device)
    every = torch.arange(len(groups), dtype=torch.int32, device=device)
    shared, prefix_cols = population.config.prefix, population.prefix_blocks.shape[1]
    context = shared + population.suffix
    return Batch(
        name, rows, groups, table.contiguous(), population.q[rows],
        decode=Segments(every, 0, context, every[:, None]),
        prefix=Segments(members[:, 0].contiguous(), 0, shared, members),
        suffix=Segments(every, prefix_cols, population.suffix, every[:, None]),
    )


def gather(pool: Tensor, tables: Tensor, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """K and V of ``tables`` ([n, blocks]) as [n, length, kv_heads, head_dim]."""
    blocks = pool[tables.long()].to(dtype)  # [n, blocks, 2, block_size, kv_heads, dim]
    n, _, _, _, heads, dim = blocks.shape
    kv = blocks.transpose(1, 2).reshape(n, 2, -1, heads, dim)[:, :, :length]
    return kv[:, 0], kv[:, 1]


def reference(pool: Tensor, population: Population, geometry: Geometry) -> Tensor:
    """Float64 attention output [G*M, q_heads, head_dim] from the ground-truth block lists:
    one softmax over the concatenated prefix and suffix scores of each request."""
    config, scale = population.config, geometry.head_dim ** -0.5
    outputs = []
    for group in range(config.groups):
        members = slice(group * config.per_group, (group + 1) * config.per_group)
        q = population.q[members].double().view(config.per_group, geometry.kv_heads,
                                                geometry.gqa, -1) * scale
        kp, vp = (x[0] for x in gather(pool, population.prefix_blocks[group:group + 1],
                                       config.prefix, torch.float64))
        ks, vs = gather(pool, population.suffix_blocks[members], population.suffix,
                        torch.float64)
        scores = torch.cat([torch.einsum("mhgd,lhd->mhgl", q, kp),
                            torch.einsum("mhgd,mlhd->mhgl", q, ks)], -1)
        p = torch.softmax(scores, -1)
        out = (torch.einsum("mhgl,lhd->mhgd", p[..., :config.prefix], vp)
               + torch.einsum("mhgl,mlhd->mhgd", p[..., config.prefix:], vs))
        outputs.append(out.reshape(config.per_group, geometry.q_heads, -1))
    return torch.cat(outputs)


# --- kernels -------------------------------------------------------------------------------

@dataclass
class Workspace:
    """A variant's outputs: split/segment partials with their log-sum-exp, merged output."""

    parts: Tensor
    """[parts, R, q_heads, head_dim] fp32, each normalised over its own tokens."""
    lse: Tensor
    """[parts, R, q_heads] fp32 (natural log); -inf where a part saw no tokens."""
    out: Tensor
    """[R, q_heads, head_dim] fp32."""

    @classmethod
    def empty(cls, parts: int, batch: Batch) -> Workspace:
        r, heads, dim = batch.q.shape
        device = batch.q.device
        return cls(torch.empty(parts, r, heads, dim, device=device),
                   torch.empty(parts, r, heads, device=device),
                   torch.empty(r, heads, dim, device=device))

    def poison(self) -> None:
        """NaN everywhere, so a kernel that skips a write cannot pass the check."""
        for tensor in (self.parts, self.lse, self.out):
            tensor.fill_(math.nan)


class Backend(Protocol):
    name: str

    def splits(self, segments: Segments) -> int: ...

    def attend(self, pool: Tensor, batch: Batch, segments: Segments, ws: Workspace,
               part0: int, splits: int) -> None:
        """Write parts[part0 : part0 + splits] and their lse for every member row."""

    def merge(self, ws: Workspace) -> None:
        """out = the log-sum-exp weighted combination of all parts."""


class TorchBackend:
    """Gather blocks and attend in fp32: the CPU path and a second check on CUDA."""

    name = "torch"

    def __init__(self, geometry: Geometry, budget_bytes: float = 2**30):
        self.geometry = geometry
        self.budget = budget_bytes

    def splits(self, segments: Segments) -> int:
        return 1

    def attend(self, pool: Tensor, batch: Batch, segments: Segments, ws: Workspace,
               part0: int, splits: int) -> None:
        g = self.geometry
        per_segment = segments.members.shape[1]
        # Bytes per segment: gathered K/V (bf16 + fp32 copies) and scores + probabilities.
        per_token = g.kv_heads * g.head_dim * 2 * 6 + per_segment * g.q_heads * 4 * 2
        chunk = max(1, int(self.budget // (segments.length * per_token)))
        for start in range(0, len(segments), chunk):
            members = segments.members[start:start + chunk].long()
            tables = batch.block_table[segments.rows[start:start + chunk].long(),
                                       segments.col0:]
            k, v = gather(pool, tables, segments.length, torch.float32)
            q = batch.q[members].float().view(*members.shape, g.kv_heads, g.gqa, g.head_dim)
            scores = torch.einsum("cnhgd,clhd->cnhgl", q, k) * g.head_dim ** -0.5
            lse = torch.logsumexp(scores, -1)
            out = torch.einsum("cnhgl,clhd->cnhgd", torch.exp(scores - lse[..., None]), v)
            rows = members.flatten()
            ws.parts[part0][rows] = out.reshape(len(rows), g.q_heads, g.head_dim)
            ws.lse[part0][rows] = lse.reshape(len(rows), g.q_heads)

    def merge(self, ws: Workspace) -> None:
        weights = torch.exp(ws.lse - ws.lse.amax(0))
        ws.out.copy_((weights[..., None] * ws.parts).sum(0) / weights.sum(0)[..., None])


@cache
def _triton_kernels() -> tuple[Any, Any, Any]:
    """Compile-on-first-use Triton kernels (imported lazily: CPU runs need no Triton).
    With TRITON_INTERPRET=1 set before this runs, they run in Triton's CPU interpreter."""
    import triton
    import triton.language as tl

    # Sizes vary per call; specialising on them would compile a kernel per configuration.
    @triton.jit(do_not_specialize=["table_stride", "per_segment", "col0", "length",
                                   "tokens_per_split", "part0", "num_rows"])
    def attend(q_ptr, kv_ptr, table_ptr, table_stride, rows_ptr, members_ptr, per_segment,
               col0, length, tokens_per_split, part0, num_rows, parts_ptr, lse_ptr, scale,
               KV_HEADS: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr,
               TILES: tl.constexpr, DOT: tl.constexpr):
        # One program: one KV head x one tile of a segment's query rows x one token split.
        kv_head = tl.program_id(0)
        tile = tl.program_id(1) % TILES
        split = tl.program_id(1) // TILES
        seg = tl.program_id(2)
        r = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
        valid = r // GQA < per_segment
        req = tl.load(members_ptr + seg * per_segment + r // GQA, mask=valid, other=0)
        req = req.to(tl.int64)
        head = kv_head * GQA + r % GQA
        d = tl.arange(0, HEAD_DIM)
        q_rows = req * (KV_HEADS * GQA * HEAD_DIM) + head * HEAD_DIM
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        q = q.to(DOT)
        table = table_ptr + tl.load(rows_ptr + seg).to(tl.int64) * table_stride + col0
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, length)
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            live = t < end
            block = tl.load(table + t // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
            kv_rows = (block * (2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM)
                       + (t % BLOCK_SIZE) * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM)
            offsets = kv_rows[:, None] + d[None, :]
            k = tl.load(kv_ptr + offsets, mask=live[:, None], other=0.0).to(DOT)
            v = tl.load(kv_ptr + BLOCK_SIZE * KV_HEADS * HEAD_DIM + offsets,
                        mask=live[:, None], other=0.0).to(DOT)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v)
            m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        slot = (part0 + split).to(tl.int64) * num_rows + req
        out_rows = slot * (KV_HEADS * GQA * HEAD_DIM) + head * HEAD_DIM
        tl.store(parts_ptr + out_rows[:, None] + d[None, :], out, mask=valid[:, None])
        tl.store(lse_ptr + slot * (KV_HEADS * GQA) + head, lse, mask=valid)

    @triton.jit(do_not_specialize=["num_parts", "row_count"])
    def merge(parts_ptr, lse_ptr, out_ptr, num_parts, row_count, HEAD_DIM: tl.constexpr,
              PARTS: tl.constexpr):
        # One program per (request, query head) row: combine its parts by log-sum-exp.
        row = tl.program_id(0).to(tl.int64)
        p = tl.arange(0, PARTS)
        live = p < num_parts
        slots = p.to(tl.int64) * row_count + row
        lse = tl.load(lse_ptr + slots, mask=live, other=float("-inf"))
        weight = tl.exp(lse - tl.max(lse, 0))
        d = tl.arange(0, HEAD_DIM)
        o = tl.load(parts_ptr + slots[:, None] * HEAD_DIM + d[None, :], mask=live[:, None],
                    other=0.0)
        tl.store(out_ptr + row * HEAD_DIM + d, tl.sum(weight[:, None] * o, 0) / tl.sum(weight, 0))

    # Triton's CPU interpreter multiplies bf16 wrongly, so there the dots run in fp32.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return attend, merge, tl.float32 if interpreted else tl.bfloat16


def _split(length: int, splits: int) -> tuple[int, int]:
    """(tokens per split, a multiple of BLOCK_T; splits then needed, none of them empty)."""
    per_split = _cdiv(_cdiv(length, splits), BLOCK_T) * BLOCK_T
    return per_split, _cdiv(length, per_split)


class TritonBackend:
    """Paged flash-decoding in Triton: GQA query rows per program, split-K when the grid
    would not fill the GPU, fp32 online softmax; partials merged by a second kernel."""

    name = "triton"

    def __init__(self, geometry: Geometry, sms: int):
        self.geometry = geometry
        self.sms = sms
        self.attend_kernel, self.merge_kernel, self.dot_dtype = _triton_kernels()

    def _tiles(self, segments: Segments) -> tuple[int, int]:
        """(query rows per program, programs per segment and KV head)."""
        rows = segments.members.shape[1] * self.geometry.gqa
        block_q = max(16, min(64, _pow2(rows)))
        return block_q, _cdiv(rows, block_q)

    def splits(self, segments: Segments) -> int:
        """Enough splits for about two programs per SM (flash-decoding's split-K)."""
        programs = len(segments) * self.geometry.kv_heads * self._tiles(segments)[1]
        return _split(segments.length, min(MAX_SPLITS, _cdiv(2 * self.sms, programs)))[1]

    def attend(self, pool: Tensor, batch: Batch, segments: Segments, ws: Workspace,
               part0: int, splits: int) -> None:
        g = self.geometry
        assert pool.is_contiguous() and batch.q.is_contiguous() and ws.parts.is_contiguous()
        block_q, tiles = self._tiles(segments)
        per_split, _ = _split(segments.length, splits)
        grid = (g.kv_heads, tiles * splits, len(segments))
        self.attend_kernel[grid](
            batch.q, pool, batch.block_table, batch.block_table.stride(0), segments.rows,
            segments.members, segments.members.shape[1], segments.col0, segments.length,
            per_split, part0, len(batch), ws.parts, ws.lse, g.head_dim ** -0.5,
            KV_HEADS=g.kv_heads, GQA=g.gqa, HEAD_DIM=g.head_dim, BLOCK_SIZE=g.block_size,
            BLOCK_Q=block_q, BLOCK_T=BLOCK_T, TILES=tiles, DOT=self.dot_dtype, num_warps=4,
            num_stages=2)

    def merge(self, ws: Workspace) -> None:
        rows = ws.out.shape[0] * ws.out.shape[1]
        self.merge_kernel[(rows,)](ws.parts, ws.lse, ws.out, ws.parts.shape[0], rows,
                                   HEAD_DIM=self.geometry.head_dim,
                                   PARTS=max(2, _pow2(ws.parts.shape[0])), num_warps=2)


# --- variants and checks ---------------------------------------------------------------------

VARIANTS: dict[str, Callable[[Batch], list[Segments]]] = {
    "decode": lambda batch: [batch.decode],
    "cascade": lambda batch: [batch.prefix, batch.suffix],
}
"""What each variant attends: the whole context per request, or each group's prefix once
plus each request's suffix (merged by log-sum-exp)."""


@dataclass
class Plan:
    """A variant prepared for one batch: run(pool) writes ws.out."""

    run: Callable[[Tensor], None]
    ws: Workspace


def plan(backend: Backend, batch: Batch, variant: str) -> Plan:
    """Choose splits and allocate outputs up front, so the timed call only launches work."""
    jobs = [(s, backend.splits(s)) for s in VARIANTS[variant](batch)]
    ws = Workspace.empty(sum(splits for _, splits in jobs), batch)
    firsts = [sum(splits for _, splits in jobs[:i]) for i in range(len(jobs))]

    def run(pool: Tensor) -> None:
        for (segments, splits), part0 in zip(jobs, firsts, strict=True):
            backend.attend(pool, batch, segments, ws, part0, splits)
        backend.merge(ws)

    return Plan(run, ws)


class CheckError(AssertionError):
    """A variant's output does not match the float64 reference."""


def max_relative_error(out: Tensor, expected: Tensor) -> float:
    """Largest ||out - expected|| / ||expected|| over (request, head) rows; NaN if any
    output is NaN (poison left unwritten)."""
    diff = (out.double() - expected).norm(dim=-1) / expected.norm(dim=-1)
    return float(diff.max())


def check(label: str, plan_: Plan, pool: Tensor, expected: Tensor) -> float:
    """Poison the outputs, run once, compare with the reference; raise CheckError if off."""
    plan_.ws.poison()
    plan_.run(pool)
    error = max_relative_error(plan_.ws.out, expected)
    if not error < TOLERANCE:
        raise CheckError(f"{label}: max relative error {error:.3g} (limit {TOLERANCE})")
    return error


# --- timing ------------------------------------------------------------------------------------

class Timer:
    """Medians of repeated runs, each on a cold cache: CUDA events around the kernels
    only, after a write of twice the L2 size that evicts it; perf_counter on CPU.

    On CUDA the GPU first sleeps while the CPU queues every repetition, so launch latency
    never leaves it idle inside a timed interval (small kernels take less GPU time than
    the CPU needs to launch them)."""

    queue_s_per_rep = 3e-4
    """CPU time allowed per queued repetition; the sleep covers reps x this."""

    def __init__(self, device: str, scrub_bytes: int):
        self.cuda = device == "cuda"
        self.scrub = torch.empty(scrub_bytes, dtype=torch.uint8, device=device)

    def measure(self, run: Callable[[int], None], warmup: int, reps: int) -> list[float]:
        """Seconds of each repetition after ``warmup``; ``run`` gets the repetition index."""
        if not self.cuda:
            return [self._cpu_once(run, i) for i in range(warmup + reps)][warmup:]
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(warmup + reps)]
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9 * self.queue_s_per_rep * len(events)))  # ~2 GHz clock
        for i, (start, end) in enumerate(events):
            self.scrub.zero_()
            start.record()
            run(i)
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in events[warmup:]]

    @staticmethod
    def _cpu_once(run: Callable[[int], None], i: int) -> float:
        start = time.perf_counter()
        run(i)
        return time.perf_counter() - start


def time_weights(geometry: Geometry, sizes: set[int], timer: Timer, sweep: Sweep,
                 device: str) -> dict[int, list[float]]:
    """Seconds of one layer's weight matmuls (x @ W.T, bf16) per batch size."""
    weights = {name: torch.randn(out, inp, dtype=torch.bfloat16, device=device)
               for name, (inp, out) in geometry.weight_shapes().items()}
    timings = {}
    for n in sorted(sizes):
        xs = {name: torch.randn(n, w.shape[1], dtype=torch.bfloat16, device=device)
              for name, w in weights.items()}

        def layer(_: int, xs: dict[str, Tensor] = xs) -> None:
            for name, w in weights.items():
                torch.nn.functional.linear(xs[name], w)

        timings[n] = timer.measure(layer, sweep.warmup, sweep.reps)
    return timings


# --- the sweep -----------------------------------------------------------------------------------

@dataclass
class Measurement:
    """One timed batch: a variant on one order of one configuration, one layer."""

    config: Config
    batch: str
    variant: str
    groups: list[int]
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class Environment:
    """Where and how a sweep runs."""

    device: str
    geometry: Geometry
    sweep: Sweep
    backends: list[Backend]
    """The first is timed; all are checked."""
    timer: Timer
    l2_bytes: int
    name: str
    pools: list[Tensor] = field(default_factory=list)


def make_environment(device: str, geometry: Geometry, sweep: Sweep) -> Environment:
    """Backends, L2 size and device name for ``device``; Triton only where it can run."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible to PyTorch")
        props = torch.cuda.get_device_properties(0)
        l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
        sms, name = props.multi_processor_count, torch.cuda.get_device_name()
    else:
        l2, sms, name = 0, 4, platform.processor() or platform.machine() or "cpu"
    backends: list[Backend] = [TorchBackend(geometry)]
    if device == "cuda" or interpret:
        backends.insert(0, TritonBackend(geometry, sms))
    return Environment(device, geometry, sweep, backends, Timer(device, 2 * l2), l2, name)


def pool_blocks(env: Environment, configs: list[Config]) -> int:
    """Blocks per pool: enough for every configuration, and at least the L2 size."""
    g = env.geometry
    return max([blocks_needed(c, env.sweep.suffix, g) for c in configs]
               + [_cdiv(env.l2_bytes, g.block_bytes)])


def fits(env: Environment, config: Config) -> bool:
    """Whether the pools for ``config`` stay under the sweep's memory cap."""
    pools_bytes = env.sweep.pools * pool_blocks(env, [config]) * env.geometry.block_bytes
    return pools_bytes <= env.sweep.memory_cap


def allocate_pools(env: Environment, configs: list[Config]) -> None:
    """``sweep.pools`` random KV pools, rotated between repetitions."""
    g = env.geometry
    env.pools = [torch.randn(pool_blocks(env, configs), 2, g.block_size, g.kv_heads,
                             g.head_dim, dtype=torch.bfloat16, device=env.device)
                 for _ in range(env.sweep.pools)]


def measure_config(env: Environment, config: Config) -> tuple[list[Measurement],
                                                              dict[str, float]]:
    """Check every backend x variant on every order, then time the first backend's
    decode on each order and its cascade on the mixed order."""
    pool0, timed = env.pools[0], env.backends[0]
    population = make_population(config, env.sweep.suffix, env.geometry,
                                 pool0.shape[0], env.device)
    expected = reference(pool0, population, env.geometry)
    batches = [make_batch(population, rows, name) for name, rows in orders(config).items()]
    errors, plans = {}, {}
    for backend in env.backends:
        for batch in batches:
            for variant in VARIANTS:
                label = f"{backend.name}/{variant} on {batch.name}"
                plans[label] = plan(backend, batch, variant)
                errors[label] = check(label, plans[label], pool0, expected[batch.rows])
    timed_batches = [(b, "decode") for b in batches] + [(batches[0], "cascade")]
    measurements = [_measure(env, config, plans[f"{timed.name}/{variant} on {b.name}"], b,
                             variant) for b, variant in timed_batches]
    return measurements, errors


def _measure(env: Environment, config: Config, plan_: Plan, batch: Batch,
             variant: str) -> Measurement:
    def rotate(i: int) -> None:
        plan_.run(env.pools[i % len(env.pools)])

    seconds = env.timer.measure(rotate, env.sweep.warmup, env.sweep.reps)
    return Measurement(config, batch.name, variant, batch.groups, seconds)


def run(device: str = "cpu", out_dir: str | Path = DEFAULT_OUT, *, quick: bool = False,
        tiny: bool = False, seed: int | None = None, sweep: Sweep | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Check and time the whole sweep, write the CSVs, JSON and table into ``out_dir``;
    return the JSON report. Raises CheckError on the first mismatching variant."""
    geometry = TINY if tiny else LLAMA3_8B
    sweep = sweep or (CPU if device == "cpu" else QUICK if quick else FULL)
    seed = time.time_ns() % 2**31 if seed is None else seed
    torch.manual_seed(seed)
    env = make_environment(device, geometry, sweep)
    configs = [c for c in sweep.configs() if fits(env, c)]
    skipped = [c for c in sweep.configs() if c not in configs]
    allocate_pools(env, configs)
    log(f"{env.name}: {len(configs)} configurations ({len(skipped)} over the memory cap), "
        f"backends {[b.name for b in env.backends]}, seed {seed}")
    weights = time_weights(geometry, {c.groups * c.per_group for c in configs}
                           | {c.per_group for c in configs}, env.timer, sweep, device)
    measurements, errors = [], {}
    for config in configs:
        done, config_errors = measure_config(env, config)
        measurements += done
        errors[str(tuple(config))] = config_errors
        log(f"  P={config.prefix} G={config.groups} M={config.per_group}: checked "
            f"{len(config_errors)} (max error {max(config_errors.values()):.2g}), timed")
    report = _report(env, seed, skipped, weights, measurements, errors)
    _write(Path(out_dir), env, measurements, weights, report, log)
    return report


# --- outputs --------------------------------------------------------------------------------

def step_seconds(env: Environment, m: Measurement, weights: dict[int, list[float]]) -> float:
    """Composed whole-step time: layers x (this attention, one layer) + layers x (weight
    matmuls of one layer at this batch size)."""
    layers = env.geometry.layers
    return layers * m.median + layers * statistics.median(weights[len(m.groups)])


def write_steps(path: Path, env: Environment, measurements: list[Measurement],
                weights: dict[int, list[float]]) -> None:
    """One step per measured batch, one row per request: the step log ``feather calibrate``
    reads (``feather_sched.steplog``)."""
    context = env.sweep.suffix
    steplog.write_steps(path, (
        ([steplog.BatchEntry(group, m.config.prefix, m.config.prefix + context, 1)
          for group in m.groups], step_seconds(env, m, weights))
        for m in measurements))


def table(measurements: list[Measurement]) -> str:
    """Markdown: per-token attention time (one layer) per order and variant, and ratios."""
    lines = ["| P | G | M | mixed us/tok | sorted us/tok | homogeneous us/tok | cascade us/tok "
             "| mixed/homogeneous | mixed/sorted |", "|" + "---|" * 9]
    for config, ms in _by_config(measurements):
        tokens = config.groups * config.per_group
        t = {"mixed": 0.0, "sorted": 0.0, "homogeneous": 0.0, "cascade": 0.0}
        for m in ms:
            t["cascade" if m.variant == "cascade" else m.batch.split("/")[0]] += m.median
        per_token = " | ".join(f"{1e6 * t[k] / tokens:.3f}" for k in t)
        lines.append(f"| {config.prefix} | {config.groups} | {config.per_group} | {per_token} "
                     f"| {t['mixed'] / t['homogeneous']:.2f} | {t['mixed'] / t['sorted']:.2f} |")
    return "\n".join(lines) + "\n"


def _by_config(measurements: list[Measurement]) -> Iterator[tuple[Config, list[Measurement]]]:
    for config in dict.fromkeys(m.config for m in measurements):
        yield config, [m for m in measurements if m.config == config]


def _report(env: Environment, seed: int, skipped: list[Config],
            weights: dict[int, list[float]], measurements: list[Measurement],
            errors: dict[str, dict[str, float]]) -> dict[str, Any]:
    triton_version = None
    if any(b.name == "triton" for b in env.backends):
        import triton
        triton_version = triton.__version__
    return {
        "gpu": env.name, "device": env.device, "torch": torch.__version__,
        "triton": triton_version, "timed_backend": env.backends[0].name, "seed": seed,
        "geometry": asdict(env.geometry), "sweep": asdict(env.sweep),
        "l2_bytes": env.l2_bytes, "pool_blocks": env.pools[0].shape[0],
        "composition": f"step seconds = {env.geometry.layers} layers x attention (one layer, "
                       f"measured) + {env.geometry.layers} layers x weight matmuls (one "
                       "layer, measured at the batch size)",
        "skipped": [list(c) for c in skipped],
        "weights_one_layer": {str(n): {"median": statistics.median(s), "seconds": s}
                              for n, s in weights.items()},
        "max_relative_error": errors,
        "measurements": [{"prefix": m.config.prefix, "groups": m.config.groups,
                          "per_group": m.config.per_group, "batch": m.batch,
                          "variant": m.variant, "median": m.median,
                          "step_seconds": step_seconds(env, m, weights), "seconds": m.seconds}
                         for m in measurements],
    }


def _write(out: Path, env: Environment, measurements: list[Measurement],
           weights: dict[int, list[float]], report: dict[str, Any],
           log: Callable[[str], None]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    decode = [m for m in measurements if m.variant == "decode"]
    write_steps(out / "calibration.csv", env, decode, weights)
    write_steps(out / "calibration-cascade.csv", env,
                [m for m in measurements if m.variant == "cascade"], weights)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    text = table(measurements)
    (out / "table.md").write_text(text)
    log(text + f"wrote {out}/calibration.csv ({len(decode)} steps), calibration-cascade.csv, "
        "results.json, table.md")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a small subset of the sweep")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny head geometry (4 query, 2 KV heads of 16) for CPU checks")
    parser.add_argument("--seed", type=int, help="random seed (default: from the clock)")
    parser.add_argument("--reps", type=int, help="timed repetitions per batch")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args(argv)
    sweep = CPU if args.device == "cpu" else QUICK if args.quick else FULL
    if args.reps:
        sweep = replace(sweep, reps=args.reps)
    try:
        run(args.device, args.out, tiny=args.tiny, seed=args.seed, sweep=sweep)
    except CheckError as error:
        sys.exit(f"correctness check failed: {error}")


if __name__ == "__main__":
    main()
