"""The Triton source of ``triton_kernels``: the attend and merge kernels (``attend``,
``merge``) and the attend kernel's token loop (``attend_tokens``).

Importing this module imports Triton and defines the kernels, so only
``triton_kernels._kernels`` imports it, on the first launch: ``TRITON_INTERPRET=1`` set
before then runs them in Triton's CPU interpreter.
"""

from __future__ import annotations

import inspect
from typing import Any

import triton
import triton.language as tl


def _jit(**options: Any) -> Any:
    """``triton.jit`` with the options this Triton takes (``do_not_specialize_on_alignment``
    is newer than some releases users run)."""
    known = inspect.signature(triton.jit).parameters
    return triton.jit(**{name: value for name, value in options.items() if name in known})


@triton.jit
def attend_tokens(q, k_ptr, k_stride_block, k_stride_slot, k_stride_head, k_stride_dim,
                  v_ptr, v_stride_block, v_stride_slot, v_stride_head, v_stride_dim,
                  table, table_stride_col, first, start, end, kv_head, d, scale,
                  BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    # ``attend``'s online softmax of one query tile ``q`` over the tokens ``start`` to
    # ``end`` of a block-table row (``table``, from position ``first``), ``BLOCK_T`` at a
    # time: the unnormalised output, the running max and the running sum, in fp32.
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        live = t < end
        position = first + t
        block = tl.load(table + (position // BLOCK_SIZE) * table_stride_col, mask=live,
                        other=0).to(tl.int64)
        slot = position % BLOCK_SIZE
        k = tl.load(k_ptr + block[:, None] * k_stride_block + slot[:, None] * k_stride_slot
                    + kv_head * k_stride_head + d[None, :] * k_stride_dim,
                    mask=live[:, None], other=0.0).to(DOT)
        v = tl.load(v_ptr + block[:, None] * v_stride_block + slot[:, None] * v_stride_slot
                    + kv_head * v_stride_head + d[None, :] * v_stride_dim,
                    mask=live[:, None], other=0.0).to(DOT)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Sizes that vary per call are not specialised on, nor the alignment of the small index
# arrays (views into one packed buffer, whose 16-byte alignment changes with the
# number of groups and rows) or of the optional pointers (a stand-in array where
# unused): one compile serves every batch, none mid-run.
@_jit(do_not_specialize=["table_stride_row", "per_segment", "tiles", "splits", "num_rows"],
      do_not_specialize_on_alignment=["q_rows_ptr", "table_ptr", "seg_rows_ptr",
                                      "seg_starts_ptr", "seg_lengths_ptr", "members_ptr",
                                      "count_ptr"])
def attend(q_ptr, q_stride_row, q_stride_head, q_stride_dim, q_rows_ptr,
           k_ptr, k_stride_block, k_stride_slot, k_stride_head, k_stride_dim,
           v_ptr, v_stride_block, v_stride_slot, v_stride_head, v_stride_dim,
           table_ptr, table_stride_row, table_stride_col,
           seg_rows_ptr, seg_starts_ptr, seg_lengths_ptr, members_ptr, per_segment,
           count_ptr, tiles, splits, num_rows, parts_ptr, lse_ptr, scale,
           KV_HEADS: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr,
           DOT: tl.constexpr, PRECISION: tl.constexpr, BY_MEMBER_SLOT: tl.constexpr,
           QUERY_ROWS: tl.constexpr, HAS_COUNT: tl.constexpr):
    # One program: one KV head x one tile of a segment's query rows x one token split,
    # for one segment, or (HAS_COUNT) for every live segment its place in the grid's
    # last dimension strides over (a grid fixed by the engine's limits, smaller than
    # the most segments: an empty step costs a launch, not a wave per segment).
    # Program order puts KV heads first, then splits, then segments, so adjacent
    # segments run at the same time.
    kv_head = tl.program_id(0)
    tile = tl.program_id(1) % tiles
    split = tl.program_id(1) // tiles
    if HAS_COUNT:  # the live segments, strided over the grid's programs
        first_seg, end_seg, step = tl.program_id(2), tl.load(count_ptr), tl.num_programs(2)
    else:
        first_seg, end_seg, step = tl.program_id(2), tl.program_id(2) + 1, 1
    for seg in range(first_seg, end_seg, step):
        r = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
        member = seg * per_segment + r // GQA
        row = tl.load(members_ptr + member, mask=r // GQA < per_segment, other=-1)
        valid = row >= 0
        row = tl.where(valid, row, 0).to(tl.int64)
        token = (tl.load(q_rows_ptr + row, mask=valid, other=0).to(tl.int64) if QUERY_ROWS
                 else row)
        head = kv_head * GQA + r % GQA
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * q_stride_row + head[:, None] * q_stride_head
                    + d[None, :] * q_stride_dim, mask=valid[:, None], other=0.0).to(DOT)
        # This split's share of the range, in whole BLOCK_T steps; none for a padding tile.
        length = tl.load(seg_lengths_ptr + seg)
        per_split = tl.cdiv(tl.cdiv(length, splits), BLOCK_T) * BLOCK_T
        start = split * per_split
        end = tl.minimum(start + per_split, length)
        end = tl.where(tl.max(valid.to(tl.int32), 0) > 0, end, start)
        table = table_ptr + tl.load(seg_rows_ptr + seg).to(tl.int64) * table_stride_row
        first = tl.load(seg_starts_ptr + seg)
        acc, m_i, l_i = attend_tokens(
            q, k_ptr, k_stride_block, k_stride_slot, k_stride_head, k_stride_dim, v_ptr,
            v_stride_block, v_stride_slot, v_stride_head, v_stride_dim, table,
            table_stride_col, first, start, end, kv_head, d, scale, BLOCK_Q, BLOCK_T,
            BLOCK_SIZE, HEAD_DIM, DOT, PRECISION)
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        out_row = member.to(tl.int64) if BY_MEMBER_SLOT else row
        index = (split.to(tl.int64) * num_rows + out_row) * (KV_HEADS * GQA) + head
        tl.store(parts_ptr + index[:, None] * HEAD_DIM + d[None, :], out, mask=valid[:, None])
        tl.store(lse_ptr + index, lse, mask=valid)


@_jit(do_not_specialize=["num_parts", "num_rows"],
      do_not_specialize_on_alignment=["rows_ptr", "count_ptr"])
def merge(parts_ptr, lse_ptr, out_ptr, out_stride_row, out_stride_head, out_stride_dim,
          out_lse_ptr, rows_ptr, count_ptr, num_parts, num_rows, HEADS: tl.constexpr,
          HEADS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_ROWS: tl.constexpr,
          HAS_LSE: tl.constexpr, HAS_COUNT: tl.constexpr):
    # One program per parts row, all heads: the largest LSE first, then the weighted sum.
    if HAS_COUNT:  # the live rows, strided over the grid's programs (as in attend)
        first_row, end_row, step = tl.program_id(0), tl.load(count_ptr), tl.num_programs(0)
    else:
        first_row, end_row, step = tl.program_id(0), tl.program_id(0) + 1, 1
    for program_row in range(first_row, end_row, step):
        i = tl.cast(program_row, tl.int64)
        row = tl.load(rows_ptr + i).to(tl.int64) if HAS_ROWS else i
        h = tl.arange(0, HEADS_POW2)
        d = tl.arange(0, HEAD_DIM)
        keep = (h < HEADS) & (h * 0 + row >= 0)  # vector masks (the interpreter's rule)
        top = tl.full([HEADS_POW2], float("-inf"), tl.float32)
        for p in range(num_parts):
            lse = tl.load(lse_ptr + (p * num_rows + i) * HEADS + h, mask=keep,
                          other=float("-inf"))
            top = tl.maximum(top, lse)
        top = tl.where(top > float("-inf"), top, 0.0)  # a row of empty parts: weights 0
        total = tl.zeros([HEADS_POW2], tl.float32)
        acc = tl.zeros([HEADS_POW2, HEAD_DIM], tl.float32)
        for p in range(num_parts):
            index = (p * num_rows + i) * HEADS + h
            lse = tl.load(lse_ptr + index, mask=keep, other=float("-inf"))
            weight = tl.exp(lse - top)
            o = tl.load(parts_ptr + index[:, None] * HEAD_DIM + d[None, :],
                        mask=(lse > float("-inf"))[:, None], other=0.0)
            total += weight
            acc += weight[:, None] * o
        seen = total > 0
        out = acc / tl.where(seen, total, 1.0)[:, None]
        tl.store(out_ptr + row * out_stride_row + h[:, None] * out_stride_head
                 + d[None, :] * out_stride_dim, out, mask=keep[:, None])
        if HAS_LSE:
            merged_lse = tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
            tl.store(out_lse_ptr + row * HEADS + h, merged_lse, mask=keep)
