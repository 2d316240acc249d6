"""The capturable grouped decode (``attention.gpu_decode``) in Triton's CPU interpreter
against float64 attention over each row's whole context, and its capture contract: fixed
launches whatever is staged, no host read, programs past the live counts writing nothing.

As in ``test_triton_kernels``, the kernel tests run in a fresh pytest process with
TRITON_INTERPRET=1 (``test_kernels_in_the_triton_interpreter``)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

import numpy as np
import pytest

from tests.helpers.triton_interpreter import INTERPRETED, only_interpreted, run_interpreted

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs Triton")

from feather_sched.attention import gpu_decode  # noqa: E402
from feather_sched.attention import triton_kernels as tk  # noqa: E402
from feather_sched.attention.gpu_decode import DecodeLimits, GroupedDecode  # noqa: E402
from feather_sched.attention.groups import Groups  # noqa: E402
from tests.attention.test_triton_kernels import (  # noqa: E402
    Case,
    assert_close,
    expected,
    make_batch,
)

interpreted = only_interpreted("test_kernels_in_the_triton_interpreter")
SENTINEL = 7.0
"""What every output row holds before a run: a row the run must not touch keeps it."""


def test_kernels_in_the_triton_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("this is that process")
    result = run_interpreted(__file__)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@dataclass(frozen=True)
class Geometry:
    """A case of ``test_triton_kernels`` (its prefixes whole blocks plus a mid-block tail)
    and the grouped decode's splits."""

    case: Case
    prefix_splits: int
    suffix_splits: int
    programs: int = 0
    """``DecodeLimits.programs``: few, so each program strides over several segments."""


GEOMETRIES = {
    # 8q/2kv: K = 64 / 4 = 16 rows a prefix segment, so the group of 20 takes two.
    "gqa4-bf16-d128": Geometry(Case(8, 2, 128, 16, torch.bfloat16, "permuted", (20, 2, 5),
                                    (40, 100, 33), 40), 3, 2, programs=5),
    "mha-fp32-d64": Geometry(Case(4, 4, 64, 16, torch.float32, "vllm", (3, 2, 7),
                                  (70, 16, 47), 30), 1, 1),
    "gqa2-fp32-d64": Geometry(Case(4, 2, 64, 16, torch.float32, "vllm", (2, 4),
                                   (50, 130), 20), 2, 1),
}


@dataclass
class Step:
    """A batch of grouped rows (``make_batch``'s) interleaved with ungrouped ones (a
    prefill chunk of 3 tokens, singletons), in engine form: per batch row its block-table
    row, query tokens and sequence length; and its ``Groups``."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: np.ndarray
    query_starts: np.ndarray
    groups: Groups
    tokens: list[int]
    """Query token of each of ``make_batch``'s rows."""
    reference: tuple[torch.Tensor, torch.Tensor]
    """Float64 (outputs, LSE) of ``make_batch``'s rows over their whole context."""
    scale: float


def make_step(case: Case, seed: int, ungrouped: int = 5) -> Step:
    batch = make_batch(case, seed)
    grouped = len(batch.group_of)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(grouped + ungrouped, generator=generator).tolist()
    position = {old: new for new, old in enumerate(order)}  # batch row of each
    query_lens = [1 if old < grouped or old % 2 else 3 for old in order]
    starts = np.r_[0, np.cumsum(query_lens)]
    columns = batch.block_table.shape[1] + 3  # more columns than any row uses
    num_blocks = batch.key_cache.shape[0]
    table = torch.randint(0, num_blocks, (len(order), columns), dtype=torch.int32,
                          generator=generator)
    seq_lens = torch.randint(1, 200, (len(order),), generator=generator).numpy()
    heads, dim = batch.query.shape[1:]
    query = torch.randn(int(starts[-1]), heads, dim, generator=generator).to(case.dtype)
    tokens = []
    for row in range(grouped):
        new = position[row]
        table[new, :batch.block_table.shape[1]] = batch.block_table[row]
        seq_lens[new] = case.prefixes[batch.group_of[row]] + len(batch.suffix_kv[row][0])
        query[starts[new]] = batch.query[row]
        tokens.append(int(starts[new]))
    members = [[position[r] for r, g in enumerate(batch.group_of) if g == group]
               for group in range(len(case.group_sizes))]
    groups = Groups(np.array([r for m in members for r in m], dtype=np.int64),
                    np.cumsum([0] + [len(m) for m in members]),
                    np.array([p // case.block_size for p in case.prefixes], dtype=np.int64))
    return Step(query, batch.key_cache, batch.value_cache, table, seq_lens, starts[:-1],
                groups, tokens, expected(batch, "full"), batch.scale)


def limits_for(geometry: Geometry, max_rows: int = 40) -> DecodeLimits:
    case = geometry.case
    return DecodeLimits(max_rows, case.q_heads, case.kv_heads, case.head_dim,
                        geometry.prefix_splits, geometry.suffix_splits, geometry.programs)


def run_step(decode: GroupedDecode, step: Step, case: Case) -> torch.Tensor:
    """Stage ``step``, run, and check its grouped rows; the output, every other row of
    which must still hold ``SENTINEL``."""
    decode.stage(step.groups, step.seq_lens, step.query_starts, case.block_size)
    output = torch.full_like(step.query, SENTINEL)
    decode.run(step.query, step.key_cache, step.value_cache, step.block_table, step.scale,
               output)
    assert_close(output[step.tokens], None, step.reference, case.tolerance)
    assert untouched(output, step.tokens)
    return output


def untouched(output: torch.Tensor, written: list[int]) -> bool:
    others = torch.ones(len(output), dtype=torch.bool)
    others[written] = False
    return bool((output[others] == SENTINEL).all())


@interpreted
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_grouped_rows_are_full_attention_and_the_rest_untouched(name: str) -> None:
    """Groups of 2..20 rows (the 20 over two prefix segments), prefixes of whole shared
    blocks with each row's suffix from there (starting and ending mid-block), rows of
    groups interleaved with each other and with ungrouped rows, permuted block ids, a
    block table wider than used, fewer live rows and segments than the buffers hold."""
    geometry = GEOMETRIES[name]
    run_step(GroupedDecode(limits_for(geometry), "cpu"), make_step(geometry.case, 0),
             geometry.case)


@interpreted
def test_the_same_buffers_serve_step_after_step() -> None:
    """What graph replay needs: one decode staged with a large step, then a smaller one
    (its index buffers still holding the first's entries past the live counts), then the
    first again, each exact; and a cleared decode writes nothing."""
    geometry = GEOMETRIES["gqa4-bf16-d128"]
    case = geometry.case
    small = replace(case, group_sizes=(3, 4), prefixes=(60, 20), max_suffix=20)
    decode = GroupedDecode(limits_for(geometry), "cpu")
    first = make_step(case, 1)
    for step, step_case in ((first, case), (make_step(small, 2), small), (first, case)):
        run_step(decode, step, step_case)
    decode.clear()
    output = torch.full_like(first.query, SENTINEL)
    decode.run(first.query, first.key_cache, first.value_cache, first.block_table,
               first.scale, output)
    assert untouched(output, [])


@interpreted
def test_warm_up_runs_every_launch_and_writes_nothing() -> None:
    geometry = GEOMETRIES["mha-fp32-d64"]
    step = make_step(geometry.case, 3)
    decode = GroupedDecode(limits_for(geometry), "cpu")
    decode.stage(step.groups, step.seq_lens, step.query_starts, geometry.case.block_size)
    output = torch.full_like(step.query, SENTINEL)
    decode.warm_up(step.query, step.key_cache, step.value_cache, step.block_table, output)
    assert untouched(output, [])


cuda = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a GPU")


@cuda
def test_a_captured_cuda_graph_replays_whatever_step_is_staged() -> None:
    """Compiled on the GPU: ``run`` captured once (after ``warm_up``) into persistent
    tensors, as vLLM's FULL decode graphs hold them, then replayed for two different steps
    copied into those tensors and staged, and for a cleared decode."""
    geometry = GEOMETRIES["gqa4-bf16-d128"]
    case = geometry.case
    small = replace(case, group_sizes=(3, 4), prefixes=(60, 20), max_suffix=20)
    steps = [(make_step(case, 6), case), (make_step(small, 7), small)]
    tokens = max(len(step.query) for step, _ in steps)
    blocks = max(len(step.key_cache) for step, _ in steps)
    rows = max(len(step.block_table) for step, _ in steps)
    columns = max(step.block_table.shape[1] for step, _ in steps)
    dims = (case.kv_heads, case.head_dim)
    query = torch.zeros(tokens, case.q_heads, case.head_dim, dtype=case.dtype, device="cuda")
    caches = [torch.zeros(blocks, case.block_size, *dims, dtype=case.dtype, device="cuda")
              for _ in "kv"]
    table = torch.zeros(rows, columns, dtype=torch.int32, device="cuda")
    output = torch.zeros_like(query)
    decode = GroupedDecode(limits_for(geometry), "cuda")
    decode.warm_up(query, *caches, table, output)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode.run(query, *caches, table, steps[0][0].scale, output)
    for step, step_case in [*steps, steps[0]]:
        query[:len(step.query)] = step.query
        for cache, own in zip(caches, (step.key_cache, step.value_cache), strict=True):
            cache[:len(own)] = own
        table[:len(step.block_table), :step.block_table.shape[1]] = step.block_table
        decode.stage(step.groups, step.seq_lens, step.query_starts, step_case.block_size)
        output.fill_(SENTINEL)
        graph.replay()
        written = output[:len(step.query)].cpu()
        assert_close(written[step.tokens], None, step.reference, step_case.tolerance)
        assert untouched(output.cpu(), step.tokens)
    decode.clear()
    output.fill_(SENTINEL)
    graph.replay()
    assert untouched(output.cpu(), [])


class HostRead(AssertionError):
    pass


@pytest.mark.skipif(INTERPRETED, reason="checks the launches, not the kernels")
def test_run_launches_the_same_whatever_is_staged_and_reads_nothing_on_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture safety: ``run``'s launches (kernel, grid, every argument: tensors by
    address, shape and strides, scalars by value) are identical for two different steps and
    for a cleared decode, and it never reads a tensor on the host (on CPU all memory is host
    memory, so each way of reading one raises during ``run``)."""
    launches: list[tuple] = []

    class Kernel:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: tuple):
            def launch(*args, num_warps: int, num_stages: int = 0, **constants):
                launches.append((self.name, grid, tuple(map(describe, args)), constants))
            return launch

    fake = (Kernel("attend"), Kernel("merge"), {torch.bfloat16: "bf16"})
    monkeypatch.setattr(tk, "_kernels", lambda: fake)
    geometry = GEOMETRIES["gqa4-bf16-d128"]
    case = geometry.case
    decode = GroupedDecode(limits_for(geometry), "cpu")
    other = replace(case, group_sizes=(3, 4), prefixes=(60, 20))
    step = make_step(case, 4)
    output = torch.empty_like(step.query)
    args = (step.query, step.key_cache, step.value_cache, step.block_table, step.scale, output)
    decode.run(*args)  # the first run checks the layout
    per_step = []
    for stage in (lambda: decode.stage(step.groups, step.seq_lens, step.query_starts, 16),
                  lambda: decode.stage(*_staging(make_step(other, 5)), 16), decode.clear):
        stage()
        launches.clear()
        with monkeypatch.context() as patched:
            for method in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__",
                           "__float__", "__index__"):
                patched.setattr(torch.Tensor, method, _raises(method))
            decode.run(*args)
        per_step.append(list(launches))
    assert [name for name, *_ in per_step[0]] == ["attend", "attend", "merge"]
    assert per_step[0] == per_step[1] == per_step[2]
    limits = decode.limits
    grids = [grid for _, grid, *_ in per_step[0]]
    prefix, suffix, merge = limits.grids
    assert grids == [(2, limits.prefix_splits, prefix), (2, limits.suffix_splits, suffix),
                     (merge,)]
    variants = gpu_decode.variants(limits, torch.bfloat16, case.block_size)
    assert [constants for *_, constants in per_step[0]] == list(variants.values())


def _staging(step: Step) -> tuple:
    return step.groups, step.seq_lens, step.query_starts


def _raises(method: str):
    def host_read(*_args, **_kwargs):
        raise HostRead(f"Tensor.{method} during run")
    return host_read


def describe(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
    return value


def test_every_index_view_and_workspace_slice_is_16_byte_aligned() -> None:
    """Triton specialises on pointer alignment: every pointer ``run`` passes is aligned
    whatever the limits, so its compiles never depend on them."""
    for max_rows, q_heads, kv_heads in ((5, 3, 1), (7, 2, 2), (33, 8, 2)):
        limits = DecodeLimits(max_rows, q_heads, kv_heads, 64, 3, 2)
        decode = GroupedDecode(limits, "cpu")
        tensors = [*decode._views(decode._index).values(), *decode._split_parts,
                   *decode._split_lse, decode._prefix.starts, decode._suffix.members]
        assert all(t.data_ptr() % 16 == 0 for t in tensors)


def test_staging_past_the_limits_raises_and_stages_nothing() -> None:
    limits = DecodeLimits(8, 8, 2, 64)  # K = 16: one segment per group of up to 16
    decode = GroupedDecode(limits, "cpu")
    lens, starts = np.full(10, 100), np.arange(10)
    with pytest.raises(ValueError, match="10 grouped rows"):
        decode.stage(Groups(np.arange(10), np.array([0, 10]), np.array([2])), lens, starts, 16)
    assert limits.max_segments == 4  # groups of 2; five singletons need five
    singletons = Groups(np.arange(5), np.arange(6), np.ones(5, dtype=np.int64))
    with pytest.raises(ValueError, match="5 prefix segments"):
        decode.stage(singletons, lens, starts, 16)
    assert (decode._index == 0).all()


@pytest.mark.parametrize("k", [1, 2, 3, 16, 64])
def test_max_segments_bounds_every_grouping_of_the_rows(k: int) -> None:
    """Over every partition of up to 12 rows into groups of >= 2: at most ``max_segments``
    prefix segments of K rows."""
    for max_rows in range(2, 13):
        limits = DecodeLimits(max_rows, 64 // k, 1, 64)  # GQA 64 // k: K = k
        assert limits.members_per_segment == k
        most = max(sum(-(-s // k) for s in part) for part in partitions(max_rows))
        assert limits.max_segments == most


def partitions(total: int, smallest: int = 2) -> list[list[int]]:
    """Every multiset of group sizes >= ``smallest`` summing to at most ``total``."""
    found = [[]]
    for size in range(smallest, total + 1):
        found += [[size, *rest] for rest in partitions(total - size, size)]
    return found


def test_splits_for_a_device_fill_it_within_the_workspace_budget() -> None:
    limits = DecodeLimits.for_device(132, 256, 32, 8, 128)
    assert limits.members_per_segment == 16
    assert limits.workspace_bytes <= gpu_decode.WORKSPACE_BYTES
    assert (limits.prefix_splits, limits.suffix_splits) == (30, 1)  # budget-bound
    # About 4 programs per SM a launch, whatever the most segments and rows: an empty
    # step launches 8 x 30 x 3 + 8 x 66 + 256 programs here, not 8 x 30 x 128 + 8 x 256 + 256.
    assert limits.grids == (3, 66, 256) and limits.max_segments == 128
    roomy = DecodeLimits.for_device(132, 256, 32, 8, 128, workspace_bytes=1 << 30)
    assert (roomy.prefix_splits, roomy.suffix_splits) == (tk.MAX_SPLITS, 1)  # 8 x 33 programs
    tiny = DecodeLimits.for_device(132, 4096, 32, 8, 128, workspace_bytes=1 << 20)
    assert (tiny.prefix_splits, tiny.suffix_splits) == (1, 1)  # at least one each
    with pytest.raises(ValueError, match="power of two"):
        DecodeLimits(8, 8, 2, 96)
