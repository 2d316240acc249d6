"""sim.program_replicas: agent programs over replicas behind a router on one clock.  A
program's turns stay on its replica while load allows and find their prefix there; a
replica beyond the band loses its sessions; every turn ends once; each replica's holds
stay within their bound."""

from __future__ import annotations

from itertools import pairwise

import pytest

from feather_sched.core.sessions import RetentionConfig
from feather_sched.results.summary import summarize
from feather_sched.routing.baselines import make_router
from feather_sched.routing.feather import FeatherRouter
from feather_sched.sim.program_replicas import program_replicas, run_program_replicas
from feather_sched.sim.replicas import precise_index
from feather_sched.sim.runner import SimPlan
from feather_sched.workloads.agents import agent_programs
from feather_sched.workloads.spec import ArrivalSpec
from tests.sim.test_programs import SMALL

SESSIONS = "feather-always+sessions"


def agents(programs: int = 12, rate: float = 4.0, seed: int = 0):
    return agent_programs(programs=programs, arrival=ArrivalSpec("poisson", rate),
                          shape=SMALL, seed=seed)


def plan(load, num_blocks: int = 20000, **engine) -> SimPlan:
    return SimPlan.from_options(load.open_loop(), num_blocks=num_blocks,
                                charge_scheduler_time=False, **engine)


def feather(names, load_plan: SimPlan, **band) -> FeatherRouter:
    return FeatherRouter(names, seed=1, index=precise_index(load_plan.engine_config()), **band)


def grown(turn) -> int:
    """The KV a turn leaves for its successor, in whole blocks (its prompt and output,
    less the last token, never computed)."""
    return (turn.spec.prompt.size + turn.spec.output_len - 1) // 16 * 16


def test_while_load_allows_a_programs_turns_stay_and_find_their_prefix():
    load = agents()
    roomy = plan(load)
    result = run_program_replicas(load, feather(range(3), roomy),
                                  program_replicas(roomy, load, list(range(3)), SESSIONS), "f")
    records = {r.request_id: r for r in result.replicas.run.records}
    homes = set()
    for program in load.programs:
        ids = [turn.spec.request_id for turn in program.turns]
        assert {result.placed[i] for i in ids} == {result.placed[ids[0]]}
        homes.add(result.placed[ids[0]])
        for before, after in pairwise(program.turns):
            assert records[after.spec.request_id].cached_tokens == grown(before)
    assert len(homes) >= 2  # new programs go by their agent type's system block
    assert result.stayed_share() == 1.0 and result.cached_share() > 0.85


def test_a_load_only_router_scatters_a_programs_turns_and_their_prefix():
    """The contrast that makes the test above able to fail: round robin moves turns, and
    a moved turn misses at least its predecessor's last blocks."""
    load = agents()
    roomy = plan(load)
    result = run_program_replicas(load, make_router("round-robin", range(3)),
                                  program_replicas(roomy, load, list(range(3)), SESSIONS), "rr")
    records = {r.request_id: r for r in result.replicas.run.records}
    moved = [(before, after) for program in load.programs
             for before, after in pairwise(program.turns)
             if result.placed[before.spec.request_id] != result.placed[after.spec.request_id]]
    assert moved and all(records[after.spec.request_id].cached_tokens < grown(before)
                         for before, after in moved)
    assert result.stayed_share() < 0.5 and result.cached_share() < 0.75


class BandSpy(FeatherRouter):
    """Records, for each turn of a session seen before, its home's load and the band's
    bound when it was routed, and where it went."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.decisions: list[tuple[object, int, int, object]] = []

    def _rule(self, keys, session):
        home = self._sessions.get(session)
        chosen = super()._rule(keys, session)
        if home is not None:
            floor = min(self._load.values())
            bound = max(floor + self.balance_abs, floor * self.balance_rel)
            self.decisions.append((home, self._load[home], bound, chosen))
        return chosen


def overloaded(load, band: dict) -> tuple[BandSpy, object]:
    """Replica 0 serves one turn at a time (its queue grows), replicas 1 and 2 as usual."""
    fast, slow = plan(load), plan(load, max_num_seqs=1)
    replicas = {**program_replicas(slow, load, [0], SESSIONS),
                **program_replicas(fast, load, [1, 2], SESSIONS)}
    router = BandSpy(range(3), seed=1, index=precise_index(fast.engine_config()), **band)
    return router, run_program_replicas(load, router, replicas, "overloaded")


def test_beyond_the_band_sessions_move_and_within_it_they_stay():
    load = agents(programs=30, rate=20.0)
    router, result = overloaded(load, {"balance_abs": 2, "balance_rel": 1.0})
    moves = [(home, load_, bound) for home, load_, bound, chosen in router.decisions
             if chosen != home]
    assert moves
    assert all(load_ > bound for _, load_, bound in moves)
    assert all(chosen == home for home, load_, bound, chosen in router.decisions
               if load_ <= bound)
    assert result.stayed_share() < 1.0
    _, wide = overloaded(load, {"balance_abs": 10**6})
    assert wide.stayed_share() == 1.0  # the same overload within a wide band: none moves


@pytest.mark.parametrize("router", ["feather", "power-of-two"])
@pytest.mark.parametrize("seed", range(2))
def test_every_turn_ends_once_and_each_replicas_holds_stay_within_the_bound(router, seed):
    """A pool of a few programs' worth per replica, sessions bounded at 0.3 of it.  A
    hold left at the end is one whose session's next turn was routed elsewhere (its
    replica is not told; the hold lapses and yields to whoever needs the blocks)."""
    load = agents(programs=24, rate=8.0, seed=seed)
    tight = plan(load, num_blocks=600)
    route = feather(range(2), tight) if router == "feather" else make_router(router, range(2))
    replicas = program_replicas(tight, load, [0, 1], SESSIONS,
                                RetentionConfig(max_held_share=0.3))
    result = run_program_replicas(load, route, replicas, router)
    turns = [turn.spec.request_id for program in load.programs for turn in program.turns]
    ids = [r.request_id for r in result.replicas.run.records]
    assert sorted(ids) == sorted(turns) and len(set(ids)) == len(ids)
    assert list(result.placed) == ids and len(route) == 0
    assert all(r.success for r in result.replicas.run.records)
    assert summarize(result.replicas.run)["jobs_completed"] == len(load.programs)
    turns_of = next(iter(replicas.values())).retention.turns.next
    for name, replica in replicas.items():
        counts = replica.retention.counts()
        assert 0 <= counts["max_held_share"] <= 0.3
        for holder in replica.retention.held:  # only a session that went elsewhere
            after = turns_of[holder.removeprefix("hold:")]
            assert after is not None and result.placed[after.spec.request_id] != name
        replica.engine.pool.check()
    assert max(r.retention.counts()["held"] for r in replicas.values()) > 0
