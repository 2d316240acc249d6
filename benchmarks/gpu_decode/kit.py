"""Decode-attention kit: what do batch order and shared-prefix attention cost on a real GPU?

One decode step's attention over a paged bf16 KV pool, for batches of G prefix groups x M
requests whose prefix blocks are shared physical blocks. Two studies: ``orders`` times
per-request paged decode in three orders (``mixed``: groups interleaved round-robin;
``sorted``: group by group; ``homogeneous``: each group its own batch) on Llama-3-8B's
geometry and writes a calibration CSV for ``feather calibrate``; ``shared-prefix`` times
the shared-prefix (cascade) kernel (each group's prefix attended once for all its
requests, merged with each request's suffix by log-sum-exp) against per-request decode of
the sorted batch, for GQA (Llama-3-8B) and MHA (Llama-2-7B) geometries. Every variant is
checked against a float64 reference before it is timed.

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
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

# The step-log format and the Triton kernels come from the package's source tree, modules
# that need nothing beyond the standard library, torch and Triton: the GPU machine needs
# nothing else installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from feather_sched.attention import triton_kernels
from feather_sched.attention.triton_kernels import TableSegments
from feather_sched.telemetry import steplog

TOLERANCE = 1e-2
"""Largest accepted relative error of one (request, head) output row vs float64."""
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
ORDERS, SHARED_PREFIX, SELF_CHECK = "orders", "shared-prefix", "self-check"
"""The studies: see the module docstring."""
SELF_CHECK_SHAPES = {"llama-3-8b": (32, 8, 128), "llama-2-7b": (32, 32, 128)}
"""Query heads, KV heads and head size the self-check runs at (one rank, no TP)."""
SELF_CHECK_BUDGET_S = 280
"""Seconds all the self-check's processes may take together (each gets an equal share of
what is left): the section within 5 minutes."""
SGLANG_SHAPE = "llama-3-8b"
"""The shape SGLang's Triton subject runs at, where SGLang is installed (32 layers)."""


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
LLAMA2_7B = Geometry("llama-2-7b", q_heads=32, kv_heads=32, head_dim=128, block_size=16,
                     hidden=4096, intermediate=11008, layers=32)
"""MHA (one query head per KV head): 4x Llama-3-8B's KV bytes per token."""
TINY = Geometry("tiny", q_heads=4, kv_heads=2, head_dim=16, block_size=16, hidden=64,
                intermediate=128, layers=2)
TINY_MHA = replace(TINY, name="tiny-mha", kv_heads=4)


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


class Study(NamedTuple):
    """One sweep on one geometry: ``kind`` ORDERS (every batch order, calibration steps)
    or SHARED_PREFIX (the sorted batch only)."""

    kind: str
    geometry: Geometry
    sweep: Sweep


FULL = Sweep((1024, 4096, 10240), (1, 2, 4, 8, 16), (8, 32, 100))
FULL_SHARED = Sweep((2048, 8192, 32768), (1, 4, 16), (16, 64))
QUICK = Sweep((1024, 10240), (1, 4), (32,), reps=20)
QUICK_SHARED = Sweep((8192, 32768), (1, 16), (64,), reps=20)
CPU = Sweep((64,), (1, 2), (2,), warmup=1, reps=5)


def studies(device: str, *, quick: bool = False, tiny: bool = False,
            reps: int | None = None) -> list[Study]:
    """The orders study on the GQA geometry, then the shared-prefix study on GQA and MHA."""
    gqa, mha = (TINY, TINY_MHA) if tiny else (LLAMA3_8B, LLAMA2_7B)
    orders, shared = ((CPU, CPU) if device == "cpu" else (QUICK, QUICK_SHARED) if quick
                      else (FULL, FULL_SHARED))
    if reps:
        orders, shared = replace(orders, reps=reps), replace(shared, reps=reps)
    return [Study(ORDERS, gqa, orders), Study(SHARED_PREFIX, gqa, shared),
            Study(SHARED_PREFIX, mha, shared)]


def blocks_needed(config: Config, suffix: int, geometry: Geometry) -> int:
    """Physical blocks of one population: a prefix copy per group, private suffixes."""
    if config.prefix % geometry.block_size:
        raise ValueError(f"prefix {config.prefix} is not a multiple of the block size")
    suffix_blocks = _cdiv(suffix, geometry.block_size)
    return config.groups * (config.prefix // geometry.block_size
                            + config.per_group * suffix_blocks)


# --- batches -----------------------------------------------------------------------------

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
    """One decode batch in engine form: a block table and its per-variant segments (one
    per request for decode and cascade suffixes, one per group for cascade prefixes)."""

    name: str
    rows: Tensor
    """[R] population index of each position."""
    groups: list[int]
    block_table: Tensor
    """[R, blocks] int32; prefix columns point at the group's shared blocks."""
    q: Tensor
    decode: TableSegments
    prefix: TableSegments
    suffix: TableSegments

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


def orders(config: Config, kind: str = ORDERS) -> dict[str, Tensor]:
    """Population indices per batch: mixed, sorted, and one homogeneous batch per group
    (SHARED_PREFIX: sorted only)."""
    grid = torch.arange(config.groups * config.per_group).view(config.groups, -1)
    if kind == SHARED_PREFIX:
        return {"sorted": grid.flatten()}
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
    shared = population.config.prefix
    return Batch(
        name, rows, groups, table.contiguous(), population.q[rows],
        decode=same_range(every, 0, shared + population.suffix, every[:, None]),
        prefix=same_range(members[:, 0].contiguous(), 0, shared, members),
        suffix=same_range(every, shared, population.suffix, every[:, None]),
    )


def same_range(table_rows: Tensor, start: int, length: int, members: Tensor) -> TableSegments:
    """Segments that all read tokens ``start .. start + length - 1`` of their table rows."""
    return TableSegments(table_rows, torch.full_like(table_rows, start),
                         torch.full_like(table_rows, length), members)


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

    def splits(self, batch: Batch, segments: TableSegments) -> int: ...

    def attend(self, pool: Tensor, batch: Batch, segments: TableSegments, ws: Workspace,
               part0: int, splits: int) -> None:
        """Write parts[part0 : part0 + splits] and their lse for every member row."""

    def merge(self, ws: Workspace) -> None:
        """out = the log-sum-exp weighted combination of all parts."""


def gather_range(pool: Tensor, block_table: Tensor, segments: TableSegments, part: slice,
                 length: int) -> tuple[Tensor, Tensor]:
    """K and V (fp32) of tokens ``start .. start + length - 1`` of each segment in ``part``,
    looked up through the block table: [n, length, kv_heads, head_dim] each."""
    block_size = pool.shape[2]
    positions = segments.starts[part, None].long() + torch.arange(length, device=pool.device)
    columns = (positions // block_size).clamp(max=block_table.shape[1] - 1)
    blocks = block_table[segments.table_rows[part, None].long(), columns].long()
    kv = pool[blocks, :, positions % block_size].float()  # [n, length, 2, kv_heads, dim]
    return kv[:, :, 0], kv[:, :, 1]


class TorchBackend:
    """Gather tokens and attend in fp32: the CPU path and a second check on CUDA. Segments
    must attend at least one token and have no -1 padding (the kit's never do)."""

    name = "torch"

    def __init__(self, geometry: Geometry, budget_bytes: float = 2**30):
        self.geometry = geometry
        self.budget = budget_bytes

    def splits(self, batch: Batch, segments: TableSegments) -> int:
        return 1

    def attend(self, pool: Tensor, batch: Batch, segments: TableSegments, ws: Workspace,
               part0: int, splits: int) -> None:
        g = self.geometry
        length = int(segments.lengths.max())
        # Bytes per segment token: gathered K/V (bf16 + fp32 copies) and scores + probabilities.
        per_token = (g.kv_heads * g.head_dim * 2 * 6
                     + segments.members.shape[1] * g.q_heads * 4 * 2)
        chunk = max(1, int(self.budget // (length * per_token)))
        for start in range(0, len(segments), chunk):
            part = slice(start, start + chunk)
            k, v = gather_range(pool, batch.block_table, segments, part, length)
            members = segments.members[part].long()
            q = batch.q[members].float().view(*members.shape, g.kv_heads, g.gqa, g.head_dim)
            scores = torch.einsum("cnhgd,clhd->cnhgl", q, k) * g.head_dim ** -0.5
            beyond = torch.arange(length, device=pool.device) >= segments.lengths[part, None]
            scores = scores.masked_fill(beyond[:, None, None, None, :], -math.inf)
            lse = torch.logsumexp(scores, -1)
            out = torch.einsum("cnhgl,clhd->cnhgd", torch.exp(scores - lse[..., None]), v)
            rows = members.flatten()
            ws.parts[part0][rows] = out.reshape(len(rows), g.q_heads, g.head_dim)
            ws.lse[part0][rows] = lse.reshape(len(rows), g.q_heads)

    def merge(self, ws: Workspace) -> None:
        weights = torch.exp(ws.lse - ws.lse.amax(0))
        ws.out.copy_((weights[..., None] * ws.parts).sum(0) / weights.sum(0)[..., None])


class TritonBackend:
    """The package's Triton kernels (``feather_sched.attention.triton_kernels``): paged
    flash-decoding over each segment's range, query rows of a segment together, split-K
    when the grid would not fill the GPU; partials merged by a second kernel."""

    name = "triton"

    def __init__(self, geometry: Geometry, sms: int):
        self.geometry = geometry
        self.sms = sms

    def splits(self, batch: Batch, segments: TableSegments) -> int:
        return triton_kernels.split_count(segments, batch.q, self.geometry.kv_heads,
                                          int(segments.lengths.max()), self.sms)

    def attend(self, pool: Tensor, batch: Batch, segments: TableSegments, ws: Workspace,
               part0: int, splits: int) -> None:
        window = slice(part0, part0 + splits)
        triton_kernels.attend_segments(batch.q, pool[:, 0], pool[:, 1], batch.block_table,
                                       segments, self.geometry.head_dim ** -0.5,
                                       ws.parts[window], ws.lse[window])

    def merge(self, ws: Workspace) -> None:
        triton_kernels.merge_partials(ws.parts, ws.lse, ws.out)


# --- variants and checks ---------------------------------------------------------------------

VARIANTS: dict[str, Callable[[Batch], list[TableSegments]]] = {
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
    jobs = [(s, backend.splits(batch, s)) for s in VARIANTS[variant](batch)]
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

    study: Study
    config: Config
    batch: str
    variant: str
    groups: list[int]
    seconds: list[float]
    step_seconds: float | None = None
    """Composed whole-step time (ORDERS studies only): see ``compose_steps``."""

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


def device_info(device: str) -> tuple[str, int, int]:
    """(name, L2 bytes, SMs) of ``device``; a CPU has no L2 to evict and 4 "SMs"."""
    if device == "cpu":
        return platform.processor() or platform.machine() or "cpu", 0, 4
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to PyTorch")
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    return torch.cuda.get_device_name(), l2, props.multi_processor_count


def make_environment(device: str, geometry: Geometry, sweep: Sweep) -> Environment:
    """Backends, L2 size and device name for ``device``; Triton only where it can run."""
    name, l2, sms = device_info(device)
    backends: list[Backend] = [TorchBackend(geometry)]
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
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


def measure_config(env: Environment, study: Study, config: Config) -> tuple[
        list[Measurement], dict[str, float]]:
    """Check every backend x variant on every order of the study, then time the first
    backend's decode on each order and its cascade on the sorted order."""
    pool0, timed = env.pools[0], env.backends[0]
    population = make_population(config, env.sweep.suffix, env.geometry,
                                 pool0.shape[0], env.device)
    expected = reference(pool0, population, env.geometry)
    batches = {name: make_batch(population, rows, name)
               for name, rows in orders(config, study.kind).items()}
    errors, plans = {}, {}
    for backend in env.backends:
        for batch in batches.values():
            for variant in VARIANTS:
                label = f"{backend.name}/{variant} on {batch.name}"
                plans[label] = plan(backend, batch, variant)
                errors[label] = check(label, plans[label], pool0, expected[batch.rows])
    timed_batches = [(b, "decode") for b in batches.values()] + [(batches["sorted"], "cascade")]
    measurements = [_measure(env, study, config, plans[f"{timed.name}/{variant} on {b.name}"],
                             b, variant) for b, variant in timed_batches]
    return measurements, errors


def _measure(env: Environment, study: Study, config: Config, plan_: Plan, batch: Batch,
             variant: str) -> Measurement:
    def rotate(i: int) -> None:
        plan_.run(env.pools[i % len(env.pools)])

    seconds = env.timer.measure(rotate, env.sweep.warmup, env.sweep.reps)
    return Measurement(study, config, batch.name, variant, batch.groups, seconds)


def run_study(device: str, study: Study, log: Callable[[str], None]) -> tuple[
        list[Measurement], dict[str, Any]]:
    """Check and time one study's configurations (ORDERS: also the weight matmuls, composed
    into step times); return its measurements and its part of the JSON report."""
    env = make_environment(device, study.geometry, study.sweep)
    sweep_configs = study.sweep.configs()
    configs = [c for c in sweep_configs if fits(env, c)]
    allocate_pools(env, configs)
    log(f"{study.kind} on {study.geometry.name}: {len(configs)} configurations "
        f"({len(sweep_configs) - len(configs)} over the memory cap), backends "
        f"{[b.name for b in env.backends]}")
    measurements, errors = [], {}
    for config in configs:
        done, config_errors = measure_config(env, study, config)
        measurements += done
        errors[str(tuple(config))] = config_errors
        log(f"  P={config.prefix} G={config.groups} M={config.per_group}: checked "
            f"{len(config_errors)} (max error {max(config_errors.values()):.2g}), timed")
    weights = compose_steps(env, measurements) if study.kind == ORDERS else {}
    return measurements, {
        "kind": study.kind, "geometry": asdict(study.geometry), "sweep": asdict(study.sweep),
        "backends": [b.name for b in env.backends], "pool_blocks": env.pools[0].shape[0],
        "skipped": [list(c) for c in sweep_configs if c not in configs],
        "weights_one_layer": {str(n): {"median": statistics.median(s), "seconds": s}
                              for n, s in weights.items()},
        "max_relative_error": errors,
    }


def compose_steps(env: Environment, measurements: list[Measurement]) -> dict[int, list[float]]:
    """Time one layer's weight matmuls at each batch size measured and set every
    measurement's composed step time: layers x (its attention, one layer) + layers x
    (weight matmuls of one layer at its batch size). Returns the weight timings."""
    layers = env.geometry.layers
    weights = time_weights(env.geometry, {len(m.groups) for m in measurements}, env.timer,
                           env.sweep, env.device)
    for m in measurements:
        m.step_seconds = layers * m.median + layers * statistics.median(weights[len(m.groups)])
    return weights


def run(device: str = "cpu", out_dir: str | Path = DEFAULT_OUT, *,
        chosen: list[Study] | None = None, seed: int | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Check and time every study (default: ``studies(device)``), write the CSVs, JSON and
    tables into ``out_dir``; return the JSON report. Raises CheckError on the first
    mismatching variant."""
    seed = time.time_ns() % 2**31 if seed is None else seed
    torch.manual_seed(seed)
    log(f"{device}, seed {seed}")
    measurements, parts = [], []
    for study in chosen or studies(device):
        done, part = run_study(device, study, log)
        measurements += done
        parts.append(part)
    name, l2, _ = device_info(device)
    timed = parts[0]["backends"][0]
    report = {
        "gpu": name, "device": device, "torch": torch.__version__,
        "triton": _triton_version() if timed == "triton" else None, "timed_backend": timed,
        "seed": seed, "l2_bytes": l2,
        "composition": "step seconds (orders studies) = layers x attention (one layer, "
                       "measured) + layers x weight matmuls (one layer, measured at the "
                       "batch size)",
        "studies": parts,
        "measurements": [_measurement_json(m) for m in measurements],
    }
    _write(Path(out_dir), measurements, report, log)
    return report


# --- the self-check --------------------------------------------------------------------------

def run_self_check(device: str, out: Path, *, tiny: bool = False,
                   log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The engine-start self-check (``attention.selfcheck.check``) on this device: the
    grouped decode against Feather's per-row decode standing in for an engine's kernel
    (``attention.gpu_check.KitSubject``) at Llama-3-8B's and Llama-2-7B's attention shapes
    (bf16, 16-token blocks, 256 rows, 32K context), and, where SGLang is installed,
    SGLang's Triton subject (its own decode kernel as the engine's, a 32-layer step) at
    Llama-3-8B's; else that subject is skipped with the reason. Each in its own process as
    an engine runs it (``attention.isolation``: a fault there is reported, not fatal),
    all within ``SELF_CHECK_BUDGET_S``, timed as graph replays on a GPU; with each, the
    memory plan ``feather attention-check --plan`` prints (``attention.check_memory``)
    and what the check really used: on a GPU its peak device memory, and the peak resident
    memory of the largest check process so far. Writes ``self-check.json`` and
    ``self-check.md``; returns the records. ``tiny``: small heads and cells, for a CPU
    under Triton's interpreter."""
    shapes = {"tiny": (4, 2, 16)} if tiny else SELF_CHECK_SHAPES
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    checks = [(name, "kit", heads) for name, heads in shapes.items()]
    checks.append(("tiny" if tiny else SGLANG_SHAPE, "sglang",
                   shapes["tiny" if tiny else SGLANG_SHAPE]))
    deadline = time.monotonic() + SELF_CHECK_BUDGET_S
    records, text = [], []
    for left, (name, engine, heads) in zip(range(len(checks), 0, -1), checks,
                                                  strict=True):
        timeout = max(1.0, (deadline - time.monotonic()) / left)
        record = _isolated_self_check(engine, heads, dtype, device, tiny, timeout)
        line = record.get("line") or (f"skipped ({record['skipped']})" if "skipped" in record
                                      else f"off (the self-check failed: {record['failure']})")
        log(f"{name} ({engine}): Feather shared-prefix attention: {line}")
        records.append({"model": name, "engine": engine, **record})
        text.append(_self_check_text(name, engine, line, record))
    out.mkdir(parents=True, exist_ok=True)
    (out / "self-check.json").write_text(json.dumps(records, indent=1) + "\n")
    (out / "self-check.md").write_text("# Self-check (kit: Feather's per-row decode as the "
                                       "engine's kernel; sglang: SGLang's Triton decode)\n\n"
                                       + "\n".join(text))
    return records


def _self_check_text(name: str, engine: str, line: str, record: dict[str, Any]) -> str:
    plan = record.get("plan")
    memory = "" if plan is None else (
        f"memory: planned peak host {plan['peak_host_bytes']} B, device "
        f"{plan['peak_device_bytes']} B; measured peak device "
        f"{record.get('measured_peak_device_bytes')} B, largest check process so far "
        f"{record.get('measured_child_peak_host_bytes')} B resident\n")
    return f"## {name} ({engine})\n\n`{line}`\n\n{record.get('table', '')}\n\n{memory}"


def _tiny_cells() -> dict[str, Any]:
    from feather_sched.attention.selfcheck import Cell

    return {"grid": (Cell(64, 2, 2, suffix=9), Cell(128, 2, 3, suffix=5)),
            "exactness": (Cell(40, 1, 2, suffix=1),), "idle": (Cell(64, 4, 1, suffix=9),),
            "reps": 1}


def _recipe(engine: str, heads: tuple[int, int, int], dtype: torch.dtype, device: str,
            cells: dict[str, Any]) -> Any:
    """The check's recipe: the kit's subject, or SGLang's Triton subject (None where
    SGLang is not installed)."""
    from dataclasses import replace as replaced
    from importlib.util import find_spec

    from feather_sched.attention.isolation import Recipe

    q_heads, kv_heads, head_dim = heads
    if engine == "kit":
        return Recipe(None, "feather_sched.attention.gpu_check:KitSubject",
                      {"q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
                       "dtype": dtype, "block": 16, "max_rows": 256, "max_context": 32768,
                       "device": device},
                      run="feather_sched.attention.gpu_check:check_measuring_memory",
                      run_kwargs=cells)
    if find_spec("sglang") is None:
        return None
    from feather_sched.integrations.sglang.attention_check import TritonShapes, triton_recipe

    shapes = TritonShapes(q_heads, kv_heads, head_dim, str(dtype).removeprefix("torch."),
                          16, 2 if cells else 32, 256, 32768, device)
    return replaced(triton_recipe(shapes, (("torch", torch.__version__),)), run_kwargs=cells)


def _isolated_self_check(engine: str, heads: tuple[int, int, int], dtype: torch.dtype,
                         device: str, tiny: bool, timeout_s: float) -> dict[str, Any]:
    """One check in a child process, with its memory plan: the verdict's JSON, line and
    table, or the failure, or why it was skipped."""
    from dataclasses import replace as replaced

    from feather_sched.attention import check_memory, selfcheck
    from feather_sched.attention.gpu_decode import DecodeLimits
    from feather_sched.attention.isolation import CheckFailed, run_isolated

    cells = _tiny_cells() if tiny else {}
    recipe = _recipe(engine, heads, dtype, device, cells)
    if recipe is None:
        return {"skipped": "SGLang is not installed: its Triton subject did not run"}
    q_heads, kv_heads, head_dim = heads
    shapes = selfcheck.Shapes(device="planned", q_heads=q_heads, kv_heads=kv_heads,
                              head_dim=head_dim, dtype=str(dtype).removeprefix("torch."),
                              block_size=16, layout="NHD", max_rows=256, max_context=32768)
    chosen = {k: v for k, v in cells.items() if k in ("grid", "exactness", "idle")}
    plan = check_memory.memory_plan(
        shapes, selfcheck.cells_to_run(shapes, **chosen),
        DecodeLimits.for_device(check_memory.PLAN_SMS, 256, q_heads, kv_heads, head_dim),
        cuda=device == "cuda")
    record: dict[str, Any] = {"plan": {k: v for k, v in plan.to_json().items()
                                       if k != "cells"}}
    try:  # the child limited by this plan, as an engine's check is by its own
        verdict = run_isolated(replaced(recipe, limits=check_memory.child_limits(plan)),
                               timeout_s=timeout_s)
    except CheckFailed as error:
        record["failure"] = str(error)
        record["measured_child_peak_host_bytes"] = error.peak_host_bytes
        return record
    record["measured_child_peak_host_bytes"] = verdict.peak_host_bytes  # this child's own
    return {**record, **verdict.to_json(), "line": verdict.line(),
            "table": selfcheck.table(verdict),
            "measured_peak_device_bytes": verdict.peak_device_bytes}


# --- outputs --------------------------------------------------------------------------------

def write_steps(path: Path, measurements: list[Measurement]) -> None:
    """One step per measured batch, one row per request: the step log ``feather calibrate``
    reads (``feather_sched.telemetry.steplog``)."""
    steplog.write_steps(path, (
        ([steplog.BatchEntry(group, m.config.prefix, m.config.prefix + m.study.sweep.suffix, 1)
          for group in m.groups], m.step_seconds)
        for m in measurements))


def orders_table(measurements: list[Measurement]) -> str:
    """Markdown: per-token attention time (one layer) per order and the shared-prefix
    (cascade) kernel, and the order ratios."""
    lines = ["| model | P | G | M | mixed us/tok | sorted us/tok | homogeneous us/tok "
             "| cascade us/tok | mixed/homogeneous | mixed/sorted |", "|" + "---|" * 10]
    for (geometry, config), ms in _by_config(measurements, ORDERS):
        tokens = config.groups * config.per_group
        t = {"mixed": 0.0, "sorted": 0.0, "homogeneous": 0.0, "cascade": 0.0}
        for m in ms:
            t["cascade" if m.variant == "cascade" else m.batch.split("/")[0]] += m.median
        per_token = " | ".join(f"{1e6 * t[k] / tokens:.3f}" for k in t)
        lines.append(f"| {geometry} | {config.prefix} | {config.groups} | {config.per_group} "
                     f"| {per_token} | {t['mixed'] / t['homogeneous']:.2f} "
                     f"| {t['mixed'] / t['sorted']:.2f} |")
    return "\n".join(lines) + "\n"


def shared_prefix_table(measurements: list[Measurement]) -> str:
    """Markdown: per-token attention time (one layer) of per-request paged decode of the
    sorted batch and of the shared-prefix kernel (prefix pass, suffix pass and merge);
    their ratio is the shared-prefix kernel's speed-up."""
    lines = ["| model | P | G | M | per-request us/tok | shared-prefix us/tok "
             "| per-request/shared-prefix |", "|" + "---|" * 7]
    for (geometry, config), ms in _by_config(measurements, SHARED_PREFIX):
        tokens = config.groups * config.per_group
        t = {m.variant: m.median for m in ms}
        lines.append(f"| {geometry} | {config.prefix} | {config.groups} | {config.per_group} "
                     f"| {1e6 * t['decode'] / tokens:.3f} | {1e6 * t['cascade'] / tokens:.3f} "
                     f"| {t['decode'] / t['cascade']:.2f} |")
    return "\n".join(lines) + "\n"


def _by_config(measurements: list[Measurement], kind: str) -> Iterator[
        tuple[tuple[str, Config], list[Measurement]]]:
    ours = [m for m in measurements if m.study.kind == kind]
    for key in dict.fromkeys((m.study.geometry.name, m.config) for m in ours):
        yield key, [m for m in ours if (m.study.geometry.name, m.config) == key]


def _triton_version() -> str:
    import triton
    return triton.__version__


def _measurement_json(m: Measurement) -> dict[str, Any]:
    return {"study": m.study.kind, "geometry": m.study.geometry.name, "prefix": m.config.prefix,
            "groups": m.config.groups, "per_group": m.config.per_group, "batch": m.batch,
            "variant": m.variant, "median": m.median, "step_seconds": m.step_seconds,
            "seconds": m.seconds}


def _write(out: Path, measurements: list[Measurement], report: dict[str, Any],
           log: Callable[[str], None]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    calibrated = [m for m in measurements if m.study.kind == ORDERS]
    decode = [m for m in calibrated if m.variant == "decode"]
    write_steps(out / "calibration.csv", decode)
    write_steps(out / "calibration-cascade.csv",
                [m for m in calibrated if m.variant == "cascade"])
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    text = (f"Batch orders\n\n{orders_table(measurements)}\nShared-prefix kernel vs "
            f"per-request decode (sorted batch)\n\n{shared_prefix_table(measurements)}")
    (out / "table.md").write_text(text)
    log(text + f"wrote {out}/calibration.csv ({len(decode)} steps), calibration-cascade.csv, "
        "results.json, table.md")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a small subset of the sweep")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny head geometries (16-dim heads) for CPU checks")
    parser.add_argument("--only", choices=(SELF_CHECK, ORDERS, SHARED_PREFIX),
                        help="run one study (default: the self-check, then both studies)")
    parser.add_argument("--seed", type=int, help="random seed (default: from the clock)")
    parser.add_argument("--reps", type=int, help="timed repetitions per batch")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args(argv)
    if args.only in (None, SELF_CHECK):
        run_self_check(args.device, args.out, tiny=args.tiny)
    chosen = [s for s in studies(args.device, quick=args.quick, tiny=args.tiny, reps=args.reps)
              if args.only in (None, s.kind)]
    try:
        if chosen:
            run(args.device, args.out, chosen=chosen, seed=args.seed)
    except CheckError as error:
        sys.exit(f"correctness check failed: {error}")


if __name__ == "__main__":
    main()
