"""The Chunked Hash Tree against a brute-force model, step by step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from feather_sched.core.cht import (
    CHTError,
    ChunkedHashTree,
    RequestState,
    block_chunk_keys,
    token_chunk_keys,
)


def path_keys(path: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Cumulative keys of a path of chunk labels: key i names the prefix through chunk i."""
    return [path[: i + 1] for i in range(len(path))]


def common_prefix(key_lists: list[list]) -> int:
    if not key_lists:
        return 0
    length = min(len(keys) for keys in key_lists)
    for i in range(length):
        if len({keys[i] for keys in key_lists}) > 1:
            return i
    return length


class ReferenceModel:
    """Obvious, slow answers to every question the tree answers."""

    def __init__(self, min_rank_chunks: int = 1, chunk_tokens: int = 1) -> None:
        self.min_rank_chunks, self.chunk_tokens = min_rank_chunks, chunk_tokens
        self.keys: dict[int, list] = {}
        self.tokens: dict[int, int] = {}
        self.state: dict[int, RequestState] = {}
        self.order: dict[int, int] = {}
        self.arrivals = 0

    def waiting(self) -> list[int]:
        return [r for r, s in self.state.items() if s is RequestState.WAITING]

    def running(self) -> list[int]:
        return [r for r, s in self.state.items() if s is RequestState.RUNNING]

    def missing(self, rid: int) -> int:
        live = {k for r in self.running() for k in self.keys[r]}
        depth = 0
        for key in self.keys[rid]:
            if key not in live:
                break
            depth += 1
        return len(self.keys[rid]) - depth

    def rank(self, rid: int) -> int:
        depth = len(self.keys[rid]) - self.missing(rid)
        return depth if depth >= self.min_rank_chunks else 0

    def best(self) -> int | None:
        waiting = self.waiting()
        if not waiting:
            return None
        return min(waiting, key=lambda r: (-self.rank(r), self.order[r]))

    def fewest_uncached(self) -> int | None:
        waiting = self.waiting()
        if not waiting:
            return None
        return min(waiting, key=lambda r: (
            max(self.tokens[r] - self.rank(r) * self.chunk_tokens, 0), self.order[r]))

    def shared(self) -> int | None:
        running = self.running()
        return common_prefix([self.keys[r] for r in running]) if running else None

    def shared_after(self, rid: int) -> int:
        return common_prefix([self.keys[r] for r in [*self.running(), rid]])

    def sharing_waiters(self, rid: int, chunks: int) -> int:
        prefix = self.keys[rid][:chunks]
        others = [r for r in self.waiting() if r != rid]
        return sum(1 for r in others if self.keys[r][:chunks] == prefix and
                   len(self.keys[r]) >= chunks)



paths = st.lists(st.integers(0, 2), min_size=0, max_size=5).map(tuple)


class TreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = ChunkedHashTree(uncached_order=True)
        self.model = ReferenceModel()
        self.next_id = 0
        self.retired: list[int] = []

    @initialize(min_rank_chunks=st.integers(1, 3), chunk_tokens=st.sampled_from([1, 16]))
    def rank_from(self, min_rank_chunks: int, chunk_tokens: int) -> None:
        """Depths under ``min_rank_chunks`` rank as none (the queue passes 2 by default)."""
        self.tree = ChunkedHashTree(min_rank_chunks, chunk_tokens=chunk_tokens,
                                    uncached_order=True)
        self.model = ReferenceModel(min_rank_chunks, chunk_tokens)

    def snapshot(self) -> tuple:
        tree = self.tree
        states = {r: tree.state(r) for r in self.model.state}
        return (states, tree.best(), tree.shared_prefix_chunks(), tree.num_waiting)

    @rule(path=paths, tail=st.one_of(st.none(), st.integers(0, 40)))
    def add(self, path: tuple[int, ...], tail: int | None) -> None:
        """A prompt of the path's chunks and ``tail`` tokens more (None: the chunks')."""
        rid = self.next_id
        self.next_id += 1
        tokens = None if tail is None else len(path) * self.model.chunk_tokens + tail
        self.tree.add(rid, path_keys(path), tokens=tokens)
        self.model.keys[rid] = path_keys(path)
        self.model.tokens[rid] = len(path) * self.model.chunk_tokens + (tail or 0)
        self.model.state[rid] = RequestState.WAITING
        self.model.order[rid] = self.model.arrivals
        self.model.arrivals += 1

    @precondition(lambda self: self.model.waiting())
    @rule(data=st.data(), pick_best=st.booleans())
    def admit(self, data: st.DataObject, pick_best: bool) -> None:
        rid = self.model.best() if pick_best else data.draw(st.sampled_from(self.model.waiting()))
        self.tree.admit(rid)
        self.model.state[rid] = RequestState.RUNNING

    @precondition(lambda self: self.model.running())
    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.model.running()))
        self.tree.requeue(rid)
        self.model.state[rid] = RequestState.WAITING

    @precondition(lambda self: self.model.running())
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.model.running()))
        self.tree.finish(rid)
        self.forget(rid)

    @precondition(lambda self: self.model.state)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model.state)))
        self.tree.remove(rid)
        self.forget(rid)

    def forget(self, rid: int) -> None:
        del self.model.state[rid], self.model.keys[rid], self.model.order[rid], \
            self.model.tokens[rid]
        self.retired.append(rid)

    @rule(data=st.data())
    def invalid_operation_changes_nothing(self, data: st.DataObject) -> None:
        before = self.snapshot()
        waiting, running = self.model.waiting(), self.model.running()
        choices = [("add", r) for r in self.model.state] + [("admit", r) for r in running]
        choices += [("requeue", r) for r in waiting] + [("finish", r) for r in waiting]
        choices += [(op, r) for op in ("admit", "finish", "remove", "requeue")
                    for r in [*self.retired[-2:], -1]]
        op, rid = data.draw(st.sampled_from(choices))
        with pytest.raises(CHTError):
            if op == "add":
                self.tree.add(rid, [])
            else:
                getattr(self.tree, op)(rid)
        assert self.snapshot() == before

    @invariant()
    def queries_match_the_model(self) -> None:
        tree, model = self.tree, self.model
        assert tree.num_waiting == len(model.waiting())
        assert tree.num_running == len(model.running())
        assert list(tree.waiting_ids()) == model.waiting()
        assert set(tree.running_ids()) == set(model.running())
        assert tree.best() == model.best()
        assert tree.fewest_uncached() == model.fewest_uncached()
        firsts = [model.keys[r][0] for r in model.running() if model.keys[r]]
        assert tree.has_running_group() == (len(set(firsts)) < len(firsts))
        for rid in model.waiting() + model.running():
            first = model.keys[rid][:1]
            assert tree.group_runners(rid) == (firsts.count(first[0]) if first else 0)
        running_keys = {k for r in model.running() for k in model.keys[r]}
        waiting_keys = {k for r in model.waiting() for k in model.keys[r]}
        assert tree.chunks_held() == len(running_keys) + len(waiting_keys)
        assert tree.shared_prefix_chunks() == model.shared()
        for rid in model.waiting():
            assert tree.missing_chunks(rid) == model.missing(rid)
            candidate = tree.candidate(rid)
            assert candidate.shared_before == model.shared()
            assert candidate.shared_after == model.shared_after(rid)
            assert candidate.sharing_waiters == model.sharing_waiters(
                rid, candidate.shared_after)

    @invariant()
    def every_request_is_in_exactly_one_place(self) -> None:
        ids = list(self.tree.waiting_ids()) + list(self.tree.running_ids())
        assert sorted(ids) == sorted(self.model.state)
        for rid in self.retired:
            assert rid not in self.tree


TestTreeAgainstModel = TreeMachine.TestCase
TestTreeAgainstModel.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)


def test_candidate_of_empty_tree_is_none() -> None:
    tree = ChunkedHashTree()
    assert tree.best() is None
    assert tree.candidate() is None
    assert tree.shared_prefix_chunks() is None


def test_empty_running_set_adds_with_full_prefix() -> None:
    tree = ChunkedHashTree()
    tree.add("a", path_keys((1, 2, 3)))
    tree.add("b", path_keys((1, 2, 4)))
    candidate = tree.candidate()
    assert candidate.request_id == "a"
    assert (candidate.shared_before, candidate.shared_after, candidate.chunk_loss) == (None, 3, 0)
    assert candidate.sharing_waiters == 0


def test_group_of_running_request_is_preferred_over_older_stranger() -> None:
    tree = ChunkedHashTree()
    tree.add("stranger", path_keys((9, 9, 9)))
    tree.add("first", path_keys((1, 1, 1, 5)))
    tree.add("sibling", path_keys((1, 1, 1, 6)))
    tree.admit("first")
    assert tree.best() == "sibling"
    assert tree.candidate().chunk_loss == 1
    tree.finish("first")
    assert tree.best() == "stranger"


def test_arrival_order_among_strangers_and_deepest_sharing_first() -> None:
    """Not shortest prompt first: a long prompt that shares nothing keeps its turn, and
    the request sharing the most with the running set goes first, however long."""
    tree = ChunkedHashTree()
    tree.add("long", path_keys((7,) * 40))
    tree.add("short", path_keys((8,)))
    assert tree.best() == "long"
    tree.add("running", path_keys((1, 2, 3)))
    tree.add("shallow", path_keys((1, 5)))
    tree.add("deep", path_keys((1, 2, 3) + (6,) * 30))
    tree.admit("running")
    assert tree.best() == "deep"
    assert tree.missing_chunks("deep") > tree.missing_chunks("shallow")


def test_a_prefix_under_min_rank_chunks_does_not_pass_older_requests() -> None:
    """A request sharing one chunk with the running set keeps its arrival turn at
    ``min_rank_chunks=2``; once it shares two, it goes first."""
    tree = ChunkedHashTree(min_rank_chunks=2)
    tree.add("older", path_keys((9, 9, 9)))
    tree.add("one chunk", path_keys((1, 5, 5)))
    tree.add("running", path_keys((1, 2, 3)))
    tree.admit("running")
    assert tree.best() == "older"
    tree.add("two chunks", path_keys((1, 2, 4)))
    assert tree.best() == "two chunks"
    with pytest.raises(ValueError, match="min_rank_chunks must be at least 1"):
        ChunkedHashTree(min_rank_chunks=0)


def test_fewest_uncached_counts_the_tokens_a_running_prefix_does_not_cover() -> None:
    """The shortest prompt first while nothing runs; once a group's prefix runs, its
    long member with little left to compute passes it; the most urgent class leads."""
    tree = ChunkedHashTree(chunk_tokens=16, uncached_order=True)
    tree.add("long", path_keys((1, 2, 3, 4)), tokens=66)
    tree.add("short", path_keys((9,)), tokens=20)
    assert tree.fewest_uncached() == "short"
    tree.add("running", path_keys((1, 2, 3, 5)))
    tree.admit("running")
    assert tree.fewest_uncached() == "long"  # 66 - 3 x 16 = 18 tokens left, "short" 20
    tree.add("one more", path_keys((1, 2, 3, 4)), tokens=64)  # 16 left
    assert tree.fewest_uncached() == "one more"
    tree.add("urgent", path_keys((8, 8)), priority=-1)
    assert tree.fewest_uncached() == "urgent"
    with pytest.raises(ValueError, match="chunk_tokens must be at least 1"):
        ChunkedHashTree(chunk_tokens=0)
    with pytest.raises(CHTError, match="uncached_order"):
        ChunkedHashTree().fewest_uncached()


@pytest.mark.parametrize("uncached_order", [False, True])
def test_a_rank_that_keeps_coming_back_leaves_the_heaps_bounded(uncached_order) -> None:
    """A waiting request whose rank goes back and forth (its group's runner admitted and
    preempted, again and again) pushes an item per change into each heap: compaction
    keeps both heaps within their bound, and the order right."""
    tree = ChunkedHashTree(uncached_order=uncached_order)
    tree.add("waiting", path_keys((1, 2, 3, 4)))
    tree.add("runner", path_keys((1, 2, 3, 5)))
    for _ in range(500):
        tree.admit("runner")
        tree.requeue("runner")
    bound = 4 * tree.num_waiting + 64 + 1
    assert len(tree._heap) <= bound
    assert not uncached_order or len(tree._uncached_heap) <= bound
    assert tree.best() == "waiting"


def test_bad_requests_get_clear_errors() -> None:
    tree = ChunkedHashTree()
    with pytest.raises(CHTError, match="unknown request 'x'"):
        tree.admit("x")
    tree.add("x", [1])
    with pytest.raises(CHTError, match="already in the tree"):
        tree.add("x", [2])
    with pytest.raises(CHTError, match="cannot finish request 'x': it is waiting"):
        tree.finish("x")
    with pytest.raises(CHTError, match="not hashable"):
        tree.remove(["x"])


def test_token_keys_are_cumulative_prefix_digests() -> None:
    rng = np.random.default_rng(0)
    shared = rng.integers(1, 32000, 256, dtype=np.int32)
    a = np.concatenate([shared, rng.integers(1, 32000, 100, dtype=np.int32)])
    b = np.concatenate([shared, rng.integers(1, 32000, 100, dtype=np.int32)])
    keys_a, keys_b = token_chunk_keys(a, 64), token_chunk_keys(b, 64)
    assert len(keys_a) == 356 // 64
    assert keys_a[:4] == keys_b[:4]
    assert keys_a[4] != keys_b[4]
    assert token_chunk_keys(list(map(int, a)), 64) == keys_a
    assert token_chunk_keys(a.tobytes(), 64) == keys_a
    assert token_chunk_keys(a[:63], 64) == []


@given(st.lists(st.integers(0, 3), min_size=64, max_size=400),
       st.lists(st.integers(0, 3), min_size=64, max_size=400))
def test_equal_key_at_level_means_equal_prefix(a: list[int], b: list[int]) -> None:
    keys_a, keys_b = token_chunk_keys(a, 16), token_chunk_keys(b, 16)
    for level in range(min(len(keys_a), len(keys_b))):
        same_prefix = a[: 16 * (level + 1)] == b[: 16 * (level + 1)]
        assert (keys_a[level] == keys_b[level]) == same_prefix


def test_chunk_sizes_are_validated() -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_chunk_keys([1, 2], 0)
    with pytest.raises(ValueError, match="whole int32"):
        token_chunk_keys(b"abc", 1)
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        block_chunk_keys([b"a"], 0)
    with pytest.raises(CHTError, match="empty prompt"):
        token_chunk_keys(np.array([], dtype=np.int32))


def test_block_keys_take_every_kth_chained_hash() -> None:
    hashes = [f"h{i}".encode() for i in range(10)]
    assert block_chunk_keys(hashes, 1) == hashes
    assert block_chunk_keys(hashes, 4) == [b"h3", b"h7"]


def test_held_chunks_is_the_prefix_a_group_shares_with_any_request() -> None:
    tree = ChunkedHashTree()
    tree.add("a", ["g", "g1", "a2"])
    tree.add("b", ["g", "g1", "b2"])
    tree.add("c", ["h", "c1"])
    assert tree.held_chunks("a") == 2  # with a waiting sibling
    tree.admit("b")
    assert tree.held_chunks("a") == 2  # with a running one
    assert tree.held_chunks("c") == 0


def test_best_of_a_tenant_is_the_trees_order_among_its_requests() -> None:
    tree = ChunkedHashTree(by_tenant=True)
    tree.add("run", [(1,), (1, 2)], tenant="a")
    tree.admit("run")
    tree.add("a-old", [(9,)], tenant="a")
    tree.add("b-old", [(8,)], tenant="b")
    tree.add("b-shares", [(1,), (1, 2), (1, 2, 3)], tenant="b")
    assert tree.best() == "b-shares" and tree.best_of("b") == "b-shares"
    assert tree.best_of("a") == "a-old" and tree.tenant("a-old") == "a"
    tree.admit("b-shares")
    assert tree.best_of("b") == "b-old" and tree.best_of("nobody") is None
    for i in range(300):  # stale entries are compacted as ranks move
        tree.add(f"x{i}", [(1,), (1, 5, i)], tenant="c")
        tree.admit(f"x{i}")
        tree.requeue(f"x{i}")
    assert tree.best_of("c") == "x0" and len(tree._tenant_heaps["c"]) < 4 * 300 + 64
