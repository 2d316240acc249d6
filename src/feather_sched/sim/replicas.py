"""Several simulated engines behind a router, on one simulated clock.

Each replica is a ``SimEngine`` with its own policy, stepping independently; the driver
always advances the replica whose next event is earliest, and routes each arrival at its
arrival time, after every step that starts before it.  The router sees a request finish
at the simulated time it finished, so its view of load is what a real router would have.
Keys are computed once per request for the router (``Router.route_tokens``), as a real
router would from token ids; the router's own CPU time is not charged to the clock
(``benchmarks/replicas/router_overhead.py`` measures it).  A router whose index is a
``cache_index.PreciseIndex`` gets every engine's KV events (each step's batch, numbered,
through an ``EventFeed``) as the engine schedules, before any later arrival is routed.
``Ingresses`` are several routers over the same replicas, as Ray Serve builds one per
ingress replica: each sees only the requests dealt to it, and each precise index all
the events.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from feather_sched.core.cht import DEFAULT_CHUNK_TOKENS
from feather_sched.core.prefix import keys_per_chunk
from feather_sched.results.records import RequestRecord, RunResult
from feather_sched.results.summary import VLLM_PERCENTILES, Percentiles, Summary, summarize
from feather_sched.routing.cache_index import EventFeed, KVEvent, PreciseIndex
from feather_sched.routing.router import Router
from feather_sched.sim.block_pool import BlockKeys
from feather_sched.sim.engine import EngineConfig, Policy, SimEngine, SimResult
from feather_sched.sim.policies import make_policy
from feather_sched.sim.runner import SimPlan
from feather_sched.workloads.spec import Workload


@dataclass(frozen=True)
class ReplicaStats:
    """What one replica did in a run."""

    replica: Hashable
    requests: int
    groups: int
    """Distinct workload prefix groups among its requests (requests sharing nothing,
    group -1, not counted)."""
    busy_s: float
    """Seconds its steps took by the cost model (its busy time)."""
    preemptions: int


@dataclass
class ReplicaResult:
    """One run over replicas: all requests as one benchmark run, and each replica's share."""

    run: RunResult
    replicas: list[ReplicaStats]

    @property
    def imbalance(self) -> float:
        """Max over mean of the replicas' busy time (1.0: perfectly even)."""
        busy = [r.busy_s for r in self.replicas]
        mean = sum(busy) / len(busy)
        return max(busy) / mean if mean else 1.0

    def summary(self, percentiles: Percentiles = VLLM_PERCENTILES) -> Summary:
        """The benchmark summary of all requests (latency ``percentiles``), plus the
        imbalance and per replica the groups and requests it served (lists in replica
        order)."""
        return {**summarize(self.run, percentiles), "replica_imbalance": self.imbalance,
                "groups_per_replica": [r.groups for r in self.replicas],  # type: ignore[dict-item]
                "requests_per_replica": [r.requests for r in self.replicas]}  # type: ignore[dict-item]


class Ingresses:
    """Several routers over the same replicas, requests dealt to them in turn; each keeps
    its own loads and index (as separate Ray Serve ingress replicas do).  Has the
    ``Router`` calls the simulator makes."""

    def __init__(self, routers: Sequence[Router]) -> None:
        if not routers or any(set(r.replicas) != set(routers[0].replicas) for r in routers):
            raise ValueError("ingresses need one or more routers over the same replicas")
        self.routers = list(routers)
        self.name = f"{routers[0].name}x{len(routers)}"
        self._turn = itertools.count()
        self._owner: dict[Hashable, Router] = {}

    @property
    def replicas(self) -> list[Hashable]:
        return self.routers[0].replicas

    def __len__(self) -> int:
        return len(self._owner)

    def route_tokens(self, request_id: Hashable, tokens: np.ndarray | Sequence[int]
                     ) -> Hashable:
        router = self.routers[next(self._turn) % len(self.routers)]
        self._owner[request_id] = router
        return router.route_tokens(request_id, tokens)

    def finished(self, request_id: Hashable) -> Hashable:
        return self._owner.pop(request_id).finished(request_id)


def run_replicas(workload: Workload, router: Router | Ingresses,
                 engines: dict[Hashable, tuple[SimEngine, Policy]], name: str) -> ReplicaResult:
    """Serve ``workload`` with ``engines`` (replica -> engine and its policy) behind
    ``router`` (or several), whose replicas must be exactly the engines'.  Every request
    is routed once and ends once (or this raises)."""
    finishes = Finishes()
    connect(router, {replica: engine for replica, (engine, _) in engines.items()})
    for engine, policy in engines.values():
        engine.start(policy, on_done=finishes.add)
    steppers = [engine for engine, _ in engines.values()]
    for spec in workload.requests:
        _advance(steppers, spec.arrival_s)
        finishes.deliver(router, spec.arrival_s)
        replica = router.route_tokens(spec.request_id, spec.prompt)
        engines[replica][0].add(spec)
    _advance(steppers, math.inf)
    finishes.deliver(router, math.inf)
    return collect([spec.request_id for spec in workload.requests], router,
                   {r: engine.result() for r, (engine, _) in engines.items()}, name)


def precise_index(config: EngineConfig,
                  chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> PreciseIndex:
    """A ``PreciseIndex`` over engines configured as ``config``: their block keys, in-flight
    prompts counted every ``chunk_tokens`` tokens."""
    return PreciseIndex(BlockKeys(config.block_tokens),
                        keys_per_chunk(config.block_tokens, chunk_tokens))


class _Publisher:
    """An engine's event batches, numbered from 0, into its replica's feed of each
    subscribed index."""

    def __init__(self, feeds: list[EventFeed]) -> None:
        self.feeds = feeds
        self.seq = itertools.count()

    def __call__(self, events: list[KVEvent]) -> None:
        seq = next(self.seq)
        for feed in self.feeds:
            feed.receive(seq, events)


def _advance(engines: Sequence[SimEngine], until: float) -> None:
    """Step the earliest engine while its next event comes before ``until``."""
    while True:
        engine = min(engines, key=SimEngine.next_event_s)
        if engine.next_event_s() >= until:  # inf >= inf: nothing left to do
            return
        engine.step()


class Finishes:
    """Requests that ended, by their simulated end, until the router is told of them
    (as a real router learns of a finish when it happens).  O(log requests) each."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable]] = []
        self._order = itertools.count()

    def add(self, record: RequestRecord) -> None:
        """An engine's ``on_done``."""
        heapq.heappush(self._heap, (record.finished_s or 0.0, next(self._order),
                                    record.request_id))

    def deliver(self, router: Router | Ingresses, until: float) -> None:
        """Tell the router of every request that finished by ``until``."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            router.finished(heapq.heappop(heap)[2])


def connect(router: Router | Ingresses, engines: dict[Hashable, SimEngine]) -> None:
    """Each engine's KV events to its replica's feed of every ``PreciseIndex`` among the
    router's (or ingresses') indexes (none: the engines emit no events).  Before ``start``;
    ValueError unless the router's replicas are exactly the engines'."""
    if set(router.replicas) != set(engines):
        raise ValueError(f"router replicas {router.replicas} are not the engines' "
                         f"{list(engines)}")
    indexes = [r.index for r in getattr(router, "routers", [router])
               if isinstance(getattr(r, "index", None), PreciseIndex)]
    for replica, engine in engines.items():
        engine.kv_events = _Publisher([EventFeed(index.cache, replica) for index in indexes]) \
            if indexes else None


def collect(request_ids: Sequence[str], router: Router | Ingresses,
            results: dict[Hashable, SimResult], name: str) -> ReplicaResult:
    """The run of the requests routed (``request_ids``, in that order) from each replica's
    result; raises unless the router has been told of every finish and every request
    routed ended exactly once."""
    if len(router):
        raise RuntimeError(f"{len(router)} requests routed and never finished")
    records: dict[str, RequestRecord] = {}
    stats = []
    for replica, result in results.items():
        records.update((r.request_id, r) for r in result.records)
        stats.append(ReplicaStats(
            replica=replica, requests=len(result.records),
            groups=len({r.group for r in result.records} - {-1}),
            busy_s=result.costs.model_seconds, preemptions=result.num_preemptions))
    if sum(s.requests for s in stats) != len(request_ids) or set(records) != set(request_ids):
        raise RuntimeError("the engines' records are not the requests routed, once each")
    ordered = [records[request_id] for request_id in request_ids]
    run = RunResult(name=name, records=ordered,
                    duration_s=max((r.finished_s or 0.0 for r in ordered), default=0.0),
                    steps=[step for result in results.values() for step in result.steps])
    return ReplicaResult(run, stats)


def simulate_replicas(plan: SimPlan, router: Router | Ingresses, scheduler: str,
                      name: str | None = None) -> ReplicaResult:
    """``plan``'s workload on one engine per router replica, each engine as ``plan``
    configures one (hardware, model, limits, Feather options) and running ``scheduler``
    (a ``make_policy`` name)."""
    engines = {}
    for replica in router.replicas:
        engine = SimEngine(plan.cost_model(scheduler), plan.engine_config())
        engines[replica] = (engine, make_policy(scheduler, plan.feather_options, engine))
    return run_replicas(plan.workload, router, engines,
                        name or f"{router.name}+{scheduler}")
