"""Finding prefix groups in a block table, and the step plan built on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_sched.attention import groups
from feather_sched.attention.groups import find_groups, min_blocks, plan_step

BS = 16


def table(rows: list[list[int]], width: int = 12) -> np.ndarray:
    out = np.full((len(rows), width), 999, dtype=np.int32)  # stale ids past each row's end
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def lens_for(rows: list[list[int]], last_fill: int = 5) -> np.ndarray:
    """Sequence lengths whose last block holds ``last_fill`` tokens (this step's included)."""
    return np.array([(len(r) - 1) * BS + last_fill for r in rows], dtype=np.int32)


def as_sets(groups) -> list[tuple[frozenset, int]]:
    return sorted((frozenset(groups.rows[lo:hi].tolist()), int(n)) for lo, hi, n in
                  zip(groups.offsets[:-1], groups.offsets[1:], groups.shared, strict=True))


def test_rows_sharing_leading_blocks_group_in_any_order():
    rows = [[1, 2, 3, 40], [7, 8, 50], [1, 2, 3, 41], [7, 8, 51], [1, 2, 3, 42]]
    groups = find_groups(table(rows), lens_for(rows), np.ones(5, int), BS, 2)
    assert as_sets(groups) == [(frozenset({0, 2, 4}), 3), (frozenset({1, 3}), 2)]


def test_rows_sharing_no_first_block_form_no_group_and_one_shared_pair_does():
    """The usual batch shares nothing: it is settled on the first blocks alone."""
    rows = [[10 * i + 1, 10 * i + 2, 10 * i + 3] for i in range(8)]
    assert len(find_groups(table(rows), lens_for(rows), np.ones(8, int), BS, 1)) == 0
    rows[5] = [1, 2, 99]  # shares two blocks with row 0
    assert as_sets(find_groups(table(rows), lens_for(rows), np.ones(8, int), BS, 1)) == \
        [(frozenset({0, 5}), 2)]


def test_only_full_blocks_below_the_written_token_are_shared():
    # Both rows end in block 3 (identical ids); it holds this step's token, so it is out.
    rows = [[1, 2, 3], [1, 2, 3]]
    groups = find_groups(table(rows), lens_for(rows), np.ones(2, int), BS, 1)
    assert as_sets(groups) == [(frozenset({0, 1}), 2)]
    # A token that starts a new block: the previous block is full and shared.
    full = np.array([3 * BS + 1, 3 * BS + 1], dtype=np.int32)
    wide = table([[1, 2, 3, 60], [1, 2, 3, 61]])
    assert as_sets(find_groups(wide, full, np.ones(2, int), BS, 1)) == [(frozenset({0, 1}), 3)]


def test_stale_ids_past_a_rows_length_never_count():
    # Identical rows in the table, but row 1 has only 2 blocks of context.
    rows = table([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])
    lens = np.array([4 * BS + 3, 1 * BS + 3], dtype=np.int32)
    assert as_sets(find_groups(rows, lens, np.ones(2, int), BS, 1)) == [(frozenset({0, 1}), 1)]


def test_prefill_rows_singletons_and_short_prefixes_stay_out():
    rows = [[1, 2, 3, 9], [1, 2, 3, 10], [1, 2, 3, 11], [5, 6, 12], [7, 8, 13], [7, 14]]
    query_lens = np.array([1, 1, 40, 1, 1, 1])  # row 2 is a prefill chunk
    groups = find_groups(table(rows), lens_for(rows), query_lens, BS, 2)
    assert as_sets(groups) == [(frozenset({0, 1}), 3)]  # 7,* share 1 block < 2


def test_a_run_splits_into_its_longer_shared_subgroups():
    # All share a 2-block system prompt; two documents of 6 more blocks each.
    doc_a, doc_b = [1, 2, 10, 11, 12, 13, 14, 15], [1, 2, 20, 21, 22, 23, 24, 25]
    rows = [[*doc_a, 30 + i] for i in range(3)] + [[*doc_b, 40 + i] for i in range(3)]
    groups = find_groups(table(rows), lens_for(rows), np.ones(6, int), BS, 2)
    assert as_sets(groups) == [(frozenset({0, 1, 2}), 8), (frozenset({3, 4, 5}), 8)]


def test_a_run_stays_whole_when_its_common_prefix_saves_more():
    # 5 rows share 8 blocks; two of them share 1 block more.
    base = list(range(1, 9))
    rows = [[*base, 50, 60 + i] for i in range(2)] + [[*base, 70 + i] for i in range(3)]
    groups = find_groups(table(rows), lens_for(rows), np.ones(5, int), BS, 2)
    assert as_sets(groups) == [(frozenset(range(5)), 8)]


def test_deep_batches_do_not_hit_the_recursion_limit():
    # Each row shares one block more with the next: the split tree is a chain.
    rows = [[*list(range(1, 3 + i)), 5000 + i] for i in range(1500)]
    width = max(map(len, rows))
    groups = find_groups(table(rows, width), lens_for(rows), np.ones(1500, int), BS, 1)
    assert len(groups) >= 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(1, 40)),
                min_size=1, max_size=24))
def test_every_group_truly_shares_its_blocks(spec):
    prefixes = [[100 * p + j for j in range(1, 9)] for p in range(4)]
    rows = [[*prefixes[p][:k], 1000 + i] for i, (p, k, _) in enumerate(spec)]
    lens = np.array([len(r) * BS - BS + fill for r, (_, _, fill) in
                     zip(rows, spec, strict=True)], dtype=np.int32)
    lens = np.minimum(lens, np.array([len(r) * BS for r in rows]))
    bt = table(rows)
    groups = find_groups(bt, lens, np.ones(len(rows), int), BS, 1)
    seen = groups.rows.tolist()
    assert len(seen) == len(set(seen))
    for lo, hi, n in zip(groups.offsets[:-1], groups.offsets[1:], groups.shared, strict=True):
        members = groups.rows[lo:hi]
        assert hi - lo >= 2 and n >= 1
        assert (bt[members, :n] == bt[members[0], :n]).all()
        assert ((lens[members] - 1) // BS >= n).all()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 8), st.integers(1, 16)),
                min_size=1, max_size=24), st.integers(0, 40), st.randoms(use_true_random=False))
def test_rows_read_through_table_rows_group_as_their_gathered_table(spec, spare, rnd):
    """Batch row ``r`` reading row ``table_rows[r]`` of a larger table (request slots, in
    any order, some beyond the batch's size, the other rows and each row's columns past its
    blocks stale) groups exactly as the gathered table does, in batch rows."""
    prefixes = [[100 * p + j for j in range(1, 9)] for p in range(4)]
    rows = [[*prefixes[p][:k], 1000 + i] for i, (p, k, _) in enumerate(spec)]
    lens = np.minimum(np.array([len(r) * BS - BS + fill for r, (*_, fill) in
                                zip(rows, spec, strict=True)]), [len(r) * BS for r in rows])
    gathered = table(rows)
    slots = np.array(rnd.sample(range(len(rows) + spare), len(rows)))
    big = np.random.default_rng(spare).integers(1, 8, (len(rows) + spare, 12)).astype(np.int32)
    big[slots] = gathered  # stale ids (999) past each row's blocks, stale rows elsewhere
    query_lens = np.array([1 if fill % 5 else 3 for *_, fill in spec])  # some prefill rows
    want = find_groups(gathered, lens, query_lens, BS, 1)
    got = find_groups(big, lens, query_lens, BS, 1, table_rows=slots)
    assert set(as_sets(got)) == set(as_sets(want)) and len(got) == len(want)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0, 2, 5, 8]), st.integers(1, 40),
                          st.booleans()), min_size=2, max_size=30), st.integers(1, 4))
def test_classes_settled_at_once_group_as_the_trie_groups_them(spec, min_shared):
    """The shortcut for first blocks whose rows all share alike (``_stars``) finds what the
    trie alone finds, on batches mixing such classes with nested and uneven ones, and rows
    that leave their class's prefix in its middle only."""
    from feather_sched.attention import groups as module

    prefixes = [[100 * p + j for j in range(1, 9)] for p in range(4)]
    rows = [[*prefixes[p][:k], 1000 + i] for i, (p, k, *_) in enumerate(spec)]
    for i, (*_, middle) in enumerate(spec):
        if middle and len(rows[i]) > 4:
            rows[i][2] = 2000 + i
    lens = np.minimum(np.array([len(r) * BS - BS + fill for r, (_, _, fill, _) in
                                zip(rows, spec, strict=True)]), [len(r) * BS for r in rows])
    bt, decode = table(rows), np.ones(len(rows), int)
    fast = find_groups(bt, lens, decode, BS, min_shared)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "MAX_HEAD_RUNS", -1)  # every class to the trie
        trie = find_groups(bt, lens, decode, BS, min_shared)
    assert set(as_sets(fast)) == set(as_sets(trie)) and len(fast) == len(trie)


def test_min_blocks_rounds_up_to_whole_blocks():
    assert min_blocks(128) == 2 and min_blocks(16) == 16 and min_blocks(512) == 1


def test_plan_cuts_grouped_rows_and_leaves_the_rest():
    rows = [[1, 2, 3, 40], [1, 2, 3, 41], [9, 10, 50]]
    bt = torch.from_numpy(table(rows))
    lens = torch.from_numpy(lens_for(rows))
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    before = bt.clone()
    plan = plan_step(bt, lens, starts, 3, BS, 2)
    assert torch.equal(bt, before)  # the engine's tensors are not touched
    assert plan.tokens.tolist() == [0, 1] or plan.tokens.tolist() == [1, 0]
    assert plan.seq_lens.tolist() == [1, 1, lens[2]]
    seg = plan.segments
    assert seg.lengths.tolist() == [3 * BS, 5, 5]
    assert seg.token_offsets.tolist() == [0, 2, 3, 4]
    assert seg.blocks[:3].tolist() == [1, 2, 3]
    assert sorted(seg.blocks[3:].tolist()) == [40, 41]


@pytest.mark.parametrize("padding", [0, 2])
def test_plan_is_none_without_groups(padding):
    rows = [[1, 2, 3], [4, 5, 6]] + [[1, 2, 3]] * padding  # padding rows are not live
    plan = plan_step(torch.from_numpy(table(rows)), torch.from_numpy(lens_for(rows)),
                     torch.arange(len(rows) + 1, dtype=torch.int32), 2, BS, 1)
    assert plan is None


@pytest.mark.parametrize("padding", [0, 3])
def test_plan_reads_only_the_live_rows(padding):
    rows = [[1, 2, 3, 40], [1, 2, 3, 41]] + [[1, 2, 3, 99]] * padding
    bt = torch.from_numpy(table(rows))
    lens = torch.from_numpy(lens_for(rows))
    starts = torch.arange(len(rows) + 1, dtype=torch.int32)
    plan = plan_step(bt, lens, starts, 2, BS, 2)
    assert sorted(plan.groups.rows.tolist()) == [0, 1] and len(plan.seq_lens) == 2


def _lcp(bt: np.ndarray, full: np.ndarray, a: int, b: int) -> int:
    """Leading blocks rows a and b share, within both rows' full blocks (brute force)."""
    limit = int(min(full[a], full[b]))
    differs = np.flatnonzero(bt[a, :limit] != bt[b, :limit])
    return int(differs[0]) if len(differs) else limit


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 8),
                          st.integers(1, 12)), min_size=2, max_size=30))
def test_the_trie_order_lists_rows_as_a_sort_would(spec):
    """Adjacent rows of ``_trie_order`` share exactly what it says, and any two rows share
    the minimum of what lies between them: the order of a lexicographic sort of the rows'
    full blocks (what the grouping's split rests on), whatever the input order."""
    from feather_sched.attention.groups import _trie_order

    systems = [[1, 2, 3], [7], []]
    documents = [[100 * d + j for j in range(1, 9)] for d in range(4)]
    rows = [[*systems[s], *documents[d][:k], 5000 + i]
            for i, (s, d, k, _) in enumerate(spec)]
    bt = table(rows, width=16)
    full = np.array([min(len(r), f) for r, (*_, f) in zip(rows, spec, strict=True)])
    candidates = np.arange(len(rows))
    order, common = _trie_order(bt, candidates, full)
    assert sorted(order.tolist()) == candidates.tolist() and len(common) == len(order) - 1
    for i in range(len(order) - 1):
        assert common[i] == _lcp(bt, full, order[i], order[i + 1])
    for i in range(len(order)):
        for j in range(i + 1, len(order)):
            assert _lcp(bt, full, order[i], order[j]) == min(common[i:j])


class TokenPool:
    """Token slots handed out as SGLang's allocator does: whole pages of ``page`` slots
    (page ``p`` holds slots ``p * page ...``), pages in random order; rows of a
    ``req_to_token`` table, at random pool rows, with stale slots past each row's end."""

    def __init__(self, page: int, seed: int = 0) -> None:
        self.page, self.rng = page, np.random.default_rng(seed)
        self.free = self.rng.permutation(4096).tolist()

    def allocate(self, tokens: int) -> list[int]:
        pages = [self.free.pop() for _ in range(-(-tokens // self.page))]
        return [p * self.page + i for p in pages for i in range(self.page)][:tokens]

    def table(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(req_to_token, req_pool_indices, seq_lens) of a batch of these slot lists."""
        width = max(len(r) for r in rows) + 40
        table = self.rng.integers(0, 4096 * self.page, (3 * len(rows), width)).astype(np.int32)
        pool_rows = self.rng.permutation(len(table))[:len(rows)]
        for at, row in zip(pool_rows, rows, strict=True):
            table[at, :len(row)] = row
        return (torch.from_numpy(table), torch.from_numpy(pool_rows.astype(np.int64)),
                torch.tensor([len(r) for r in rows], dtype=torch.int64))


@pytest.mark.parametrize("page", [1, 16, 64])
def test_a_token_plan_groups_rows_by_their_slots_and_attends_them_exactly(page):
    """Groups in any row order from req_to_token rows, each sharing exactly its prefix
    (a chunk of 16 tokens named by its first slot never counts past it), singletons and
    short prefixes left to the engine; the kernel over the plan equals the reference."""
    from feather_sched.attention import cpu_kernel
    from feather_sched.attention.partials import reference_attention

    pool = TokenPool(page)
    long_a, long_b = (300, 520) if page == 1 else (320, 512)
    a, b, short = pool.allocate(long_a), pool.allocate(long_b), pool.allocate(128)
    rows = [a + pool.allocate(40), b + pool.allocate(7), a + pool.allocate(90),
            pool.allocate(700), b + pool.allocate(130), a + pool.allocate(21),
            short + pool.allocate(30), short + pool.allocate(9), b + pool.allocate(1)]
    table, pool_rows, lens = pool.table(rows)
    before = table.clone()
    plan = groups.plan_token_step(table, pool_rows, lens, page, 256)
    assert torch.equal(table, before)
    found = {frozenset(plan.groups.rows[lo:hi].tolist()): int(n) for lo, hi, n in
             zip(plan.groups.offsets[:-1], plan.groups.offsets[1:], plan.groups.shared,
                 strict=True)}
    # b's last row has only its new token past b, in the chunk (tokens 512-527) that
    # holds b's last 8: only whole chunks before the new token's are compared
    assert found == {frozenset({0, 2, 5}): long_a,
                     frozenset({1, 4, 8}): 512 if page == 1 else long_b}
    assert plan.seq_lens.tolist() == [1 if i in (0, 1, 2, 4, 5, 8) else len(r)
                                      for i, r in enumerate(rows)]
    torch.manual_seed(0)
    fused = torch.randn(2, 4096 * page, 2, 32)
    query = torch.randn(len(rows), 4, 32)
    output = torch.full_like(query, torch.nan)
    cpu_kernel.attend_groups(plan, query, (fused[0], fused[1]), 0.2, output, "nhd")
    for row, slots in enumerate(rows):
        if row in (3, 6, 7):
            assert output[row].isnan().all()
            continue
        index = torch.tensor(slots)
        expected, _ = reference_attention(query[row], fused[0, index], fused[1, index], 0.2)
        assert torch.allclose(output[row].double(), expected, atol=1e-5), row


def test_a_token_plan_shares_only_slots_every_row_holds():
    """Rows naming every chunk by the same first slot but differing inside one (what
    SGLang's tree never hands out, but a table could hold) share only up to the first
    difference, and not at all when that is under the threshold."""
    pool = TokenPool(1)
    prefix = pool.allocate(600)
    rows = [prefix + pool.allocate(5) for _ in range(3)]
    rows[1][400] = pool.allocate(1)[0]
    table, pool_rows, lens = pool.table(rows)
    plan = groups.plan_token_step(table, pool_rows, lens, 1, 256)
    assert plan is not None and plan.groups.shared.tolist() == [400]
    rows[2][100] = pool.allocate(1)[0]
    assert groups.plan_token_step(*pool.table(rows), 1, 256) is None


def test_a_token_plan_is_none_where_rows_start_in_different_slots():
    pool = TokenPool(1)
    rows = [pool.allocate(400) for _ in range(4)]
    assert groups.plan_token_step(*pool.table(rows), 1, 256) is None


def test_groups_are_kept_by_what_the_check_asked_of_their_size():
    """``by_size``: a group takes the entry of the largest size it reaches (the first
    entry below them all); None keeps no group of that size; empty keeps every group."""
    pairs = [[1, 2, 3, 4, 10 + i] for i in range(2)]  # 2 rows sharing 4 blocks
    fours = [[5, 6, 20 + i] for i in range(4)]  # 4 rows sharing 2 blocks
    eights = [[7, 30 + i] for i in range(8)]  # 8 rows sharing 1 block
    rows = pairs + fours + eights
    bt = torch.from_numpy(table(rows))
    lens = torch.from_numpy(lens_for(rows))
    starts = torch.arange(len(rows) + 1, dtype=torch.int32)

    def kept(by_size) -> list[int]:
        plan = plan_step(bt, lens, starts, len(rows), BS, 1, by_size)
        return [] if plan is None else sorted(plan.groups.sizes().tolist())

    assert kept(()) == [2, 4, 8]
    assert kept(((4, 2 * BS), (8, BS))) == [2, 4, 8]
    assert kept(((4, 3 * BS), (8, BS))) == [2, 8]  # the pair shares 4 blocks, the 4s 2
    assert kept(((4, 5 * BS), (8, 2 * BS))) == []
    assert kept(((4, None), (8, BS))) == [8]
    assert kept(((2, None), (4, 2 * BS), (8, 2 * BS))) == [4]


def test_a_token_plan_keeps_groups_by_their_size_too():
    pool = TokenPool(1)
    small, large = pool.allocate(600), pool.allocate(300)
    rows = [small + pool.allocate(5) for _ in range(2)] + \
        [large + pool.allocate(5) for _ in range(8)]
    table, pool_rows, lens = pool.table(rows)
    both = groups.plan_token_step(table, pool_rows, lens, 1, 256)
    assert sorted(both.groups.sizes().tolist()) == [2, 8]
    by_size = ((4, 1024), (8, 256))
    plan = groups.plan_token_step(table, pool_rows, lens, 1, 256, by_size)
    assert plan.groups.sizes().tolist() == [8] and plan.groups.shared.tolist() == [300]
