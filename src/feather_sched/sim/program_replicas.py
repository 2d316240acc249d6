"""Agent programs behind a router over several simulated engines, on one clock.

Each replica is a ``SimEngine`` with its own policy and retention (``sim.programs``: LRU,
or Feather's sessions, each replica keeping its own).  Turns come closed loop
(``programs.TurnQueue``): a program's next turn its tool time after its previous turn
ends, routed at that time with the program as its session id (as the Ray Serve path
passes ``x-session-id``), after every step that starts before it and with the router told
of every finish by then (``sim.replicas``' driver, whose ``Finishes`` and ``connect`` this
reuses, KV events included).  The result says where each turn went, so whether a
program's turns stayed on one replica, and what their prefix found there, can be read.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from feather_sched.core.sessions import RetentionConfig
from feather_sched.results.records import RequestRecord
from feather_sched.routing.router import Router
from feather_sched.sim.engine import SimEngine
from feather_sched.sim.programs import LruRetention, TurnQueue, Turns, serving
from feather_sched.sim.replicas import Finishes, ReplicaResult, collect, connect
from feather_sched.sim.runner import SimPlan
from feather_sched.workloads.agents import AgentWorkload
from feather_sched.workloads.spec import RequestSpec


@dataclass
class ProgramReplica:
    """One replica: its engine, its policy and what a finished turn's blocks become."""

    engine: SimEngine
    policy: Any
    retention: LruRetention


@dataclass
class ProgramReplicaResult:
    """One run of agent programs over replicas: all turns as one run (``jobs``: a program
    is a job), each replica's share, and the replica each turn was routed to."""

    replicas: ReplicaResult
    agents: AgentWorkload
    placed: dict[str, Hashable]
    """Each turn's replica, in routing order."""
    retention: dict[Hashable, dict[str, Any]]
    """Each replica's retention counters."""

    def continuing(self) -> Iterator[tuple[RequestRecord, bool]]:
        """Each continuing turn that ran (a turn after a program's first) and whether it
        went to its predecessor's replica.  O(turns)."""
        records = {r.request_id: r for r in self.replicas.run.records}
        for program in self.agents.programs:
            for before, after in pairwise(program.turns):
                turn = after.spec.request_id
                if turn in records:
                    yield records[turn], \
                        self.placed[turn] == self.placed[before.spec.request_id]

    def stayed_share(self) -> float:
        """The share of continuing turns routed to their predecessor's replica."""
        stayed = [kept for _, kept in self.continuing()]
        return sum(stayed) / len(stayed) if stayed else math.nan

    def cached_share(self) -> float:
        """The share of continuing turns' prompt tokens found cached (or held)."""
        cached = prompt = 0
        for record, _ in self.continuing():
            cached += record.cached_tokens or 0
            prompt += record.prompt_len
        return cached / prompt if prompt else math.nan


def run_program_replicas(agents: AgentWorkload, router: Router,
                         replicas: dict[Hashable, ProgramReplica],
                         name: str) -> ProgramReplicaResult:
    """Serve ``agents`` closed loop over ``replicas`` (replica -> its engine, policy and
    retention, all over one ``Turns`` book) behind ``router``, whose replicas must be
    exactly these.  Every turn is routed once and ends once (or this raises).  Cost: the
    engines' steps, plus O(replicas) and the router's cost per turn."""
    finishes = Finishes()
    queue = TurnQueue(agents, next(iter(replicas.values())).retention.turns)

    def on_done(record: RequestRecord) -> None:
        finishes.add(record)
        queue.released(record)

    connect(router, {r: replica.engine for r, replica in replicas.items()})
    for replica in replicas.values():
        replica.engine.retention = replica.retention
        replica.engine.start(replica.policy, on_done=on_done)
        replica.retention.start()
    placed: dict[str, Hashable] = {}

    def arrive(spec: RequestSpec) -> None:
        finishes.deliver(router, spec.arrival_s)
        chosen = placed[spec.request_id] = router.route_tokens(
            spec.request_id, spec.prompt, session=spec.group)
        replicas[chosen].retention.arrived(spec)
        replicas[chosen].engine.add(spec)

    queue.serve([replica.engine for replica in replicas.values()], arrive)
    finishes.deliver(router, math.inf)
    result = collect(list(placed), router,
                     {r: replica.engine.result() for r, replica in replicas.items()}, name)
    result.run.jobs = True
    return ProgramReplicaResult(result, agents, placed, {
        r: replica.retention.counts() for r, replica in replicas.items()})


def program_replicas(plan: SimPlan, agents: AgentWorkload, names: list[Hashable],
                     scheduler: str, config: RetentionConfig | None = None
                     ) -> dict[Hashable, ProgramReplica]:
    """One replica per name, each an engine as ``plan`` configures one, serving agent
    programs as ``programs.serving`` builds ``scheduler`` (``+sessions``: Feather's
    sessions under ``config``)."""
    turns = Turns.of(agents)
    built = {}
    for name in names:
        engine = SimEngine(plan.cost_model("fcfs"), plan.engine_config())
        built[name] = ProgramReplica(engine, *serving(scheduler, engine, turns, config))
    return built
