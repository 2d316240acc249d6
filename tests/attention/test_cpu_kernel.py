"""The CPU segment kernel against the float64 reference, on caches in vLLM's "vec" and
"amx" layouts (written by ``tests/helpers/kv_layouts``, which
``tests/integrations/vllm/test_attention.py`` checks against vLLM's own cache writer) and
on token-major K/V buffers read through token slots ("nhd", SGLang's pool).
"""

from __future__ import annotations

import pytest
import torch

from feather_sched.attention import cpu_kernel
from feather_sched.attention.partials import reference_attention
from tests.helpers.kv_layouts import write_cache
from tests.helpers.merge import merge_partials


def run_segments(cache, query, segments, scale, layout="vec"):
    """segments: (query tokens, block ids, length); returns out, lse per listed token
    (in tiles where the build has them)."""
    tokens = [t for seg in segments for t in seg[0]]
    token_offsets = torch.tensor([0] + [len(s[0]) for s in segments]).cumsum(0)
    block_offsets = torch.tensor([0] + [len(s[1]) for s in segments]).cumsum(0)
    out = torch.full((len(tokens), *query.shape[1:]), torch.nan)
    lse = torch.full((len(tokens), query.shape[1]), torch.nan)
    cpu_kernel.segment_attention(
        cache, query, scale, token_offsets, torch.tensor(tokens, dtype=torch.int64),
        block_offsets, torch.tensor([b for s in segments for b in s[1]], dtype=torch.int32),
        torch.tensor([s[2] for s in segments], dtype=torch.int32), out, lse, layout,
        use_tiles=True)
    return out, lse


EMULATED = "+emulated-tiles"
EMULATED_TILES = ["native" + EMULATED, "skylake-avx512" + EMULATED]
BUILDS = ["native", "x86-64-v3"] + (["skylake-avx512", *EMULATED_TILES]
                                    if "avx512f" in cpu_kernel._cpu_flags() else [])
"""This CPU's build (AMX tiles over an "amx" cache where the CPU has them), the portable
loop (built for AVX2, without AVX-512) and, where the CPU runs AVX-512: that without
AVX512_BF16 (its bf16 path multiplies in fp32), and the tiles' instruction emulated in
this CPU's build and in that one (the tile path's layout arithmetic and its softmax
with and without AVX512_BF16's conversions, tested without AMX)."""


TILE_BUILDS = [*EMULATED_TILES] + (["native"] if "amx_bf16" in cpu_kernel._cpu_flags() else [])
"""The builds that multiply in tiles here: the emulated ones, and this CPU's where it has
AMX."""


@pytest.fixture(params=BUILDS)
def kernel(request, monkeypatch):
    return _use(request.param, monkeypatch)


@pytest.fixture(params=[b for b in TILE_BUILDS if b in BUILDS])
def tile_kernel(request, monkeypatch):
    return _use(request.param, monkeypatch)


def _use(build: str, monkeypatch: pytest.MonkeyPatch):
    """The kernel of ``build``, made the one ``cpu_kernel`` calls for the test."""
    if build == "native":
        return cpu_kernel.load()
    if build.endswith(EMULATED):
        library = cpu_kernel.build(build.removesuffix(EMULATED), ("FEATHER_EMULATE_TILES",))
        assert library.feather_kernel_tiles() == 2
    else:
        library = cpu_kernel.build(build)
        assert library.feather_kernel_vectorized() == (build == "skylake-avx512")
    monkeypatch.setattr(cpu_kernel, "load", lambda: library)
    return library


@pytest.mark.parametrize(("layout", "dtype"), [("vec", torch.float32), ("vec", torch.bfloat16),
                                              ("vec", torch.float16), ("amx", torch.bfloat16)])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 128),
                                                                (6, 2, 80)])
def test_segments_match_the_reference(kernel, layout, dtype, q_heads, kv_heads, head_dim):
    torch.manual_seed(1)
    block_size, blocks = 32, 12
    keys = (torch.randn(blocks * block_size, kv_heads, head_dim) * 2).to(dtype)
    values = torch.randn(blocks * block_size, kv_heads, head_dim).to(dtype)
    cache = write_cache(keys, values, block_size, layout)
    # A strided query, as vLLM slices it from the fused qkv projection.
    qkv = (torch.randn(20, q_heads + 2 * kv_heads, head_dim) * 2).to(dtype)
    query = qkv[:, :q_heads]
    scale = head_dim ** -0.5
    order = torch.randperm(blocks).tolist()  # blocks scattered over the cache
    segments = [
        ([0, 3, 5, 7, 2, 11, 13, 17, 18, 19, 4, 6, 8, 9, 10, 12, 14], order[:5], 5 * 32),
        ([1], order[5:8], 71),  # ends mid-block, mid token pair
        ([15, 16], order[8:9], 7),
        ([14], order[9:9], 0),  # no tokens
        ([9, 10, 11], order[9:12], 96),
    ]
    out, lse = run_segments(cache, query, segments, scale, layout)
    token_slots = [[b * block_size + t for b in seg_blocks for t in range(block_size)][:length]
                   for _, seg_blocks, length in segments]
    assert_segments(out, lse, query, keys, values, scale, segments, token_slots)


def assert_segments(out: torch.Tensor, lse: torch.Tensor, query: torch.Tensor,
                    keys: torch.Tensor, values: torch.Tensor, scale: float,
                    segments: list, token_slots: list[list[int]]) -> None:
    """Each segment's rows (its tokens in order) against float64 attention over its token
    slots of ``keys``/``values``: outputs within 1e-5, LSE, and zeros where empty."""
    row = 0
    for (seg_tokens, _, length), slots in zip(segments, token_slots, strict=True):
        index = torch.tensor(slots, dtype=torch.long)
        for token in seg_tokens:
            expected, expected_lse = reference_attention(query[token], keys[index],
                                                         values[index], scale)
            if length:
                error = (out[row].double() - expected).norm(dim=-1) / expected.norm(dim=-1)
                assert error.max() < 1e-5, (row, error.max())
            assert torch.allclose(lse[row].double(), expected_lse, atol=1e-5, rtol=1e-6)
            assert torch.equal(out[row] == 0, expected == 0)
            row += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 128),
                                                                (6, 2, 80)])
def test_token_slots_of_a_token_major_pool_match_the_reference(kernel, dtype, q_heads,
                                                               kv_heads, head_dim):
    """SGLang's pool: K and V halves of one fused allocation (one stride between slots,
    the slots of a segment scattered and in no order), segments longer than one gathered
    block (64 tokens), ending mid-block, or empty."""
    torch.manual_seed(2)
    slots = 700
    fused = (torch.randn(2, slots, kv_heads, head_dim) * 2).to(dtype)
    keys, values = fused[0], fused[1]
    qkv = (torch.randn(20, q_heads + 2 * kv_heads, head_dim) * 2).to(dtype)
    query = qkv[:, :q_heads]
    scale = head_dim ** -0.5
    order = torch.randperm(slots).tolist()
    segments = [
        ([0, 3, 5, 7, 2, 11, 13, 17, 18, 19, 4, 6, 8, 9, 10, 12, 14], order[:300], 300),
        ([1], order[300:371], 71),
        ([15, 16], order[371:372], 1),
        ([14], [], 0),
        ([9, 10, 11], order[372:500], 128),
    ]
    out, lse = run_segments((keys, values), query, segments, scale, "nhd")
    assert_segments(out, lse, query, keys, values, scale, segments,
                    [seg_slots for _, seg_slots, _ in segments])


def test_a_token_major_pool_needs_matching_packed_buffers():
    keys = torch.randn(32, 2, 32)
    args = (torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([0, 1]),
            torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.empty(1, 2, 32), torch.empty(1, 2))
    query = torch.randn(1, 2, 32)
    with pytest.raises(TypeError, match="pair"):
        cpu_kernel.segment_attention(keys, query, 0.1, *args, "nhd")
    with pytest.raises(ValueError, match="one shape"):
        cpu_kernel.segment_attention((keys, keys[:16]), query, 0.1, *args, "nhd")
    with pytest.raises(ValueError, match="packed"):
        cpu_kernel.segment_attention((keys, torch.randn(32, 32, 2).transpose(1, 2)), query,
                                     0.1, *args, "nhd")
    with pytest.raises(TypeError, match="one cache tensor"):
        cpu_kernel.segment_attention((keys, keys), query, 0.1, *args, "vec")


def test_a_segment_without_tokens_gives_zero_and_minus_infinity(kernel):
    cache = write_cache(torch.randn(32, 1, 32), torch.randn(32, 1, 32), 32, "vec")
    out, lse = run_segments(cache, torch.randn(1, 1, 32), [([0], [0], 0)], 0.1)
    assert not out.any() and torch.isinf(lse).all() and (lse < 0).all()


def test_bad_layouts_raise_before_the_kernel_runs():
    cache = write_cache(torch.randn(32, 2, 32), torch.randn(32, 2, 32), 32, "vec")
    args = (torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([0, 1]),
            torch.tensor([0], dtype=torch.int32), torch.tensor([32], dtype=torch.int32))
    with pytest.raises(TypeError, match="dtype"):
        cpu_kernel.segment_attention(cache, torch.randn(1, 2, 32).bfloat16(), 0.1, *args,
                                     torch.empty(1, 2, 32), torch.empty(1, 2))
    with pytest.raises(TypeError, match="int64"):
        cpu_kernel.segment_attention(cache, torch.randn(1, 2, 32), 0.1, args[0].int(),
                                     *args[1:], torch.empty(1, 2, 32), torch.empty(1, 2))
    with pytest.raises(ValueError, match="out"):
        cpu_kernel.segment_attention(cache, torch.randn(1, 2, 32), 0.1, *args,
                                     torch.empty(2, 2, 32), torch.empty(2, 2))
    with pytest.raises(TypeError, match="amx layout holds bf16"):
        cpu_kernel.segment_attention(cache, torch.randn(1, 2, 32), 0.1, *args,
                                     torch.empty(1, 2, 32), torch.empty(1, 2), "amx")
    with pytest.raises(ValueError, match="neon"):
        cpu_kernel.segment_attention(cache, torch.randn(1, 2, 32), 0.1, *args,
                                     torch.empty(1, 2, 32), torch.empty(1, 2), "neon")


def test_the_library_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_kernel.CACHE_ENV, str(tmp_path))
    cpu_kernel.load.cache_clear()
    try:
        cpu_kernel.load()
        built = list(tmp_path.iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"  # no temporary left behind
        cpu_kernel.build("native")
        assert list(tmp_path.iterdir()) == built
        assert cpu_kernel.vectorized() == ("avx512f" in cpu_kernel._cpu_flags())
    finally:
        cpu_kernel.load.cache_clear()


def test_a_failing_compiler_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_kernel.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    cpu_kernel.load.cache_clear()
    try:
        with pytest.raises(cpu_kernel.KernelUnavailable, match="false failed"):
            cpu_kernel.load()
        assert list(tmp_path.iterdir()) == []
    finally:
        cpu_kernel.load.cache_clear()


@pytest.mark.parametrize(("layout", "dtype"), [("vec", torch.bfloat16), ("amx", torch.bfloat16),
                                              ("vec", torch.float32)])
@pytest.mark.parametrize("threads", [2, 7])
def test_long_segments_split_over_threads_match_the_reference(kernel, layout, dtype, threads):
    """Few (segment, KV head) items for the threads: the long segments are split into parts
    (one ending mid-block) on threads that would otherwise idle, and merged exactly."""
    torch.manual_seed(3)
    block_size, blocks, kv_heads = 32, 80, 1
    keys = (torch.randn(blocks * block_size, kv_heads, 64) * 2).to(dtype)
    values = torch.randn(blocks * block_size, kv_heads, 64).to(dtype)
    cache = write_cache(keys, values, block_size, layout)
    query = (torch.randn(12, 4, 64) * 2).to(dtype)
    order = torch.randperm(blocks).tolist()
    segments = [(list(range(10)), order[:70], 70 * 32 - 5), ([10], order[70:80], 300),
                ([11], order[:20], 20 * 32)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = run_segments(cache, query, segments, 64 ** -0.5, layout)
    finally:
        torch.set_num_threads(before)
    token_slots = [[b * block_size + t for b in seg_blocks for t in range(block_size)][:length]
                   for _, seg_blocks, length in segments]
    assert_segments(out, lse, query, keys, values, 64 ** -0.5, segments, token_slots)


@pytest.mark.parametrize("layout", ["amx", "nhd"])
def test_tiles_multiply_bf16_blocks_where_built(tile_kernel, layout):
    """A tile build's tile path differs from its AVX-512 path in the last bits only (P in
    two bf16 parts): it ran, and both are within the reference's bound above."""
    torch.manual_seed(4)
    keys, values = torch.randn(4 * 32, 2, 128).bfloat16(), torch.randn(4 * 32, 2, 128).bfloat16()
    cache = (keys, values) if layout == "nhd" else write_cache(keys, values, 32, "amx")
    blocks = torch.randperm(113 if layout == "nhd" else 4).int()
    query = torch.randn(20, 8, 128).bfloat16()
    args = (torch.tensor([0, 20]), torch.arange(20), torch.tensor([0, len(blocks)]), blocks,
            torch.tensor([113], dtype=torch.int32))
    outputs = []
    for use_tiles in (True, False):
        out, lse = torch.empty(20, 8, 128), torch.empty(20, 8)
        cpu_kernel.segment_attention(cache, query, 0.1, *args, out, lse, layout, use_tiles)
        outputs.append(out)
    difference = (outputs[0] - outputs[1]).abs().max()
    assert 0 < difference < 1e-5 * outputs[1].abs().max()


@pytest.mark.parametrize(("tokens", "tiled"), [(1, False), (2, True), (9, True)])
def test_few_rows_multiply_in_registers(tile_kernel, tokens, tiled):
    """A segment of fewer than 8 query rows (here: tokens x 4 query heads per KV head) is
    attended in registers even where tiles are asked for (tiles pad rows to 16); 8 rows
    and more, in chunks of 32 with the last chunk padded, in tiles."""
    torch.manual_seed(5)
    keys, values = torch.randn(300, 2, 64).bfloat16(), torch.randn(300, 2, 64).bfloat16()
    cache = write_cache(keys, values, 32, "amx")
    query = torch.randn(tokens, 8, 64).bfloat16()
    args = (torch.tensor([0, tokens]), torch.arange(tokens), torch.tensor([0, 10]),
            torch.randperm(10).int(), torch.tensor([300], dtype=torch.int32))
    outputs = []
    for use_tiles in (True, False):
        out, lse = torch.empty(tokens, 8, 64), torch.empty(tokens, 8)
        cpu_kernel.segment_attention(cache, query, 0.125, *args, out, lse, "amx", use_tiles)
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1]) != tiled
    assert (outputs[0] - outputs[1]).abs().max() < 1e-5 * outputs[1].abs().max()


@pytest.mark.skipif("amx_bf16" not in cpu_kernel._cpu_flags(),
                    reason="no AMX on this CPU: the tile path ran emulated above")
def test_this_cpus_build_multiplies_in_amx_tiles():
    assert cpu_kernel.tiles() == "amx"
    assert cpu_kernel.isa().startswith("amx tiles")


def test_prefix_and_suffix_partials_merge_in_place_as_merge_partials_does(kernel):
    """``feather_merge_halves`` (attend_groups' merge): row i becomes the merge of rows i and
    rows + i, exactly as ``partials.merge_partials``, parts of no tokens (LSE -inf)
    included."""
    torch.manual_seed(6)
    rows, heads, dim = 5, 3, 48
    out = torch.randn(2 * rows, heads, dim)
    lse = torch.randn(2 * rows, heads) * 4
    lse[1, 0] = lse[rows + 2, 1] = -torch.inf  # one part empty
    lse[3, 2] = lse[rows + 3, 2] = -torch.inf  # both: zeros, -inf
    expected = merge_partials(out[:rows], lse[:rows], out[rows:], lse[rows:])
    expected_lse = torch.logaddexp(lse[:rows], lse[rows:])
    kernel.feather_merge_halves(rows, heads, dim, out.data_ptr(), lse.data_ptr(), 2)
    assert torch.allclose(out[:rows], expected, atol=1e-6, rtol=1e-5)
    assert torch.allclose(lse[:rows], expected_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[3, 2], torch.zeros(dim))
