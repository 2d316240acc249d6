"""Triton segment attention in Triton's CPU interpreter against float64 attention over each
row's ground-truth keys and values: grouped prefixes, per-row suffixes, split-K, merges.

The interpreter only takes over if TRITON_INTERPRET=1 is set before Triton is first
imported (Triton's own library functions are defined at import), which another test of the
session may already have done; so the kernel tests run in a fresh pytest process that
``test_kernels_in_the_triton_interpreter`` starts with the variable set."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest

from tests.helpers.triton_interpreter import INTERPRETED, only_interpreted, run_interpreted

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs Triton")

from feather_sched.attention import triton_kernels as tk  # noqa: E402

NAN = float("nan")
interpreted = only_interpreted("test_kernels_in_the_triton_interpreter")


def test_kernels_in_the_triton_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("this is that process")
    result = run_interpreted(__file__)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.skipif(INTERPRETED, reason="no device here to run out of resources")
def test_a_variant_too_large_for_the_device_falls_back_to_a_smaller_tile(monkeypatch) -> None:
    """A GPU with little shared memory (sm_75) raises OutOfResources at the first launch
    of the tuned variant: one stage, then half the token tile, is tried and remembered, so
    the next launch (and a graph capture after the warm-up) goes straight to it; a device
    that fits none raises."""
    from triton.runtime.errors import OutOfResources

    launches = []

    class Kernel:
        def __init__(self, fits) -> None:
            self.fits = fits

        def __getitem__(self, grid):
            def launch(*args, **options):
                launches.append((options["num_stages"], options["BLOCK_T"]))
                if not self.fits(options):
                    raise OutOfResources(98304, 65536, "shared memory")
            return launch

    monkeypatch.setattr(tk, "_fitted", {})
    small = Kernel(lambda options: options["num_stages"] == 1 and options["BLOCK_T"] <= 32)
    tk._launch_fitting(small, (1,), (), {"BLOCK_T": 64, "BLOCK_Q": 64})
    assert launches == [(2, 64), (1, 64), (1, 32)]
    tk._launch_fitting(small, (1,), (), {"BLOCK_T": 64, "BLOCK_Q": 64})
    assert launches[3:] == [(1, 32)]
    with pytest.raises(OutOfResources):
        tk._launch_fitting(Kernel(lambda options: False), (1,), (), {"BLOCK_T": 64,
                                                                     "BLOCK_Q": 16})


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels do not specialise")
def test_no_compile_waits_on_the_index_arrays_alignment() -> None:
    """The segment index arrays are views into one packed buffer, whose 16-byte alignment
    changes with the number of groups and rows; specialising on it would compile a new
    variant mid-run (a second of stall each).  The KV and query tensors are the engine's
    own allocations, always aligned, and stay specialised.  The optional pointers (the
    grouped rows' tokens, the live counts) get a stand-in array where unused."""
    attend, merge, _ = tk._kernels()
    free = {p.name for kernel in (attend, merge) for p in kernel.params
            if p.do_not_specialize_on_alignment}
    assert free == {"table_ptr", "seg_rows_ptr", "seg_starts_ptr", "seg_lengths_ptr",
                    "members_ptr", "rows_ptr", "q_rows_ptr", "count_ptr"}


@dataclass(frozen=True)
class Case:
    """Head geometry, cache layout and the batch: groups of rows sharing a prefix."""

    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    layout: str
    """'vllm': ``[blocks, kv_heads, block_size, 2 * head_dim]`` storage as allocated;
    'permuted': the same logical tensor over storage ordered ``[kv_heads, blocks, ...]``."""
    group_sizes: tuple[int, ...]
    prefixes: tuple[int, ...]
    """Tokens of each group's prefix (any, including 0 and mid-block)."""
    max_suffix: int
    """Each row's suffix is 0..max_suffix tokens; row 0's is empty."""

    @property
    def tolerance(self) -> float:
        return 1e-5 if self.dtype == torch.float32 else 1e-2


CASES = {
    "mha-fp32-d64": Case(8, 8, 64, 16, torch.float32, "vllm", (1, 4, 16, 7),
                         (40, 64, 100, 0), 40),
    "gqa4-bf16-d128": Case(8, 2, 128, 32, torch.bfloat16, "permuted", (16, 3, 1, 20),
                           (72, 200, 33, 128), 70),
    "gqa2-fp16-d64-block48": Case(8, 4, 64, 48, torch.float16, "vllm", (5, 2), (150, 47), 60),
}


@dataclass
class Batch:
    """Caches and a block table holding each row's context (prefix, then suffix) at
    positions 0.., with the ground truth they were written from."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    group_of: list[int]
    prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]
    """Per group: K, V ``[prefix, kv_heads, head_dim]`` float64."""
    suffix_kv: list[tuple[torch.Tensor, torch.Tensor]]
    """Per row: K, V ``[suffix, kv_heads, head_dim]`` float64."""

    @property
    def scale(self) -> float:
        return self.query.shape[2] ** -0.5


def make_caches(case: Case, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's GPU per-layer views: ``kv.transpose(1, 2).split(head_dim, -1)``."""
    shape = (num_blocks, case.kv_heads, case.block_size, 2 * case.head_dim)
    if case.layout == "vllm":
        kv = torch.randn(shape).to(case.dtype)
    else:
        kv = torch.randn(shape[1], shape[0], *shape[2:]).to(case.dtype).transpose(0, 1)
    key_cache, value_cache = kv.transpose(1, 2).split(case.head_dim, -1)
    assert not key_cache.is_contiguous()
    return key_cache, value_cache


def make_batch(case: Case, seed: int = 0) -> Batch:
    """Rows of all groups interleaved at random. Whole prefix blocks are one physical copy
    per group; a prefix's partial last block is each row's own (holding a copy of the
    prefix's tail, then the row's suffix), as in vLLM. Unused table entries point at
    random blocks, so reading past a range corrupts the result."""
    torch.manual_seed(seed)
    bs, dims = case.block_size, (case.kv_heads, case.head_dim)
    group_of = [g for g, size in enumerate(case.group_sizes) for _ in range(size)]
    group_of = [group_of[i] for i in torch.randperm(len(group_of))]
    suffixes = [0, *torch.randint(0, case.max_suffix + 1, (len(group_of) - 1,)).tolist()]
    prefix_kv = [tuple(torch.randn(p, *dims).to(case.dtype).double() for _ in "kv")
                 for p in case.prefixes]
    suffix_kv = [tuple(torch.randn(s, *dims).to(case.dtype).double() for _ in "kv")
                 for s in suffixes]
    shared = [p // bs for p in case.prefixes]
    own = [_cdiv(case.prefixes[g] + s, bs) - shared[g]
           for g, s in zip(group_of, suffixes, strict=True)]
    columns = max(shared[g] + n for g, n in zip(group_of, own, strict=True)) + 2
    num_blocks = sum(shared) + sum(own) + 8
    physical = iter(torch.randperm(num_blocks).tolist())
    shared_blocks = [[next(physical) for _ in range(n)] for n in shared]
    table = torch.randint(0, num_blocks, (len(group_of), columns), dtype=torch.int32)
    key_cache, value_cache = make_caches(case, num_blocks)
    for row, (g, n) in enumerate(zip(group_of, own, strict=True)):
        blocks = shared_blocks[g] + [next(physical) for _ in range(n)]
        table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for cache, p, s in zip((key_cache, value_cache), prefix_kv[g], suffix_kv[row],
                               strict=True):
            context = torch.cat([p, s]).to(case.dtype)
            for position, kv in enumerate(context):
                cache[blocks[position // bs], position % bs] = kv
    heads = case.q_heads
    qkv = torch.randn(len(group_of), (heads + 2 * case.kv_heads) * case.head_dim)
    query = qkv.to(case.dtype)[:, :heads * case.head_dim].view(-1, heads, case.head_dim)
    return Batch(query, key_cache, value_cache, table, group_of, prefix_kv, suffix_kv)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prefix_segments(batch: Batch, case: Case) -> tk.TableSegments:
    """One segment per group: its rows (padded with -1), read through its first row."""
    members = [[r for r, g in enumerate(batch.group_of) if g == group]
               for group in range(len(case.group_sizes))]
    width = max(map(len, members))
    padded = torch.tensor([m + [-1] * (width - len(m)) for m in members], dtype=torch.int32)
    starts = torch.zeros(len(members), dtype=torch.int32)
    return tk.TableSegments(padded[:, 0].contiguous(), starts,
                            torch.tensor(case.prefixes, dtype=torch.int32), padded)


def suffix_segments(batch: Batch, case: Case) -> tk.TableSegments:
    """One segment per row: its suffix, from its first position after the prefix."""
    rows = torch.arange(len(batch.group_of), dtype=torch.int32)
    starts = torch.tensor([case.prefixes[g] for g in batch.group_of], dtype=torch.int32)
    lengths = torch.tensor([len(k) for k, _ in batch.suffix_kv], dtype=torch.int32)
    return tk.TableSegments(rows, starts, lengths, rows[:, None].contiguous())


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention of one row ``[q_heads, head_dim]`` over ``[tokens, kv_heads,
    head_dim]``: (output, LSE); zero and -inf over no tokens."""
    heads, dim = query.shape
    q = query.double().view(key.shape[1], -1, dim)
    if not len(key):
        return torch.zeros(heads, dim, dtype=torch.float64), torch.full((heads,), -torch.inf)
    scores = torch.einsum("hgd,lhd->hgl", q, key) * scale
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hgl,lhd->hgd", torch.exp(scores - lse[..., None]), value)
    return out.reshape(heads, dim), lse.flatten()


def expected(batch: Batch, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (outputs, LSE) of every row over its prefix, suffix or whole context."""
    results = []
    for row, group in enumerate(batch.group_of):
        (kp, vp), (ks, vs) = batch.prefix_kv[group], batch.suffix_kv[row]
        key, value = {"prefix": (kp, vp), "suffix": (ks, vs),
                      "full": (torch.cat([kp, ks]), torch.cat([vp, vs]))}[part]
        results.append(attention(batch.query[row], key, value, batch.scale))
    return torch.stack([o for o, _ in results]), torch.stack([lse for _, lse in results])


def assert_close(out: torch.Tensor, lse: torch.Tensor | None,
                 reference: tuple[torch.Tensor, torch.Tensor], tolerance: float) -> None:
    """Per (row, head): relative error of the output below ``tolerance`` and LSE within it;
    exactly 0 and -inf where the reference attended no tokens (NaN fails both)."""
    ref_out, ref_lse = reference
    empty = torch.isinf(ref_lse)
    assert not out.isnan().any()
    assert (out[empty] == 0).all()
    error = (out.double() - ref_out).norm(dim=-1) / ref_out.norm(dim=-1)
    assert error[~empty].max() < tolerance
    if lse is not None:
        assert (lse[empty] == -torch.inf).all()
        assert (lse.double() - ref_lse)[~empty].abs().max() < tolerance


def poisoned(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, NAN, dtype=dtype)


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_prefix_and_suffix_partials_merge_into_full_attention(name: str, splits: int) -> None:
    """Grouped prefixes (groups of 1..20 rows, one of them empty) and per-row suffixes
    (starting mid-block or at a later column, some empty) give the reference partials;
    their merge is the reference attention over the whole context."""
    case = CASES[name]
    batch = make_batch(case)
    rows, heads, dim = batch.query.shape
    partials = []
    for part, segments in (("prefix", prefix_segments(batch, case)),
                           ("suffix", suffix_segments(batch, case))):
        out, lse = poisoned(rows, heads, dim), poisoned(rows, heads)
        tk.segment_attention(batch.query, batch.key_cache, batch.value_cache,
                             batch.block_table, segments, batch.scale, out, lse, splits=splits)
        assert_close(out, lse, expected(batch, part), case.tolerance)
        partials.append((out, lse))
    merged = poisoned(rows, heads, dim, dtype=case.dtype)
    merged_lse = poisoned(rows, heads)
    tk.merge_partials(torch.stack([o for o, _ in partials]),
                      torch.stack([lse for _, lse in partials]), merged, merged_lse)
    assert_close(merged, merged_lse, expected(batch, "full"), case.tolerance)


@interpreted
def test_one_split_buffer_for_prefix_and_suffix_then_one_merge() -> None:
    """The cascade's launch pattern: each launch's splits into its slice of one buffer,
    split-K sized for a GPU (several splits each), then a single merge."""
    case = CASES["gqa4-bf16-d128"]
    batch = make_batch(case, seed=1)
    prefix, suffix = prefix_segments(batch, case), suffix_segments(batch, case)
    splits = [tk.split_count(prefix, batch.query, case.kv_heads, max(case.prefixes), 132),
              tk.split_count(suffix, batch.query, case.kv_heads, case.max_suffix, 132)]
    assert splits == [4, 2]  # capped by length, 64 tokens a split: 200 prefix, 70 suffix
    rows, heads, dim = batch.query.shape
    parts, lse = poisoned(sum(splits), rows, heads, dim), poisoned(sum(splits), rows, heads)
    for segments, first, count in ((prefix, 0, splits[0]), (suffix, splits[0], splits[1])):
        tk.attend_segments(batch.query, batch.key_cache, batch.value_cache, batch.block_table,
                           segments, batch.scale, parts[first:first + count],
                           lse[first:first + count])
    out = torch.empty_strided((rows, heads, dim), (heads * dim + 8, dim, 1), dtype=case.dtype)
    out.fill_(NAN)
    tk.merge_partials(parts, lse, out)
    assert_close(out, None, expected(batch, "full"), case.tolerance)


@interpreted
def test_merge_skips_empty_parts_and_writes_only_mapped_rows() -> None:
    """Parts with LSE -inf are never read (NaN there is harmless); a row with no live part
    is 0 with LSE -inf; ``rows`` maps parts rows to output rows and -1 writes nothing."""
    torch.manual_seed(2)
    parts, lse = torch.randn(3, 4, 2, 16), torch.randn(3, 4, 2) * 5
    lse[1, 0], lse[:, 2] = -torch.inf, -torch.inf
    parts[1, 0], parts[:, 2] = NAN, NAN
    out, out_lse = poisoned(6, 2, 16), poisoned(6, 2)
    tk.merge_partials(parts, lse, out, out_lse,
                      rows=torch.tensor([5, 0, 3, -1], dtype=torch.int32))
    weights = torch.softmax(lse[:, [0, 1]], 0)[..., None]
    reference = torch.where(weights > 0, weights * parts[:, [0, 1]], 0).sum(0)
    torch.testing.assert_close(out[[5, 0]], reference)
    torch.testing.assert_close(out_lse[[5, 0]], torch.logsumexp(lse[:, [0, 1]], 0))
    assert (out[3] == 0).all() and (out_lse[3] == -torch.inf).all()
    assert out[[1, 2, 4]].isnan().all() and out_lse[[1, 2, 4]].isnan().all()


def test_split_count_fills_the_gpu_only_when_the_grid_would_not() -> None:
    query = torch.empty(64, 32, 128)
    group = tk.TableSegments(*torch.zeros(3, 1, dtype=torch.int32),
                             torch.arange(16, dtype=torch.int32)[None])
    per_row = tk.TableSegments(*torch.zeros(3, 64, dtype=torch.int32),
                               torch.arange(64, dtype=torch.int32)[:, None])
    assert tk.split_count(group, query, 8, 8192, num_sms=132) == tk.MAX_SPLITS  # 8 programs
    assert tk.split_count(group, query, 8, 100, num_sms=132) == 2  # at least 64 tokens a split
    assert tk.split_count(per_row, query, 8, 8192, num_sms=132) == 1  # 512 programs


def test_caller_mistakes_raise_before_launch() -> None:
    case = CASES["mha-fp32-d64"]
    batch = make_batch(case)
    segments = suffix_segments(batch, case)
    rows, heads, dim = batch.query.shape
    args = (batch.key_cache, batch.value_cache, batch.block_table, segments, batch.scale)
    with pytest.raises(TypeError, match="bf16, fp16, fp32"):
        tk.segment_attention(batch.query.bfloat16(), *args, torch.empty(rows, heads, dim),
                             torch.empty(rows, heads))
    with pytest.raises(ValueError, match="contiguous"):
        tk.segment_attention(batch.query, *args, torch.empty(rows, dim, heads).transpose(1, 2),
                             torch.empty(rows, heads))
