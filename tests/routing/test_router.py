"""FeatherRouter and the baseline routers: rules, load bound, dead replicas, exactly-once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_sched.core.cht import token_chunk_keys
from feather_sched.core.isolation import Namespace
from feather_sched.routing.baselines import (
    ROUTER_CLASSES,
    CacheAwareRouter,
    PrefixAffinityRouter,
    RoundRobinRouter,
    make_router,
)
from feather_sched.routing.cache_index import PreciseIndex
from feather_sched.routing.feather import FeatherRouter
from feather_sched.routing.prefix_index import PrefixIndex
from feather_sched.routing.router import RouterError


def group(g: int, member: int, depth: int = 4) -> list[tuple]:
    """Chunk keys of member ``member`` of group ``g``: ``depth`` shared keys, one own."""
    return [("g", g, i) for i in range(depth)] + [("m", g, member)]


def test_a_group_follows_its_replica_and_a_new_group_goes_to_the_least_loaded() -> None:
    router = FeatherRouter(range(4))
    first = router.route("a0", group(0, 0))
    assert [router.route(f"a{i}", group(0, i)) for i in range(1, 5)] == [first] * 4
    other = router.route("b0", group(1, 0))
    assert other != first and router.load(other) == 1


def test_new_groups_go_to_the_replicas_holding_fewest_prefixes_first() -> None:
    router = FeatherRouter(range(3))
    homes = [router.route(f"g{g}", group(g, 0)) for g in range(3)]
    assert sorted(homes) == [0, 1, 2]
    for g in range(3):
        router.finished(f"g{g}")  # every load 0 again; the prefixes stay warm
    router.route("long", group(3, 0, depth=40))  # replica 0 now holds many more keys
    assert router.route("next", group(4, 0)) == 1  # not 0, although all loads tie


def test_new_groups_respect_the_bound_and_keyless_prompts_go_to_the_least_loaded() -> None:
    router = FeatherRouter(range(2), balance_abs=2, balance_rel=1.0)
    for g in range(9):  # served and finished: 5 groups' keys on replica 0, 4 on replica 1
        router.route(f"w{g}", group(g, 0))
        router.finished(f"w{g}")
    assert [router.route(f"k{i}", []) for i in range(4)] == [0, 1, 0, 1]  # by load only
    for i in range(4):
        router.finished(f"k{i}")
    router.add_replica(2)  # scale-up: the new replica holds the fewest keys
    homes = [router.route(f"n{g}", group(10 + g, 0)) for g in range(4)]
    assert homes == [2, 2, 2, 1]  # the fourth would put replica 2 past 0 + 2 requests


def test_the_longest_share_wins() -> None:
    router = FeatherRouter(range(2), balance_abs=0, balance_rel=1.0)
    assert router.route("short", [1, 2]) == 0
    assert router.route("long", [1, 2, 3, 4]) == 1  # replica 0 is past the bound (1 > 0)
    assert router.route("deep", [1, 2, 3, 5]) == 1  # holds 3 chunks, replica 0 only 2


def test_a_hot_group_spreads_to_a_second_replica_and_balances_over_its_holders() -> None:
    router = FeatherRouter(range(4), balance_abs=2, balance_rel=1.0)
    home = router.route("r0", group(0, 0))
    assert [router.route(f"r{i}", group(0, i)) for i in (1, 2)] == [home, home]
    spill = router.route("r3", group(0, 3))  # home holds 3 > 0 + 2
    assert spill != home
    assert router.route("r4", group(0, 4)) == spill  # the new holder, not a third replica
    router.finished("r4")
    assert router.route("r5", group(0, 5)) == spill  # within the bound, less loaded (1 < 3)
    router.finished("r0")
    router.finished("r1")
    assert router.route("r6", group(0, 6)) == home  # now the less loaded holder (1 < 2)


def test_a_prefix_routes_only_requests_of_its_own_namespace() -> None:
    """A salted request never follows another salt's (or an unsalted) prefix: the router's
    keys live in the request's namespace, with either index."""
    prompt = np.arange(1024, dtype=np.int32)
    salted = [Namespace((("cache_salt", salt),)) for salt in "ab"]
    for router in (FeatherRouter(range(4)),
                   FeatherRouter(range(4), index=PreciseIndex(lambda t, b=(): [
                       (b, int(x)) for x in token_chunk_keys(t, 16)]))):
        first = router.route("a0", router.keys(prompt, salted[0]))
        assert router.route("a1", router.keys(prompt, salted[0])) == first
        others = {router.route("b0", router.keys(prompt, salted[1])),
                  router.route("p0", router.keys(prompt))}
        assert first not in others and len(others) == 2
    tenant = Namespace(tenant="acme")  # the engine's keys paired with the tenant's seed
    assert PreciseIndex(lambda t: [1, 2]).keys(prompt, tenant) == [(tenant.seed, 1),
                                                                   (tenant.seed, 2)]


def test_finishing_releases_the_load_and_keeps_the_prefix_warm() -> None:
    router = FeatherRouter(range(3))
    replica = router.route("x", group(0, 0))
    router.route("y", group(1, 0))
    assert router.finished("x") == replica and router.load(replica) == 0
    assert router.route("z", group(0, 1)) == replica  # served before: likely cached
    with pytest.raises(RouterError):
        router.finished("x")


def test_idle_prefixes_are_forgotten_deepest_first_past_the_limit() -> None:
    index = PrefixIndex(max_idle_keys=2)
    index.add("r", [1, 2, 3])
    index.release("r", [1, 2, 3])
    assert index.match([1, 2, 3]) == (2, {"r": 0})
    assert len(index) == 2 and index.sizes == {"r": 2}


def test_a_dead_replicas_keys_turn_idle_deepest_first() -> None:
    index = PrefixIndex(max_idle_keys=2)
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2, 3])
    index.release("a", [1, 2, 3])  # still counted by b: not idle yet
    index.drop("b")
    assert index.match([1, 2, 3]) == (2, {"a": 0})  # key 3 forgotten, the prefix kept


def test_a_dead_replica_is_never_chosen_and_its_requests_come_back_once() -> None:
    router = FeatherRouter(range(3), seed=1)
    routed = {f"q{i}": router.route(f"q{i}", group(i % 2, i)) for i in range(12)}
    router.finished("q0")
    dead = routed["q2"]
    orphans = router.remove_replica(dead)
    assert orphans == [rid for rid, r in routed.items() if r == dead and rid != "q0"]
    for rid in orphans:
        with pytest.raises(RouterError):
            router.finished(rid)
    assert all(router.route(rid, group(0, 99 + i)) != dead for i, rid in enumerate(orphans))
    assert all(router.route(f"n{i}", group(i % 3, i)) != dead for i in range(30))
    assert dead not in router.replicas
    with pytest.raises(RouterError):
        router.remove_replica(dead)


def test_routing_needs_a_live_replica_and_a_new_id() -> None:
    router = FeatherRouter([7])
    router.route("a", [1])
    with pytest.raises(RouterError):
        router.route("a", [1])
    assert router.remove_replica(7) == ["a"]
    with pytest.raises(RouterError):
        router.route("b", [1])


def test_round_robin_takes_turns() -> None:
    router = RoundRobinRouter("abc")
    assert [router.route(i, []) for i in range(5)] == list("abcab")


def test_ray_prefix_affinity_follows_a_ten_percent_match_while_balanced() -> None:
    router = PrefixAffinityRouter(range(2))
    long_prompt = list(range(100))
    assert router.route("a", long_prompt) == 0
    assert router.route("b", long_prompt[:10] + [("b", i) for i in range(90)]) == 0  # 10%
    assert router.route("c", long_prompt[:9] + [("c", i) for i in range(91)]) == 1  # 9%
    imbalanced = PrefixAffinityRouter(range(2), imbalanced_threshold=0)
    imbalanced.route("a", long_prompt)
    assert imbalanced.route("b", long_prompt) == 1  # loads differ: power of two


def test_sglang_cache_aware_needs_half_the_prompt_and_balances_past_both_thresholds() -> None:
    router = CacheAwareRouter(range(2), balance_abs=2, balance_rel=1.5)
    prompt = list(range(10))
    assert router.route("a", prompt) == 0
    assert router.route("b", prompt[:5] + [("b", i) for i in range(5)]) == 1  # not > 0.5
    assert [router.route(f"c{i}", prompt) for i in range(3)] == [0, 0, 0]  # 0 holds it
    assert router.route("d", prompt) == 1  # loads 4 and 1: 3 > 2 and 4 > 1.5


def test_router_names_are_validated() -> None:
    assert isinstance(make_router(" feather ", range(2)), FeatherRouter)
    with pytest.raises(ValueError, match="round-robin"):
        make_router("random", range(2))


def test_token_routing_uses_chunk_keys_of_the_prompt() -> None:
    router = FeatherRouter(range(4), chunk_tokens=4)
    prompt = np.arange(1, 13, dtype=np.int32)
    replica = router.route_tokens("a", prompt)
    assert router.route("b", token_chunk_keys(prompt[:8], 4)) == replica


OPS = st.lists(st.tuples(st.sampled_from(["route", "finish", "withdraw", "move", "remove", "add"]),
                         st.integers(0, 7), st.integers(0, 40)), max_size=120)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(ROUTER_CLASSES)), ops=OPS)
def test_every_request_is_finished_or_returned_exactly_once(name: str, ops: list) -> None:
    """Random routes, finishes, moves, deaths and new replicas: loads always equal what
    is in flight on each replica, every request ends exactly once, and FeatherRouter's
    index counts on each replica exactly the keys of the requests in flight there."""
    router = make_router(name, range(3), balance_abs=1) if name == "feather" else \
        make_router(name, range(3))
    where: dict[str, int] = {}
    keys: dict[str, list] = {}
    ended: set[str] = set()
    count, next_replica = 0, 3
    for op, a, b in ops:
        if op == "route" and router.replicas:
            rid = f"q{count}"
            count += 1
            keys[rid] = group(a % 3, b, depth=a)
            where[rid] = router.route(rid, keys[rid])
            assert where[rid] in router.replicas
        elif op == "finish" and where:
            rid = sorted(where)[b % len(where)]
            assert router.finished(rid) == where.pop(rid)
            ended.add(rid)
        elif op == "withdraw" and where:
            rid = sorted(where)[b % len(where)]
            assert router.withdraw(rid) == where.pop(rid)
            ended.add(rid)
        elif op == "move" and where:
            rid = sorted(where)[b % len(where)]
            where[rid] = router.replicas[a % len(router.replicas)]
            router.move(rid, where[rid])
        elif op == "remove" and router.replicas:
            dead = router.replicas[a % len(router.replicas)]
            returned = router.remove_replica(dead)
            assert sorted(returned) == sorted(r for r, at in where.items() if at == dead)
            for rid in returned:
                del where[rid]
                ended.add(rid)
        elif op == "add":
            router.add_replica(next_replica)
            next_replica += 1
        assert len(router) == len(where)
        for replica in router.replicas:
            assert router.load(replica) == sum(at == replica for at in where.values())
        if isinstance(router, FeatherRouter):
            assert_index_counts(router, where, keys)
    for rid in list(where):
        router.finished(rid)
        ended.add(rid)
    assert len(ended) == count and len(router) == 0


def assert_index_counts(router: FeatherRouter, where: dict, keys: dict) -> None:
    """Every key's count on each replica is the number of requests in flight there that
    have it; every replica's size is the number of keys it has an entry for."""
    counted: dict = {}
    for rid, replica in where.items():
        for key in keys[rid]:
            counted[key, replica] = counted.get((key, replica), 0) + 1
    prefixes = router.index.prefixes
    owners = prefixes._owners
    for key, holders in owners.items():
        for replica, count in holders.items():
            assert count == counted.pop((key, replica), 0)
    assert not counted
    for replica in router.replicas:
        assert prefixes.sizes.get(replica, 0) == sum(replica in h for h in owners.values())


def test_a_withdrawn_request_leaves_what_its_replica_served_before() -> None:
    router = FeatherRouter(["r", "s"])
    router.route("c", [1, 2])
    router.finished("c")  # r served keys 1 and 2: both idle there
    router.route("b", [1, 3])  # goes to r, which holds key 1
    assert router.withdraw("b") == "r" and "b" not in router
    assert router.index.prefixes.match([1, 2]) == (2, {"r": 0})  # still r's, as before b
    assert router.index.prefixes.match([1, 3]) == (1, {"r": 0})  # key 3: never served there
    with pytest.raises(RouterError):
        router.finished("b")


def test_the_core_moves_a_request_sent_past_its_first_choice() -> None:
    """What Ray Serve's ``on_request_routed`` relies on when its fallback rank took the
    request (``integrations.ray_serve``)."""
    router = FeatherRouter(["r0", "r1"])
    assert router.route(7, [1, 2]) == "r0" and 7 in router
    router.move(7, "r1")
    assert router.replica_of(7) == "r1" and (router.load("r0"), router.load("r1")) == (0, 1)
    assert router.index.prefixes.match([1, 2]) == (2, {"r1": 1})  # r0 never served it
    assert router.route(8, [1, 2]) == "r1"  # the group moved with it
    assert router.finished(7) == "r1" and 7 not in router
