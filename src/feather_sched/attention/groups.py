"""Find each step's prefix groups in a block table, and plan the step around them.

A group is a set of decode rows (one query token each) whose block-table rows start with
the same physical block ids, compared row by row, never by reference counts (a block
freed late can look shared: vLLM #55227); only full blocks strictly below the block
written this step count, so no shared block is written while it is read.  Rows go into a
trie of their block ids, each compared only as far as it shares with another (the cost
grows with what rows share, not with their context), and runs are split where that saves
the most prefix reads.

``plan_step`` turns the groups into work: one segment per group (its queries over the
shared prefix) and one per grouped row (its own suffix), plus the sequence lengths with
every grouped row cut to one token, for the engine's kernel to run the whole batch.
``plan_token_step`` does the same for KV listed token by token (SGLang's ``req_to_token``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MIN_SHARED_TOKENS = 256
"""Shortest prefix worth a group: below it, the extra suffix pass and merge cost more than
the prefix reads they save (cascade kernels lose below ~256-512 shared tokens)."""
MIN_ROWS = 2
"""Smallest group: a singleton reads its prefix once anyway."""
DIRECT_COMPARE = 1 << 17
"""Up to this many ids (rows x columns) are compared at once, without probing first."""
MAX_HEAD_RUNS = 32
"""Up to this many classes a compare goes class by class (``_differs``), and first blocks
of two or more rows are tried one by one as uniform groups (``_stars``); beyond, one
gather (the trie) is cheaper than the Python loop."""
TOKEN_CHUNK = 16
"""Tokens a token table's rows are compared by while groups are found (``plan_token_step``):
the trie then walks a table this many times narrower."""


@dataclass(frozen=True)
class Groups:
    """Grouped decode rows: ``rows[offsets[g]:offsets[g+1]]`` share ``shared[g]`` blocks."""

    rows: np.ndarray
    """int64 batch rows, group by group."""
    offsets: np.ndarray
    """int64 [groups + 1]."""
    shared: np.ndarray
    """int64 [groups]: leading blocks each group's rows share."""

    def __len__(self) -> int:
        return len(self.shared)

    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row_shared(self) -> np.ndarray:
        """Shared blocks of each row in ``rows``."""
        return np.repeat(self.shared, self.sizes())

    def only(self, keep: np.ndarray, shared: np.ndarray | None = None) -> Groups:
        """The groups where ``keep`` (bool per group) holds, with ``shared`` (per group)
        in place of theirs if given.  O(rows)."""
        shared = self.shared if shared is None else shared
        if not keep.any():
            return _no_groups()
        members = [self.rows[lo:hi] for lo, hi, kept in zip(
            self.offsets[:-1], self.offsets[1:], keep, strict=True) if kept]
        return Groups(np.concatenate(members), np.cumsum([0] + [len(m) for m in members]),
                      shared[keep].astype(np.int64))


BySize = tuple[tuple[int, int | None], ...]
"""From how many shared tokens a group is worth its own pass, by its size: entry
``(rows, tokens)`` for groups of at least ``rows`` rows (rows ascending), the first entry
also for smaller groups; ``tokens`` None: never.  Empty: every group found is worth it
(what the self-check measured per size, ``selfcheck.Verdict.by_size``)."""


NEVER = np.iinfo(np.int64).max
"""What ``required_tokens`` asks of a size ``BySize`` never groups."""


def required_tokens(by_size: BySize, sizes: np.ndarray) -> np.ndarray:
    """The shared tokens non-empty ``by_size`` asks of a group of each of ``sizes`` rows
    (int64; ``NEVER`` where it groups none of that size).  O(sizes x log entries)."""
    least = np.array([rows for rows, _ in by_size])
    needed = np.array([NEVER if tokens is None else tokens for _, tokens in by_size],
                      dtype=np.int64)
    return needed[np.maximum(np.searchsorted(least, sizes, side="right") - 1, 0)]


def worth_by_size(groups: Groups, by_size: BySize, unit: int) -> Groups:
    """``groups`` less those sharing fewer tokens than ``by_size`` asks of their size
    (``groups.shared`` counts ``unit`` tokens each).  O(groups + rows) where any is cut."""
    if not by_size or not len(groups):
        return groups
    keep = groups.shared * unit >= required_tokens(by_size, groups.sizes())
    return groups if keep.all() else groups.only(keep)


def min_blocks(block_size: int, min_tokens: int = MIN_SHARED_TOKENS) -> int:
    """Fewest shared blocks worth a group at this block size: ``min_tokens`` rounded up."""
    return max(1, -(-min_tokens // block_size))


def find_groups(block_table: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                block_size: int, min_shared_blocks: int, min_rows: int = MIN_ROWS,
                table_rows: np.ndarray | None = None) -> Groups:
    """The decode rows sharing at least ``min_shared_blocks`` leading blocks, grouped.

    ``seq_lens`` (tokens including this step's) and ``query_lens`` (this step's new
    tokens) per batch row, any row order; ``block_table`` ``[table rows, width]`` (int),
    where batch row ``r`` reads row ``table_rows[r]`` (int per batch row; by default row
    ``r``), e.g. its request slot in a runner's table: only the rows and columns compared
    are read, never a gather of every row.  ``Groups`` lists batch rows.  Rows are
    placed in a trie of their block ids (``_trie_order``), which compares each row only
    as far as it shares with another, and the trie's runs are split where that saves the
    most prefix reads; first, the rows of each first block whose rows all share the same
    blocks, the usual group, are settled by one compare with its first row (``_stars``).
    Cost: O(rows log rows + shared blocks of the candidate rows), not rows x context;
    O(rows) for a batch whose rows all start on different blocks.
    """
    decode = np.flatnonzero(query_lens == 1)
    full = (seq_lens[decode].astype(np.int64) - 1) // block_size
    keep = full >= max(min_shared_blocks, 1)  # a group shares at least one block
    candidates, full = decode[keep], full[keep]
    slots = candidates if table_rows is None else table_rows[candidates]
    first_blocks = block_table[slots, 0]
    if len(candidates) < min_rows or distinct(first_blocks):
        return _no_groups()
    stars, rest = _stars(block_table, slots, full, first_blocks)
    found = [(candidates[rows], shared) for rows, shared in stars
             if shared >= min_shared_blocks and len(rows) >= min_rows]
    if len(rest) >= min_rows:
        order, common = _trie_order(block_table, slots[rest], full[rest])
        order = candidates[rest[order]]
        found += [(order[lo:hi + 1], shared)
                  for lo, hi, shared in _spans(common, min_shared_blocks, min_rows)]
    if not found:
        return _no_groups()
    members = [rows for rows, _ in found]
    return Groups(np.concatenate(members), np.cumsum([0] + [len(m) for m in members]),
                  np.array([shared for _, shared in found], dtype=np.int64))


def _stars(table: np.ndarray, rows: np.ndarray, full: np.ndarray, first_blocks: np.ndarray
           ) -> tuple[list[tuple[np.ndarray, int]], np.ndarray]:
    """The classes of ``rows`` (rows of ``table``) by first block whose every two rows share
    the same leading blocks (within both rows' ``full``): (positions in ``rows``, shared),
    and the positions of the rows of every other class of two or more rows, for the trie.

    A class's guess is what its first two rows share; it holds if every row has as many
    full blocks and equals the first row on the guessed columns (the last one checked
    first, the rest only if that holds), and past them no two rows that go on share their
    next block.  A class's rows are in the trie's order (its first row, then by next
    block).  Classes of one row are dropped (they share nothing).  O(rows log rows +
    the blocks the accepted classes share); above ``MAX_HEAD_RUNS`` classes of two or more
    rows every row goes to the trie (the loop over classes would cost more)."""
    order = np.argsort(first_blocks, kind="stable")
    sizes = np.diff(np.append(np.flatnonzero(_changes(first_blocks[order])), len(order)))
    multi = sizes >= 2
    members = order[np.repeat(multi, sizes)]  # class by class
    sizes = sizes[multi]
    if len(sizes) > MAX_HEAD_RUNS:
        return [], members
    starts = np.cumsum(sizes) - sizes
    heads, seconds = members[starts], members[starts + 1]
    limit = np.minimum(full[heads], full[seconds])
    guess = _first_difference(table, rows[seconds], rows[heads], 0, int(limit.max()), limit)
    cls = np.repeat(np.arange(len(sizes)), sizes)
    shared, head = guess[cls], heads[cls]
    checked = np.maximum(shared - 1, 0)
    holds = (full[members] >= shared) & (
        table[rows[members], checked] == table[rows[head], checked])
    value = np.where(full[members] > shared,  # the next block, or the trie's stand-in
                     table[rows[members], np.minimum(shared, table.shape[1] - 1)],
                     -1 - members)
    later = members != head
    wrong = np.zeros(len(sizes), dtype=bool)
    wrong[cls[~holds | (later & (value == value[starts][cls]))]] = True  # or on with the first
    # (class, first row or not, next block) as one int64: the trie's order of the class
    key = (cls << 34) + (later.astype(np.int64) << 33) + value + (1 << 32)
    order = np.argsort(key)
    members, key = members[order], key[order]
    wrong[key[1:][key[1:] == key[:-1]] >> 34] = True  # two later rows go on together
    stars, rest = [], []
    for c, (lo, n, blocks) in enumerate(zip(starts.tolist(), sizes.tolist(), guess.tolist(),
                                            strict=True)):
        rows_c = members[lo:lo + n]
        if wrong[c] or (blocks > 2 and _differs(table, rows[rows_c], rows[rows_c[:1]].repeat(n),
                                                1, blocks - 1).any()):
            rest.append(rows_c)
        else:
            stars.append((rows_c, blocks))
    return stars, np.concatenate(rest) if rest else members[:0]


def _trie_order(table: np.ndarray, rows: np.ndarray, full: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """An order of ``rows`` (rows of ``table``; the order as positions in ``rows``) where
    rows sharing a prefix are adjacent, and ``common[i]``, the leading blocks rows ``i``
    and ``i + 1`` of that order share (ids equal, within both rows' ``full`` blocks): what
    a lexicographic sort of the rows' full blocks gives, up to the order of siblings.

    The rows are placed in a trie of their block ids, one level a pass over every class
    at once: the rows of a class (known equal on its first columns) are compared with its
    first row, the head (``_shared_with``), and those that leave the head's path at one
    column with one block id form a class of the next level.  Each row keeps, per level,
    its rank among its class's children (the head first, then the children deepest
    first) and the depth at which it left; a sort by the ranks is the order, and two
    neighbours share the depth at which the second left the first's path.  O(rows log
    rows + the blocks each row shares) per level, in numpy; the levels are the nesting of
    the batch's prefixes (one per shared-prefix length that some rows go beyond).
    """
    count = len(rows)
    _, first = np.unique(table[rows, 0], return_inverse=True)
    ranks, lefts = [first.astype(np.int64)], [np.zeros(count, dtype=np.int64)]
    active = np.flatnonzero(np.bincount(first)[first] >= 2)
    classes, starts = first[active], np.ones(len(active), dtype=np.int64)
    while len(active):
        order = np.lexsort((active, classes))
        active, classes, starts = active[order], classes[order], starts[order]
        is_head = _changes(classes)
        heads = active[is_head][np.cumsum(is_head) - 1]
        later, heads, parents = active[~is_head], heads[~is_head], classes[~is_head]
        left = _shared_with(table, rows, later, heads, full, starts[~is_head])
        value = np.where(left < full[later],
                         table[rows[later], np.minimum(left, table.shape[1] - 1)],
                         -1 - later).astype(np.int64)
        order = np.lexsort((value, -left, parents))
        later, left, value, parents = later[order], left[order], value[order], parents[order]
        new_child = _changes(parents, left, value)
        child = np.cumsum(new_child) - 1
        first_of_parent = _changes(parents)
        rank = np.zeros(count, dtype=np.int64)
        rank[later] = child - child[first_of_parent][np.cumsum(first_of_parent) - 1] + 1
        depth = np.zeros(count, dtype=np.int64)
        depth[later] = left
        ranks.append(rank)
        lefts.append(depth)
        keep = np.bincount(child)[child] >= 2
        active, classes, starts = later[keep], child[keep], left[keep] + 1
    order = np.lexsort(ranks[::-1])
    ranks_in_order = np.stack(ranks)[:, order]
    level = (ranks_in_order[:, 1:] != ranks_in_order[:, :-1]).argmax(axis=0)
    common = np.stack(lefts)[level, order[1:]]
    return order, common


def _shared_with(table: np.ndarray, rows: np.ndarray, later: np.ndarray, heads: np.ndarray,
                 full: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """For each row ``rows[later[i]]``, known equal to ``rows[heads[i]]`` on
    ``[0, starts[i])``: the leading blocks the two share, at most either's ``full``.
    Columns are probed at ``start + 2^k - 1`` first, so a row is compared in full only up
    to about twice what it shares (the rows a probe bounds alike in one numpy compare):
    O(rows x shared)."""
    limit = np.minimum(full[later], full[heads])
    shared = np.minimum(starts, limit)
    live = np.flatnonzero(limit > starts)
    if not len(live):
        return shared
    mine, theirs = rows[later[live]], rows[heads[live]]
    start, end = starts[live], limit[live]
    lo, hi = int(start.min()), int(end.max())
    if len(live) * (hi - lo) <= DIRECT_COMPARE:  # small enough to compare at once
        shared[live] = _first_difference(table, mine, theirs, lo, hi, end)
        return shared
    span = int((end - start).max())
    probes = start[:, None] + (1 << np.arange(span.bit_length())) - 1
    beyond = probes >= end[:, None]
    columns = np.minimum(probes, end[:, None] - 1)
    differs = (table[mine[:, None], columns] != table[theirs[:, None], columns]) | beyond
    first = differs.argmax(axis=1)
    found = differs[np.arange(len(live)), first]
    bound = np.where(found, columns[np.arange(len(live)), first] + 1, end)
    bucket = np.where(found, first + 1, 0)  # by the probe that bounds them; 0: none did
    for probe in np.flatnonzero(np.bincount(bucket)).tolist():
        picked = np.flatnonzero(bucket == probe)
        shared[live[picked]] = _first_difference(
            table, mine[picked], theirs[picked], int(start[picked].min()),
            int(bound[picked].max()), end[picked])
    return shared


def _first_difference(table: np.ndarray, mine: np.ndarray, theirs: np.ndarray, lo: int,
                      hi: int, end: np.ndarray) -> np.ndarray:
    """Per row, the first column in ``[lo, hi)`` where ``mine``'s ids differ from
    ``theirs`` or that is at or past its ``end``; ``hi`` where none is."""
    window = _differs(table, mine, theirs, lo, hi)
    if int(end.min()) < hi:
        window |= np.arange(lo, hi) >= end[:, None]
    at = window.argmax(axis=1)
    return np.where(window[np.arange(len(mine)), at], lo + at, hi)


def _differs(table: np.ndarray, mine: np.ndarray, theirs: np.ndarray, lo: int,
             hi: int) -> np.ndarray:
    """``table[mine, lo:hi] != table[theirs, lo:hi]``, comparing against each head's row in
    place where ``theirs`` runs in few heads (a head's row is not copied for each member:
    half the memory traffic of the plain gather).  O(len(mine) x (hi - lo))."""
    starts = np.flatnonzero(_changes(theirs))
    if len(starts) > MAX_HEAD_RUNS:
        return table[mine, lo:hi] != table[theirs, lo:hi]
    window = np.empty((len(mine), hi - lo), dtype=bool)
    for begin, end in zip(starts.tolist(), [*starts[1:].tolist(), len(mine)], strict=True):
        np.not_equal(table[mine[begin:end], lo:hi], table[theirs[begin], lo:hi],
                     out=window[begin:end])
    return window


def _changes(*keys: np.ndarray) -> np.ndarray:
    """True first and wherever any of ``keys`` differs from its element before (cheaper
    than ``np.r_``'s parsing, on every step)."""
    out = np.empty(len(keys[0]), dtype=bool)
    out[:1] = True
    np.not_equal(keys[0][1:], keys[0][:-1], out=out[1:])
    for key in keys[1:]:
        out[1:] |= key[1:] != key[:-1]
    return out


def distinct(first_blocks: np.ndarray | torch.Tensor) -> bool:
    """Whether no two rows share their first block, so none shares a prefix: the usual
    batch where nothing is shared, settled without sorting the block table.  A set of
    Python ints, cheaper than ``np.unique`` (docs/results.md#real-workloads), since this
    runs on every step of every engine that loads Feather.  O(rows)."""
    values = first_blocks.tolist()
    return len(set(values)) == len(values)


def _no_groups() -> Groups:
    empty = np.zeros(0, dtype=np.int64)
    return Groups(empty, np.zeros(1, dtype=np.int64), empty)


def _spans(common: np.ndarray, min_shared: int, min_rows: int) -> list[tuple[int, int, int]]:
    """``_best_spans`` over each run of neighbours sharing at least ``min_shared`` blocks
    (a pair sharing less is never inside a group); a run sharing the same blocks
    throughout, the usual group, is settled in numpy.  O(rows) plus ``_best_spans`` over
    the runs that share unevenly."""
    cuts = np.flatnonzero(common < min_shared)
    starts = np.concatenate(([0], cuts + 1))
    ends = np.append(cuts, len(common))  # run of pairs [start, end): rows start..end
    keep = (ends > starts) & (ends - starts + 1 >= min_rows)  # a pair at least
    starts, ends = starts[keep], ends[keep]
    if not len(starts):
        return []
    bounds = np.column_stack((starts, ends)).ravel()  # reduce over [start, end), then a cut's
    padded = np.append(common, 0)
    low = np.minimum.reduceat(padded, bounds)[::2]
    high = np.maximum.reduceat(padded, bounds)[::2]
    spans: list[tuple[int, int, int]] = []
    for lo, hi, least, most in zip(starts.tolist(), ends.tolist(), low.tolist(), high.tolist(),
                                   strict=True):
        if least == most:
            spans.append((lo, hi, least))
        else:
            spans += [(lo + a, lo + b, shared) for a, b, shared in
                      _best_spans(common[lo:hi], min_shared, min_rows)]
    return spans


def _best_spans(common: np.ndarray, min_shared: int, min_rows: int) -> list[tuple[int, int, int]]:
    """Spans (lo, hi, shared) of sorted rows to group, saving the most prefix reads.

    ``common[i]``: blocks rows i and i+1 share. A span shares the minimum of its
    ``common``; grouping it saves (rows - 1) x shared block reads; splitting it at that
    minimum may save more (each side shares more). A span whose rows all share the same
    blocks is settled at once (the usual case: one group's rows). Post-order over the
    split tree with an explicit stack (a batch can be deeper than Python's recursion
    limit).
    """
    values = common.tolist()
    best: dict[tuple[int, int], tuple[int, list[tuple[int, int, int]]]] = {}
    stack = [(0, len(values), False)]
    while stack:
        lo, hi, ready = stack.pop()
        span = values[lo:hi]
        if hi - lo + 1 < min_rows:
            best[lo, hi] = (0, [])
            continue
        shared = min(span)
        whole = (hi - lo) * shared if shared >= min_shared else 0
        if not ready and shared == max(span):  # no split shares more
            best[lo, hi] = (whole, [(lo, hi, shared)] if whole else [])
            continue
        cut = lo + span.index(shared)
        if not ready:
            stack += [(lo, hi, True), (lo, cut, False), (cut + 1, hi, False)]
            continue
        (left, left_spans), (right, right_spans) = best.pop((lo, cut)), best.pop((cut + 1, hi))
        if whole > 0 and whole >= left + right:
            best[lo, hi] = (whole, [(lo, hi, shared)])
        else:
            best[lo, hi] = (left + right, left_spans + right_spans)
    return best[0, len(values)][1]


@dataclass(frozen=True)
class Segments:
    """Token ranges of KV blocks, each attended by some query tokens (the kernels' input).

    Segment ``s``: query tokens ``tokens[token_offsets[s]:token_offsets[s+1]]`` over the
    first ``lengths[s]`` tokens of blocks ``blocks[block_offsets[s]:block_offsets[s+1]]``;
    its outputs are rows ``token_offsets[s]...`` of the partials.
    """

    token_offsets: torch.Tensor
    tokens: torch.Tensor
    block_offsets: torch.Tensor
    blocks: torch.Tensor
    lengths: torch.Tensor

    @property
    def rows(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class StepPlan:
    """One step's shared-prefix work.

    ``segments`` holds every group's prefix segment, then every grouped row's suffix
    segment, in ``groups.rows`` order both times: partial rows ``[:n]`` are the prefix
    parts and ``[n:]`` the suffix parts of query tokens ``tokens`` (n = len(tokens)).
    """

    groups: Groups
    segments: Segments
    tokens: torch.Tensor
    """int64 query token of each grouped row."""
    seq_lens: torch.Tensor
    """The engine's sequence lengths with each grouped row cut to 1 token: its kernel then
    attends the row's first (full, shared) block's first token, a throwaway output."""


def plan_step(block_table: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor, num_reqs: int, block_size: int,
              min_shared_blocks: int, by_size: BySize = ()) -> StepPlan | None:
    """The step's plan, or None when no rows group (the engine then runs unchanged).

    CPU tensors in vLLM's shapes: ``block_table`` ``[>= num_reqs, width]`` int32,
    ``seq_lens`` ``[num_reqs]``, ``query_start_loc`` ``[num_reqs + 1]``; none is modified.
    Groups share at least ``min_shared_blocks`` and what ``by_size`` asks of their size.
    A batch whose rows all start on different blocks returns at once (a few us).
    """
    if distinct(block_table[:num_reqs, 0]):
        return None
    starts = query_start_loc[:num_reqs + 1].numpy()
    table = block_table[:num_reqs].numpy()
    lens = seq_lens[:num_reqs].numpy()
    groups = worth_by_size(find_groups(table, lens, np.diff(starts), block_size,
                                       min_shared_blocks), by_size, block_size)
    if not len(groups):
        return None
    return _plan(groups, table, groups.rows, lens, starts[groups.rows], block_size)


def plan_token_step(token_table: torch.Tensor, table_rows: torch.Tensor,
                    seq_lens: torch.Tensor, page_size: int,
                    min_shared_tokens: int, by_size: BySize = ()) -> StepPlan | None:
    """The plan of a decode step (one query token per row) whose KV is listed token by
    token, or None when no rows group: row ``i``'s token ``t`` is in KV slot
    ``token_table[table_rows[i], t]`` (SGLang's ``req_to_token`` and ``req_pool_indices``:
    CPU int32 and int64 tensors), ``seq_lens[i]`` tokens including this step's; none is
    modified.  The plan's blocks are token slots (block size 1: ``groups.shared`` counts
    tokens; the kernels read "nhd" pools through them); its groups are
    ``find_token_groups``'.
    """
    groups = find_token_groups(token_table, table_rows, seq_lens, page_size,
                               min_shared_tokens, by_size)
    if not len(groups):
        return None
    rows = table_rows.numpy().astype(np.int64)
    return _plan(groups, token_table.numpy(), rows[groups.rows], seq_lens.numpy(),
                 groups.rows.astype(np.int64), 1)


def find_token_groups(token_table: torch.Tensor, table_rows: torch.Tensor,
                      seq_lens: torch.Tensor, page_size: int, min_shared_tokens: int,
                      by_size: BySize = ()) -> Groups:
    """The decode rows of a token table (as ``plan_token_step`` takes it) that share at
    least ``min_shared_tokens`` leading tokens (and what ``by_size`` asks of their size),
    grouped; ``shared`` counts tokens, whole pages of ``page_size`` (what SGLang's radix
    cache shares).

    Groups are found over chunks of ``max(page_size, TOKEN_CHUNK)`` tokens, each named by
    its first slot (``find_groups`` on a table that many times narrower), then each group's
    rows' slots are compared over its whole prefix and the group shares exactly the
    leading whole pages whose slots all its rows hold (``_identical``): a token is shared
    only where its slot is the same in every row, as vLLM's blocks are only where their
    ids are.  Cost: O(rows x context / chunk) for the chunk table, ``find_groups``' on it,
    and O(grouped rows x shared tokens) for the compare; a few us where the rows start in
    different slots.
    """
    table = token_table.numpy()
    rows = table_rows.numpy().astype(np.int64)
    if distinct(table[rows, 0]):
        return _no_groups()
    lens = seq_lens.numpy()
    chunk = max(page_size, TOKEN_CHUNK)
    chunks = table[:, :int(lens.max()):chunk][rows]
    groups = find_groups(chunks, lens, np.ones(len(rows), dtype=np.int64), chunk,
                         min_blocks(chunk, min_shared_tokens))
    return worth_by_size(_identical(Groups(groups.rows, groups.offsets, groups.shared * chunk),
                                    table, rows, min_shared_tokens, page_size), by_size, 1)


def _identical(groups: Groups, table: np.ndarray, table_rows: np.ndarray,
               min_tokens: int, page_size: int) -> Groups:
    """``groups`` found on chunk names, each cut to the leading whole pages whose slots in
    the token table ``table`` all its rows share (its ``shared`` tokens at most: a chunk
    named by its first slot can end past what is shared), and less those left under
    ``min_tokens``.  One numpy compare per group: O(grouped rows x shared tokens)."""
    shared = []
    for lo, hi, tokens in zip(groups.offsets[:-1].tolist(), groups.offsets[1:].tolist(),
                              groups.shared.tolist(), strict=True):
        slots = table[table_rows[groups.rows[lo:hi]], :tokens]
        differs = (slots[1:] != slots[0]).any(axis=0)
        shared.append((int(differs.argmax()) if differs.any() else tokens)
                      // page_size * page_size)
    common = np.array(shared, dtype=np.int64)
    return groups.only(common >= max(min_tokens, 1), common)


def _plan(groups: Groups, table: np.ndarray, own_rows: np.ndarray, lens: np.ndarray,
          tokens: np.ndarray, block_size: int) -> StepPlan:
    """The plan of ``groups``: ``own_rows`` and ``tokens`` are each grouped row's row of
    ``table`` and query token, in ``groups.rows`` order; ``lens`` the batch's lengths."""
    shared = groups.row_shared()
    tokens = tokens.astype(np.int64)
    row_lens = lens[groups.rows].astype(np.int64)
    suffix_lens = row_lens - shared * block_size
    used = -(-row_lens // block_size)
    prefix_blocks = [table[own_rows[first], :n]
                     for first, n in zip(groups.offsets[:-1], groups.shared, strict=True)]
    suffix_blocks = [table[row, n:end] for row, n, end in zip(own_rows, shared, used,
                                                               strict=True)]
    segments = _segments(
        token_offsets=np.concatenate([groups.offsets, len(tokens) + 1 + np.arange(len(tokens))]),
        tokens=np.concatenate([tokens, tokens]),
        blocks=prefix_blocks + suffix_blocks,
        lengths=np.concatenate([groups.shared * block_size, suffix_lens]))
    cut = lens.copy()
    cut[groups.rows] = 1
    return StepPlan(groups, segments, torch.from_numpy(tokens), torch.from_numpy(cut))


def _segments(token_offsets: np.ndarray, tokens: np.ndarray, blocks: list[np.ndarray],
              lengths: np.ndarray) -> Segments:
    block_offsets = np.cumsum([0] + [len(b) for b in blocks])
    return Segments(
        token_offsets=torch.from_numpy(token_offsets.astype(np.int64)),
        tokens=torch.from_numpy(tokens.astype(np.int64)),
        block_offsets=torch.from_numpy(block_offsets.astype(np.int64)),
        blocks=torch.from_numpy(np.concatenate(blocks).astype(np.int32)),
        lengths=torch.from_numpy(lengths.astype(np.int32)))
