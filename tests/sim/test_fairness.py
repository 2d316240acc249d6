"""The fairness bounds in the simulator: over random workloads, every request is passed by
at most ``max_overtakes`` later arrivals, and sits through at most ``max_stops`` of the
gate's STOPs, while it waits; and a request preempted ``max_preemptions`` times is
preempted again only once no other member of its group runs below the bound (all
counted from the outside)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from feather_sched.gates.base import Decision
from feather_sched.sim.engine import EngineConfig, SimEngine
from feather_sched.sim.policies import make_policy
from feather_sched.workloads.spec import ArrivalSpec, Workload
from feather_sched.workloads.synthetic import shared_prefix_groups
from tests.sim.test_engine import StubCost

PREEMPTION_BOUND = 2
"""``max_preemptions`` in these runs (below its default, so the rule acts often)."""


class Witness:
    """Delegates to the policy, counting overtakes from the calls the engine makes."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.sequence: dict[str, float] = {}
        """Arrival times: a request arriving at the same moment never overtakes."""
        self.waiting_since: dict[str, int] = {}
        self.admitted: list[float] = []
        self.stops = 0
        self.stops_at_entry: dict[str, int] = {}
        self.worst = 0
        self.worst_stops = 0
        self.preemptions: dict[str, int] = {}
        self.bound_broken = 0
        """Victims at the preemption bound chosen while a sibling below it ran."""

    def __getattr__(self, name: str):
        return getattr(self.policy, name)

    def __len__(self) -> int:
        return len(self.policy)

    def enter_waiting(self, request) -> None:
        self.sequence.setdefault(request.request_id, request.spec.arrival_s)
        self.waiting_since[request.request_id] = len(self.admitted)
        self.stops_at_entry[request.request_id] = self.stops
        self.policy.enter_waiting(request)

    def decide(self):
        answer = self.policy.decide()
        if answer is not None and answer.decision is Decision.STOP and answer.context:
            self.stops += 1
        return answer

    def preemption_victim(self, running):
        victim = self.policy.preemption_victim(running)
        counts = self.preemptions
        if counts.get(victim.request_id, 0) >= PREEMPTION_BOUND:
            self.bound_broken += any(
                r.group == victim.group and counts.get(r.request_id, 0) < PREEMPTION_BOUND
                for r in running)
        counts[victim.request_id] = counts.get(victim.request_id, 0) + 1
        return victim

    def admit(self, request) -> None:
        rid = request.request_id
        mine = self.sequence[rid]
        passed = sum(s > mine for s in self.admitted[self.waiting_since.pop(rid):])
        self.worst = max(self.worst, passed)
        self.worst_stops = max(self.worst_stops, self.stops - self.stops_at_entry.pop(rid))
        self.admitted.append(mine)
        self.policy.admit(request)


@settings(max_examples=25, deadline=None)
@given(groups=st.integers(1, 5), per_group=st.integers(2, 12), limit=st.integers(0, 6),
       gate=st.sampled_from(["always", "chunk-loss", "bandit"]),
       rate=st.sampled_from([None, 50.0, 400.0]), blocks=st.integers(40, 400),
       output_len=st.sampled_from([6, 40]), seed=st.integers(0, 1000))
def test_no_request_is_overtaken_more_than_the_bound(groups, per_group, limit, gate, rate,
                                                     blocks, output_len, seed) -> None:
    workload: Workload = shared_prefix_groups(
        groups=groups, prompts_per_group=per_group, prefix_len=64, suffix_len=8,
        output_len=output_len, seed=seed, popularity="zipf" if seed % 2 else "uniform",
        arrival=ArrivalSpec("poisson", rate) if rate else None)
    overtakes, stops = worst_case(workload, gate, limit, blocks)
    assert overtakes <= limit and stops <= limit


def worst_case(workload: Workload, gate: str, limit: int | None,
               blocks: int = 100) -> tuple[int, int]:
    """The most overtakes, and the most STOPs, a request sat through before admission;
    asserts that no victim at the preemption bound had a sibling below it running."""
    witness = witnessed(workload, gate, limit, blocks)
    assert witness.bound_broken == 0
    return witness.worst, witness.worst_stops


def witnessed(workload: Workload, gate: str, limit: int | None, blocks: int,
              preemption_bound: int | None = PREEMPTION_BOUND) -> Witness:
    """``workload`` run through Feather (``feather-GATE``, overtaking and stop bounds
    ``limit``, ``max_preemptions`` ``preemption_bound``) in a pool of ``blocks``."""
    engine = SimEngine(StubCost(keep=False),
                       EngineConfig(block_tokens=4, num_blocks=blocks, max_num_seqs=8,
                                    max_num_batched_tokens=96, charge_scheduler_time=False,
                                    group_tokens=16))
    options = {"max_overtakes": limit, "max_stops": limit, "max_wait_s": None,
               "chunk_tokens": 16, "min_passing_tokens": 64,  # the groups' prefix
               "max_preemptions": preemption_bound}
    witness = Witness(make_policy(f"feather-{gate}", options, engine))
    result = engine.run(workload, witness)
    assert all(r.success or r.error for r in result.records)
    return witness


def test_without_the_bound_the_tree_overtakes_far_more() -> None:
    workload = shared_prefix_groups(groups=4, prompts_per_group=10, prefix_len=64,
                                    suffix_len=8, output_len=6, popularity="zipf", seed=3,
                                    arrival=ArrivalSpec("poisson", 5000.0))
    assert worst_case(workload, "chunk-loss", None)[0] > 20
    assert worst_case(workload, "chunk-loss", 2)[0] == 2


def test_requests_that_arrive_together_do_not_overtake_each_other() -> None:
    together = shared_prefix_groups(groups=4, prompts_per_group=10, prefix_len=64,
                                    suffix_len=8, output_len=6, popularity="zipf", seed=3)
    assert worst_case(together, "chunk-loss", 1)[0] == 0


def test_a_request_at_the_preemption_bound_goes_after_its_siblings() -> None:
    """One group under KV pressure: without the bound, requests preempted twice are
    preempted again while a sibling preempted less runs beside them; with it, never."""
    workload = shared_prefix_groups(groups=1, prompts_per_group=16, prefix_len=64,
                                    suffix_len=8, output_len=40, seed=1,
                                    arrival=ArrivalSpec("poisson", 400.0))
    assert witnessed(workload, "always", 2, 60, preemption_bound=None).bound_broken > 0
    bounded = witnessed(workload, "always", 2, 60)
    assert bounded.bound_broken == 0 and max(bounded.preemptions.values()) == PREEMPTION_BOUND
