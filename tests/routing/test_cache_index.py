"""The precise index: blocks each replica holds from its events, the event feed's order and
recovery, and PreciseIndex as FeatherRouter's index."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from feather_sched.routing.cache_index import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheIndex,
    EventFeed,
    PreciseIndex,
)
from feather_sched.routing.feather import FeatherRouter


def stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(list(hashes), parent, [], 16)


def test_depths_count_leading_blocks_up_to_each_replicas_first_miss() -> None:
    index = CacheIndex()
    for replica in "abc":
        index.add_replica(replica)
    index.apply("a", [stored(1, 2, 3, 4)])
    index.apply("b", [stored(1, 2), stored(4)])  # 4 without 3: a hit stops at 3
    index.apply("c", [stored(2, 3)])  # nothing from the start
    assert index.depths([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert index.depths([1, 2]) == {"a": 2, "b": 2}
    assert index.depths([2, 3]) == {"a": 2, "b": 1, "c": 2}
    assert index.depths([9, 1]) == {} and index.depths([]) == {}
    index.apply("a", [BlockRemoved([3])])
    assert index.depths([1, 2, 3, 4]) == {"a": 2, "b": 2}
    index.apply("b", [AllBlocksCleared()])
    assert index.depths([1, 2, 3, 4]) == {"a": 2} and index.blocks("b") == 0


def leading_held(index: CacheIndex, replica: str, blocks: list[int]) -> int:
    depth = 0
    while depth < len(blocks) and index.holds(replica, blocks[depth]):
        depth += 1
    return depth


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=4), st.integers(0, 40),
       st.integers(1, 9), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 39))))
def test_strided_depths_are_exact_on_prefix_closed_caches_and_at_stride_one(
        kept: list[int], asked: int, stride: int, holes: list[tuple[int, int]]) -> None:
    """Each replica caches a prefix of one 40-block chain (as an engine evicting tails
    first); with holes punched, stride 1 is still exact."""
    chain = list(range(100, 140))
    index = CacheIndex()
    replicas = [str(r) for r in range(len(kept))]
    for replica, count in zip(replicas, kept, strict=True):
        index.add_replica(replica)
        index.stored(replica, chain[:count])
    exact = {r: leading_held(index, r, chain[:asked]) for r in replicas
             if asked and index.holds(r, chain[0])}
    assert index.depths(chain[:asked], stride) == exact
    for replica, block in holes:
        if replica < len(replicas):
            index.removed(str(replica), [chain[block]])
    exact = {r: leading_held(index, r, chain[:asked]) for r in replicas
             if asked and index.holds(r, chain[0])}
    assert index.depths(chain[:asked]) == exact
    strided = index.depths(chain[:asked], stride)
    assert strided.keys() == exact.keys()
    assert all(strided[r] >= exact[r] for r in exact)  # a hole inside a stride: unseen


def test_a_block_stored_twice_is_held_until_both_copies_are_removed() -> None:
    index = CacheIndex()
    index.add_replica("a")
    index.apply("a", [stored(1), stored(1)])  # two copies (vLLM does not de-duplicate)
    index.apply("a", [BlockRemoved([1])])
    assert index.holds("a", 1)
    index.apply("a", [BlockRemoved([1]), BlockRemoved([1])])  # the second: not held, ignored
    assert not index.holds("a", 1) and len(index) == 0


def test_a_dropped_replica_frees_its_bit_for_the_next() -> None:
    index = CacheIndex()
    for replica in "ab":
        index.add_replica(replica)
    index.apply("a", [stored(1, 2)])
    index.apply("b", [stored(1)])
    index.drop("a")
    assert index.depths([1, 2]) == {"b": 1} and index.replicas == ["b"]
    index.apply("a", [stored(3)])  # events still on their way from a dead replica
    index.clear("a")
    index.add_replica("c")  # takes a's bit: must not inherit a's blocks
    assert index.depths([1, 2]) == {"b": 1}
    index.apply("c", [stored(1, 2)])
    assert index.depths([1, 2]) == {"c": 2, "b": 1}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear", "drop"]),
                          st.integers(0, 3), st.lists(st.integers(0, 7), max_size=5)),
                max_size=40),
       st.lists(st.integers(0, 7), max_size=6))
def test_depths_equal_a_brute_force_model(ops, prompt) -> None:
    index, model = CacheIndex(), {}
    for op, replica, hashes in ops:
        index.add_replica(replica)
        held = model.setdefault(replica, {})
        if op == "store":
            index.apply(replica, [stored(*hashes)])
            for h in hashes:
                held[h] = held.get(h, 0) + 1
        elif op == "remove":
            index.apply(replica, [BlockRemoved(hashes)])
            for h in hashes:
                if h in held:
                    held[h] -= 1
                    if not held[h]:
                        del held[h]
        elif op == "clear":
            index.apply(replica, [AllBlocksCleared()])
            held.clear()
        else:
            index.drop(replica)
            del model[replica]
    expected = {}
    for replica, held in model.items():
        depth = 0
        while depth < len(prompt) and prompt[depth] in held:
            depth += 1
        if depth:
            expected[replica] = depth
    assert index.depths(prompt) == expected
    assert len(index) == len(set().union(*model.values()) if model else set())


class Engine:
    """Numbered batches as a publisher sends them, with a replay buffer of the last few."""

    def __init__(self, keep: int = 100) -> None:
        self.sent: list[tuple[int, list]] = []
        self.keep = keep

    def batch(self, *events) -> tuple[int, list]:
        self.sent.append((len(self.sent), list(events)))
        return self.sent[-1]

    def replay(self, start: int) -> list[tuple[int, list]]:
        return [b for b in self.sent[-self.keep:] if b[0] >= start]


def test_a_gap_is_replayed_in_order() -> None:
    engine, index = Engine(), CacheIndex()
    feed = EventFeed(index, "r", engine.replay)
    feed.receive(*engine.batch(stored(1)))
    engine.batch(stored(2, parent=1))  # lost on the live stream
    engine.batch(BlockRemoved([1]))  # lost too
    feed.receive(*engine.batch(stored(3, parent=2)))
    assert (feed.replayed, feed.clears, feed.next_seq) == (2, 0, 4)
    assert not index.holds("r", 1) and index.holds("r", 2) and index.holds("r", 3)


def test_a_feed_that_joins_late_replays_from_the_start() -> None:
    engine, index = Engine(), CacheIndex()
    engine.batch(stored(1))  # before the subscriber connected
    feed = EventFeed(index, "r", engine.replay)
    feed.receive(*engine.batch(stored(2, parent=1)))
    assert index.depths([1, 2]) == {"r": 2} and feed.replayed == 1


def test_what_the_replay_cannot_cover_clears_the_replica() -> None:
    engine, index = Engine(keep=2), CacheIndex()
    feed = EventFeed(index, "r", engine.replay)
    feed.receive(*engine.batch(stored(1)))
    engine.batch(BlockRemoved([1]))  # lost, and gone from the replay buffer
    engine.batch(stored(5))  # lost, still in the buffer (with the live one)
    feed.receive(*engine.batch(stored(6)))
    assert feed.clears == 1 and feed.replayed == 1
    assert not index.holds("r", 1) and index.holds("r", 5) and index.holds("r", 6)
    without = EventFeed(CacheIndex(), "s")  # no replay socket: a gap clears
    without.receive(0, [stored(1)])
    without.receive(2, [stored(2)])
    assert without.clears == 1 and not without.index.holds("s", 1)


def test_catching_up_applies_what_came_before_and_ignores_its_repeats() -> None:
    engine, index = Engine(), CacheIndex()
    engine.batch(stored(1))
    engine.batch(stored(2, parent=1))
    feed = EventFeed(index, "r", engine.replay)
    feed.catch_up()
    assert index.depths([1, 2]) == {"r": 2} and feed.next_seq == 2
    feed.receive(*engine.sent[1])  # the live stream repeats a replayed batch
    assert feed.clears == 0
    feed.receive(*engine.batch(BlockRemoved([2])))
    feed.receive(0, [stored(7)])  # now a lower number is a restart
    assert feed.clears == 1 and index.depths([7]) == {"r": 1} and not index.holds("r", 1)


def test_a_restarted_engine_clears_its_entries_and_starts_over() -> None:
    index = CacheIndex()
    feed = EventFeed(index, "r")
    for seq in range(3):
        feed.receive(seq, [stored(seq)])
    feed.receive(0, [stored(9)])  # the engine's publisher counts from 0 again
    assert feed.clears == 1 and index.depths([9]) == {"r": 1} and index.blocks("r") == 1


def identity(tokens):
    return list(tokens)


def test_the_precise_router_follows_what_replicas_hold_not_what_it_sent() -> None:
    index = PreciseIndex(identity)
    router = FeatherRouter(["a", "b"], index=index)
    assert router.route_tokens("x", [1, 2, 3]) == "a"
    assert router.route_tokens("y", [1, 2, 4]) == "a"  # in flight on a: not scattered
    router.finished("x")
    router.finished("y")
    index.cache.apply("a", [BlockRemoved([1])])  # a never stored it, or evicted it...
    index.cache.apply("b", [stored(1, 2, 3)])  # ... and b holds it
    assert router.route_tokens("z", [1, 2, 3, 7]) == "b"


def test_a_longer_cached_prefix_in_the_band_beats_a_holder_past_it() -> None:
    index = PreciseIndex(identity)
    router = FeatherRouter(["a", "b", "c"], index=index, balance_abs=1, balance_rel=1.0)
    index.cache.apply("a", [stored(1, 2, 3, 4)])
    index.cache.apply("b", [stored(1, 2)])
    router.route_tokens("busy0", [1, 2, 3, 4])  # a holds it all, in the band
    router.route_tokens("busy1", [1, 2, 3, 4])
    assert (router.load("a"), router.load("b"), router.load("c")) == (2, 0, 0)
    assert router.route_tokens("q", [1, 2, 3, 4]) == "b"  # a is past 0 + 1


def test_in_flight_prompts_count_at_chunk_granularity_and_the_home_ranks_first() -> None:
    index = PreciseIndex(identity, chunk_blocks=2)
    router = FeatherRouter(["a", "b"], index=index)
    router.route_tokens("x", [1, 2, 3, 4])  # chunks: keys 2 and 4
    assert index.depths([1, 2, 3, 4, 5]) == {"a": 1}  # nobody caches it: where it went
    index.cache.apply("b", [stored(1)])
    assert index.depths([1, 2, 3, 4, 5]) == {"a": 9, "b": 2}  # 4 blocks in flight, home
    assert index.depths([1, 2, 3, 5]) == {"a": 5, "b": 2}  # one chunk in flight
    router.withdraw("x")  # never ran on a: forgotten there
    assert index.depths([1, 2, 3, 4]) == {"b": 2}


def test_a_prefix_nobody_caches_keeps_its_home() -> None:
    index = PreciseIndex(identity)
    router = FeatherRouter(["a", "b"], index=index)
    assert router.route_tokens("x", [1, 2]) == "a"
    router.finished("x")  # a evicted it since (no event says a holds it)
    router.route_tokens("busy", [7])  # a new prefix: b (fewest prefixes routed there)
    assert router.route_tokens("y", [1, 2]) == "a"
    index.cache.apply("b", [stored(1, 2)])
    index.cache.apply("a", [stored(1, 2)])
    assert router.route_tokens("z", [1, 2]) == "a"  # as many blocks: the home first


def test_sessions_stay_on_their_replica_while_it_is_in_the_band() -> None:
    router = FeatherRouter(["a", "b"], balance_abs=1, balance_rel=1.0)
    home = router.route("t0", [("s", 0)], session="chat")
    other = "b" if home == "a" else "a"
    assert router.route("o0", [("o", 0)]) == other  # a new prefix: to the other replica
    assert router.route("t1", [("x", 1)], session="chat") == home  # unlike its prefix
    assert router.route("t2", [("x", 2)], session="chat") == home  # 2 = 1 + 1: in the band
    assert router.route("t3", [("x", 3)], session="chat") == other  # home past the band
    assert router.route("t4", [("x", 4)], session="chat") == other  # the session moved
    router.remove_replica(other)
    assert router.route("t5", [("x", 5)], session="chat") == home  # a dead home is left


def test_only_the_most_recent_sessions_are_kept() -> None:
    router = FeatherRouter(["a", "b"], max_sessions=2)
    for s in range(3):
        router.route(s, [], session=f"s{s}")
    assert list(router._sessions) == ["s1", "s2"]
