"""Paged decode attention over per-segment token ranges, in Triton: the GPU kernels of
shared-prefix (cascade) decode.

A *segment* is a set of query rows that attend one token range of one block-table row.
Shared-prefix decode runs two launches: one segment per prefix group (its rows, its
prefix), so each prefix KV tile is loaded once per tile of up to 64 query rows instead of
once per request; and one segment per row for the rest of its context.  Each writes fp32
partials and their natural-log LSE (vLLM's ``merge_attn_states`` convention), and
``merge_partials`` combines them exactly.

The KV cache is vLLM's per-layer GPU view (``key_cache``, ``value_cache``: ``[num_blocks,
block_size, kv_heads, head_dim]``, any strides).  Only torch is imported here; Triton on
the first launch.  Under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, whose bf16
multiplication is wrong) the dot products run in fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor

MAX_SPLITS = 32
"""Most split-K partitions of one segment's token range."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The query and cache dtypes the kernels read (one for all three)."""
HEAD_SIZES = "powers of two from 16"
"""The head sizes the kernels read (``head_size_fits``), as a log line names them."""


def head_size_fits(head_dim: int) -> bool:
    """Whether the kernels read heads of ``head_dim`` (``HEAD_SIZES``: a tile's
    ``tl.arange`` is a power of two, ``tl.dot`` at least 16 wide)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@dataclass(frozen=True)
class TableSegments:
    """Query rows attending one token range of one block-table row each: int32 tensors on
    the query's device.

    Grouped prefix: one segment per group, ``members`` its batch rows, ``starts`` 0,
    ``lengths`` its prefix tokens. Per-row suffix: one segment per row, ``members`` that
    row alone, ``starts`` the row's first suffix token, ``lengths`` its suffix tokens.
    """

    table_rows: Tensor
    """[n]: the block-table row each segment reads."""
    starts: Tensor
    """[n]: position of the first attended token in that row (block column
    ``start // block_size``, slot ``start % block_size``; need not be block-aligned)."""
    lengths: Tensor
    """[n]: tokens attended from ``starts`` on; 0 gives LSE -inf and a zero output."""
    members: Tensor
    """[n, k]: the query rows (also the output rows) attending each segment, -1 padding
    segments with fewer than k. A row may be a member of at most one segment per launch."""

    def __len__(self) -> int:
        return self.table_rows.shape[0]


def split_count(segments: TableSegments, query: Tensor, kv_heads: int, max_length: int,
                num_sms: int) -> int:
    """Token splits per segment giving about two programs per SM (flash-decoding's split-K):
    1 when the grid already fills the GPU, at most ``MAX_SPLITS``, and at least one tile of
    tokens (64; 32 above head_dim 128) of ``max_length`` (the longest segment) per split.
    Host arithmetic only."""
    head_dim = query.shape[2]
    programs = len(segments) * kv_heads * _row_tiles(segments, query.shape[1] // kv_heads,
                                                     head_dim)[1]
    by_length = _cdiv(max_length, _tile_limits(head_dim)[1])
    return max(1, min(MAX_SPLITS, _cdiv(2 * num_sms, programs), by_length))


def attend_segments(query: Tensor, key_cache: Tensor, value_cache: Tensor,
                    block_table: Tensor, segments: TableSegments, scale: float, parts: Tensor,
                    lse: Tensor) -> None:
    """Write ``parts[i, row]`` (fp32, ``[splits, rows, q_heads, head_dim]``) and ``lse[i, row]``
    (fp32, ``[splits, rows, q_heads]``) for every member row: split ``i`` of its segment's
    range, normalised over that split's tokens. A split with no tokens gets LSE -inf and a
    zero output; rows in no segment are not written. Merge with ``merge_partials``.

    query ``[num_tokens, q_heads, head_dim]`` (bf16, fp16 or fp32, any strides), caches
    of its dtype ``[num_blocks, block_size, kv_heads, head_dim]`` (any strides), block_table
    ``[rows, cols]`` int32. ``splits = parts.shape[0]``; ``parts`` and ``lse`` contiguous.
    At most 65535 segments per launch (a CUDA grid dimension).

    Cost: one program per (KV head, tile of up to 64 query rows of a segment, split); each
    reads its tokens' K and V once, so HBM traffic is about the sum over segments of
    length x row tiles x K and V per token, plus the outputs."""
    _check(query, key_cache, value_cache, block_table, segments, parts, lse)
    _launch_attend(query, key_cache, value_cache, block_table, segments, scale, parts, lse,
                   by_member_slot=False)


def segment_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor,
                      block_table: Tensor, segments: TableSegments, scale: float, out: Tensor,
                      lse: Tensor, splits: int = 1) -> None:
    """Write every member row's partial ``out`` (fp32 ``[rows, q_heads, head_dim]``) and
    ``lse`` (fp32 ``[rows, q_heads]``, natural log) over its segment's whole range: LSE
    -inf and a zero output where the range is empty; rows in no segment are not written.

    Inputs as for ``attend_segments``; ``splits`` from ``split_count``. With one split the
    kernel writes ``out`` and ``lse`` directly; with more, it writes the splits of each
    member slot to a scratch (fp32, splits x segments x k x q_heads x (head_dim + 1), k =
    ``members.shape[1]``) and a merge kernel combines them into the member rows."""
    if splits == 1:
        attend_segments(query, key_cache, value_cache, block_table, segments, scale,
                        out[None], lse[None])
        return
    slots = segments.members.numel()
    scratch = out.new_empty(splits, slots, *out.shape[1:])
    scratch_lse = lse.new_empty(splits, slots, lse.shape[1])
    _check(query, key_cache, value_cache, block_table, segments, scratch, scratch_lse)
    _launch_attend(query, key_cache, value_cache, block_table, segments, scale, scratch,
                   scratch_lse, by_member_slot=True)
    merge_partials(scratch, scratch_lse, out, lse, rows=segments.members.flatten())


def merge_partials(parts: Tensor, lse: Tensor, out: Tensor, out_lse: Tensor | None = None,
                   rows: Tensor | None = None) -> None:
    """``out[rows[i]] = sum_p exp(lse[p, i] - L) parts[p, i]`` with ``L = logsumexp_p
    lse[p, i]``, per head, in fp32, cast to ``out``'s dtype once; ``out_lse[rows[i]] = L``.

    parts ``[num_parts, n, heads, head_dim]`` and lse ``[num_parts, n, heads]`` fp32
    contiguous; out ``[rows, heads, head_dim]`` any float dtype and strides; out_lse fp32
    contiguous. ``rows`` (int32 ``[n]``, -1 skipped) defaults to ``0..n-1``. Parts with LSE
    -inf are not read (they may hold anything); a row whose parts are all -inf gets 0 and
    LSE -inf. Cost: one program per parts row (all heads), reading each live part once."""
    n = parts.shape[1]
    if parts.dtype != torch.float32 or lse.dtype != torch.float32:
        raise TypeError("parts and lse must be fp32")
    if rows is not None and (rows.dtype != torch.int32 or rows.shape != (n,)):
        raise TypeError(f"rows: int32 [{n}]")
    if not (parts.is_contiguous() and lse.is_contiguous()) or lse.shape != parts.shape[:3]:
        raise ValueError(f"parts {tuple(parts.shape)} / lse {tuple(lse.shape)}: contiguous, "
                         "lse one per parts row and head")
    if out_lse is not None and not (out_lse.is_contiguous() and out_lse.dtype == torch.float32):
        raise ValueError("out_lse must be a contiguous fp32 tensor")
    _launch_merge(parts, lse, out, out_lse, rows)


def _launch_merge(parts: Tensor, lse: Tensor, out: Tensor, out_lse: Tensor | None,
                  rows: Tensor | None, count: Tensor | None = None,
                  programs: int | None = None) -> None:
    """Launch the merge kernel: one program per parts row; with ``count`` (an int32 device
    scalar), the first ``count`` rows, strided over ``programs`` programs (default one per
    row)."""
    num_parts, n, heads, head_dim = parts.shape
    _kernels()[1][(programs or n,)](
        parts, lse, out, *out.stride(), out_lse if out_lse is not None else lse,
        rows if rows is not None else lse, lse if count is None else count, num_parts, n,
        **merge_constants(heads, head_dim, rows is not None, out_lse is not None,
                          count is not None), num_warps=4)


def merge_constants(heads: int, head_dim: int, has_rows: bool, has_lse: bool,
                    has_count: bool) -> dict[str, Any]:
    """The merge kernel's constexprs for one launch (as ``attend_constants``)."""
    return dict(HEADS=heads, HEADS_POW2=_pow2(heads), HEAD_DIM=head_dim, HAS_ROWS=has_rows,
                HAS_LSE=has_lse, HAS_COUNT=has_count)


def _launch_attend(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                   segments: TableSegments, scale: float, parts: Tensor, lse: Tensor,
                   by_member_slot: bool = False, query_rows: Tensor | None = None,
                   count: Tensor | None = None, programs: int | None = None) -> None:
    """Launch the attend kernel; its parts rows are the member values, or member slots
    ``segment x k + j`` when ``by_member_slot``. Members index ``query`` directly, or
    through ``query_rows`` (int32: the query token of each member value) where given. With
    ``count`` (an int32 device scalar), the first ``count`` segments, strided over
    ``programs`` programs per (KV head, tile, split) (default ``len(segments)``): the grid
    is fixed while the live work varies."""
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    gqa = query.shape[1] // kv_heads
    block_q, tiles = _row_tiles(segments, gqa, head_dim)
    splits = parts.shape[0]
    _launch_fitting(
        _kernels()[0], (kv_heads, tiles * splits, programs or len(segments)),
        (query, *query.stride(), segments.lengths if query_rows is None else query_rows,
         key_cache, *key_cache.stride(), value_cache, *value_cache.stride(), block_table,
         *block_table.stride(), segments.table_rows, segments.starts, segments.lengths,
         segments.members, segments.members.shape[1], segments.lengths if count is None
         else count, tiles, splits, parts.shape[1], parts, lse, scale),
        attend_constants(query.dtype, kv_heads, gqa, head_dim, key_cache.shape[1], block_q,
                         by_member_slot, query_rows is not None, count is not None))


_fitted: dict[tuple, dict[str, Any]] = {}
"""Per attend variant (its constexprs), the launch options that fit this device."""


def _fallbacks(constants: dict[str, Any]) -> list[dict[str, Any]]:
    """The attend kernel's launch options, from the tuned to the smallest: two pipeline
    stages, one, then half the token tile (at least 16, ``tl.dot``'s least): what a GPU
    with little shared memory (sm_75's 64 KB) can hold. Each is exact: the token tile
    only sets where a split's range is cut, and the splits merge by LSE."""
    tuned = {"num_warps": 4, "num_stages": 2, **constants}
    return [tuned, {**tuned, "num_stages": 1},
            {**tuned, "num_stages": 1, "BLOCK_T": max(16, constants["BLOCK_T"] // 2)}]


def _launch_fitting(kernel: Any, grid: tuple[int, ...], args: tuple,
                    constants: dict[str, Any]) -> None:
    """Launch ``kernel`` with the first options of ``_fallbacks`` that fit the device
    (Triton raises ``OutOfResources`` at the first launch of one that does not, before
    anything runs), remembered per variant: later launches, and graph captures after a
    warm-up, use it at once. The last failure is raised."""
    key = tuple(sorted(constants.items(), key=lambda item: item[0]))
    if key in _fitted:
        kernel[grid](*args, **_fitted[key])
        return
    from triton.runtime.errors import OutOfResources

    options = _fallbacks(constants)
    for index, option in enumerate(options):
        try:
            kernel[grid](*args, **option)
        except OutOfResources:
            if index == len(options) - 1:
                raise
            continue
        _fitted[key] = option
        return


def attend_constants(dtype: torch.dtype, kv_heads: int, gqa: int, head_dim: int,
                     block_size: int, block_q: int, by_member_slot: bool = False,
                     query_rows: bool = False, has_count: bool = False) -> dict[str, Any]:
    """The attend kernel's constexprs for one launch: with the argument layout (strides
    and alignment), what one compiled variant is specialised on."""
    return dict(KV_HEADS=kv_heads, GQA=gqa, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                BLOCK_Q=block_q, BLOCK_T=_tile_limits(head_dim)[1], DOT=_kernels()[2][dtype],
                PRECISION="ieee" if dtype == torch.float32 else None,  # fp32: no TF32
                BY_MEMBER_SLOT=by_member_slot, QUERY_ROWS=query_rows, HAS_COUNT=has_count)


def _check(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
           segments: TableSegments, parts: Tensor, lse: Tensor) -> None:
    """The shapes and dtypes the kernel assumes; a violation is a caller's bug, so it raises."""
    head_dim = query.shape[2]
    if query.dtype not in DTYPES or {key_cache.dtype, value_cache.dtype} != {query.dtype}:
        raise TypeError(f"query {query.dtype}, caches {key_cache.dtype}/{value_cache.dtype}: "
                        "one of bf16, fp16, fp32 for all three")
    if (key_cache.shape != value_cache.shape or key_cache.shape[3] != head_dim
            or query.shape[1] % key_cache.shape[2] or not head_size_fits(head_dim)):
        raise ValueError(f"query {tuple(query.shape)}, caches {tuple(key_cache.shape)}: "
                         "head_dim a power of two >= 16, q_heads a multiple of kv_heads")
    int32 = (block_table, segments.table_rows, segments.starts, segments.lengths,
             segments.members)
    if any(t.dtype != torch.int32 for t in int32) or segments.members.ndim != 2:
        raise TypeError("block_table and segments: int32; members [segments, k]")
    if (not segments.members.is_contiguous() or len(segments.members) != len(segments)
            or len(segments) > 65535):
        raise ValueError("members: contiguous, one row per segment; at most 65535 segments")
    if parts.dtype != torch.float32 or lse.dtype != torch.float32:
        raise TypeError("parts and lse must be fp32")
    if (not (parts.is_contiguous() and lse.is_contiguous())
            or parts.shape[2:] != query.shape[1:] or lse.shape != parts.shape[:3]):
        raise ValueError(f"parts {tuple(parts.shape)} / lse {tuple(lse.shape)}: contiguous "
                         f"[splits, rows, {query.shape[1]}, {head_dim}] and [splits, rows, "
                         f"{query.shape[1]}]")


def _tile_limits(head_dim: int) -> tuple[int, int]:
    """(most query rows, tokens) per program tile: 64 and 64 up to head_dim 128, halved for
    wider heads so the fp32 accumulator stays in registers."""
    size = 64 if head_dim <= 128 else 32
    return size, size


def _row_tiles(segments: TableSegments, gqa: int, head_dim: int) -> tuple[int, int]:
    """(query rows per program, at least 16 for ``tl.dot``; row tiles per segment)."""
    return row_tiles(segments.members.shape[1], gqa, head_dim)


def row_tiles(members: int, gqa: int, head_dim: int) -> tuple[int, int]:
    """(query rows per program, row tiles per segment) of segments of ``members`` rows."""
    rows = members * gqa
    block_q = max(16, min(_tile_limits(head_dim)[0], _pow2(rows)))
    return block_q, _cdiv(rows, block_q)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@cache
def _kernels() -> tuple[Any, Any, dict[torch.dtype, Any]]:
    """(attend, merge, dot dtype per input dtype), defined on first use: ``triton_jit``,
    which imports Triton, is imported here."""
    import triton.language as tl

    from feather_sched.attention import triton_jit

    # The interpreter multiplies bf16 wrongly: there every dot runs in fp32.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    dot = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
    return triton_jit.attend, triton_jit.merge, ({t: tl.float32 for t in dot} if interpreted
                                                 else dot)
