"""Feather's Prometheus metrics, served on the engine's own ``/metrics`` endpoint.

The scheduler runs in vLLM's engine-core process (in SGLang, the scheduler process),
while ``/metrics`` is served by the API server process.  prometheus_client's multiprocess
mode carries samples between them: with ``PROMETHEUS_MULTIPROC_DIR`` set, every process
writes its metrics to files in that directory and the server's registry collects them
all.  vLLM's server reads that directory whenever the variable is set (its own
multi-server mode sets it; ``feather serve`` sets it for a single server too), and SGLang
sets it whenever ``--enable-metrics`` is on.  Feather records metrics only in that mode
(elsewhere nobody could scrape them); names follow vLLM's style under ``feather:``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

ENV_MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"
GROUP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
DEFERRAL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
SCHEDULE_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
PREEMPTION_BUCKETS = (0.5, 1, 2, 3, 4, 6, 8, 16)
"""Positive bounds (Ray's metrics relay refuses 0); le=0.5 counts the never preempted."""
OTHER_TENANTS = "other"
"""The tenant label of every tenant past ``max_tenant_labels``."""
FAULT_SITES = ("begin_pass", "decide", "admit", "end_pass")
"""The ``where`` of ``feather:faults`` present at zero from the start: a pass's parts."""


def enabled() -> bool:
    """Whether this process's metrics can reach a ``/metrics`` endpoint."""
    return bool(os.environ.get(ENV_MULTIPROC))


@dataclass(frozen=True)
class _Metrics:
    decisions: Counter
    questions: Counter
    deferral: Histogram
    groups: Histogram
    homogeneous: Counter
    waiting: Gauge
    running: Gauge
    schedule: Histogram
    preemptions: Counter
    request_preemptions: Histogram
    preempted_group: Histogram
    urgent_preemptions: Counter
    faults: Counter
    tenant_admissions: Counter
    tenant_deferral: Histogram
    tenant_service: Counter
    sessions_held: Gauge
    session_blocks_held: Gauge
    session_events: Counter


SESSION_EVENTS = {"held": "hold made", "expired": "lapsed hold released",
                  "reloads_avoided": "continuing turn that found its blocks held",
                  "refused": "hold refused by the bound", "reclaimed": "hold released "
                  "under pressure", "displaced": "hold displaced by a more valuable one"}
"""The ``event`` values of ``feather:session_events``: ``core.sessions.SessionCounts``'s."""


@functools.cache
def _registered() -> _Metrics:
    """The metric objects, created once per process (prometheus refuses duplicates)."""
    labels = ["scheduler"]
    return _Metrics(
        decisions=Counter("feather:gate_decisions", "Admissions by outcome: add (the gate "
                          "admitted), stop (the gate ended a pass early), forced (a fairness "
                          "bound admitted over the gate).", [*labels, "decision"]),
        questions=Counter("feather:gate_questions", "Candidates the gate was asked about "
                          "(admitted or not).", labels),
        deferral=Histogram("feather:admission_deferral_seconds", "Time from a request's "
                           "arrival to its admission.", labels, buckets=DEFERRAL_BUCKETS),
        groups=Histogram("feather:prefix_groups_per_step", "Prefix groups in the running "
                         "batch at each scheduling pass.", labels, buckets=GROUP_BUCKETS),
        homogeneous=Counter("feather:homogeneous_steps", "Scheduling passes whose running "
                            "batch is one prefix group.", labels),
        waiting=Gauge("feather:num_requests_waiting", "Requests in Feather's waiting queue.",
                      labels, multiprocess_mode="livesum"),
        running=Gauge("feather:num_requests_running", "Requests in Feather's running set.",
                      labels, multiprocess_mode="livesum"),
        schedule=Histogram("feather:schedule_seconds", "Wall time of one scheduling call "
                           "(the engine's own work included).", labels,
                           buckets=SCHEDULE_BUCKETS),
        preemptions=Counter("feather:preemptions", "Running requests preempted for KV room, "
                            "by the victim's priority class.", [*labels, "priority"]),
        request_preemptions=Histogram("feather:request_preemptions", "Times each request "
                                      "that left the scheduler had been preempted.", labels,
                                      buckets=PREEMPTION_BUCKETS),
        preempted_group=Histogram("feather:preempted_group_size", "Running requests of the "
                                  "victim's prefix group (itself included) at each "
                                  "preemption: 1 is a singleton or minority request.", labels,
                                  buckets=GROUP_BUCKETS),
        urgent_preemptions=Counter("feather:urgent_preemptions", "Running requests "
                                   "preempted for a waiting request of a more urgent class "
                                   "(each request at most max_urgent_preemptions times), by "
                                   "the victim's priority class.", [*labels, "priority"]),
        faults=Counter("feather:faults", "Exceptions in Feather's own code, each contained by "
                       "its scheduling pass falling back to the engine's own order, by where "
                       "they arose.", [*labels, "where"]),
        tenant_admissions=Counter("feather:tenant_admissions", "Requests admitted, by "
                                  "tenant (past max_tenant_labels tenants: 'other').",
                                  [*labels, "tenant"]),
        tenant_deferral=Histogram("feather:tenant_admission_deferral_seconds", "Time from a "
                                  "request's arrival to its admission, by tenant.",
                                  [*labels, "tenant"], buckets=DEFERRAL_BUCKETS),
        tenant_service=Counter("feather:tenant_service_tokens", "Service each tenant "
                               "received: 1 per prompt token computed (cache hits free), 2 "
                               "per token generated, before its weight.",
                               [*labels, "tenant"]),
        sessions_held=Gauge("feather:sessions_held", "Agent sessions whose KV blocks are "
                            "held for their next turn.", labels, multiprocess_mode="livesum"),
        session_blocks_held=Gauge("feather:session_blocks_held", "Distinct KV blocks held "
                                  "for sessions.", labels, multiprocess_mode="livesum"),
        session_events=Counter("feather:session_events", "Session retention events: "
                               + "; ".join(f"{k}: {v}" for k, v in SESSION_EVENTS.items())
                               + ".", [*labels, "event"]),
    )


class TenantLabels:
    """The label value of each tenant, with a cap on how many there are: the first
    ``limit`` tenants seen keep their name, every later one is ``OTHER_TENANTS``, so an
    unbounded set of tenants adds at most ``limit + 1`` values to a series (per process:
    each scheduler process labels the tenants it saw first), besides the tenants named
    from the start (``always``: the default tenant).  O(1) a call."""

    def __init__(self, limit: int, always: Iterable[Hashable] = ()) -> None:
        self.limit = limit
        self._named: dict[Hashable, str] = {tenant: str(tenant) for tenant in always}
        self._always = len(self._named)

    def __call__(self, tenant: Hashable) -> str:
        label = self._named.get(tenant)
        if label is not None:
            return label
        if len(self._named) - self._always >= self.limit:
            return OTHER_TENANTS
        label = self._named[tenant] = str(tenant)
        return label


class PrometheusSink:
    """One scheduler's metrics (label ``scheduler``; ``tenant`` on the per-tenant series,
    at most ``max_tenant_labels`` names and ``OTHER_TENANTS``).  Every series is present
    from the start, a counter at zero (with its HELP and TYPE): the decisions, the
    preemptions of class 0, the faults of each of ``FAULT_SITES``, and the per-tenant
    series of each of ``tenants`` (the default tenant, named besides the cap), so a
    dashboard or an alert sees a zero rather than nothing before the first event."""

    def __init__(self, scheduler: str, max_tenant_labels: int = 32,
                 tenants: Iterable[Hashable] = ()) -> None:
        metrics = _registered()
        self._metrics = metrics
        tenants = tuple(tenants)
        self._tenant = TenantLabels(max_tenant_labels, tenants)
        self._decisions = {d: metrics.decisions.labels(scheduler, d)
                           for d in ("add", "stop", "forced")}
        self._questions = metrics.questions.labels(scheduler)
        self._deferral = metrics.deferral.labels(scheduler)
        self._groups = metrics.groups.labels(scheduler)
        self._homogeneous = metrics.homogeneous.labels(scheduler)
        self._waiting = metrics.waiting.labels(scheduler)
        self._running = metrics.running.labels(scheduler)
        self._schedule = metrics.schedule.labels(scheduler)
        self._scheduler = scheduler
        self._preemptions = metrics.preemptions
        self._request_preemptions = metrics.request_preemptions.labels(scheduler)
        self._preempted_group = metrics.preempted_group.labels(scheduler)
        self._faults = metrics.faults
        for counter in (metrics.preemptions, metrics.urgent_preemptions):
            counter.labels(scheduler, "0")
        for where in FAULT_SITES:
            metrics.faults.labels(scheduler, where)
        for tenant in tenants:
            label = self._tenant(tenant)
            for series in (metrics.tenant_admissions, metrics.tenant_deferral,
                           metrics.tenant_service):
                series.labels(scheduler, label)

    def pass_ended(self, *, asked: int, add: int, stop: int, forced: int,
                   admitted: Iterable[tuple[Hashable, float]], groups: int, waiting: int,
                   running: int) -> None:
        """One scheduling pass: its decisions, its admissions (each its tenant and how
        long it waited), the batch it left."""
        for decision, count in (("add", add), ("stop", stop), ("forced", forced)):
            if count:
                self._decisions[decision].inc(count)
        if asked:
            self._questions.inc(asked)
        metrics = self._metrics
        for tenant, seconds in admitted:
            seconds = max(0.0, seconds)
            self._deferral.observe(seconds)
            label = self._tenant(tenant)
            metrics.tenant_admissions.labels(self._scheduler, label).inc()
            metrics.tenant_deferral.labels(self._scheduler, label).observe(seconds)
        if groups:
            self._groups.observe(groups)
            if groups == 1:
                self._homogeneous.inc()
        self._waiting.set(waiting)
        self._running.set(running)

    def scheduled(self, seconds: float) -> None:
        self._schedule.observe(seconds)

    def preempted(self, priority: int, group_size: int | None, *,
                  urgent: bool = False) -> None:
        """One preemption: the victim's class, its group's running size, and whether it
        was for a waiting request of a more urgent class."""
        self._preemptions.labels(self._scheduler, str(priority)).inc()
        if urgent:
            self._metrics.urgent_preemptions.labels(self._scheduler, str(priority)).inc()
        if group_size is not None:
            self._preempted_group.observe(group_size)

    def served(self, tenant: Hashable, service: float) -> None:
        """The tenant received ``service`` (weighted tokens, before its weight)."""
        if service:
            self._metrics.tenant_service.labels(self._scheduler, self._tenant(tenant)) \
                .inc(service)

    def fault(self, where: str) -> None:
        """A fault of Feather's own code in ``where`` (``core.faults.FaultGuard``)."""
        self._faults.labels(self._scheduler, where).inc()

    def request_left(self, preemptions: int) -> None:
        """A request left the scheduler (finished, aborted, rejected), preempted so often."""
        self._request_preemptions.observe(preemptions)


class SessionSink:
    """One scheduler's session-retention series (``core.sessions.Sessions.publish``):
    sessions and blocks held now, and each of ``SESSION_EVENTS`` as a counter, present at
    zero from the start.  ``observe`` takes the cumulative counts and adds what they
    gained since its last call.  O(events) a call."""

    def __init__(self, scheduler: str) -> None:
        metrics = _registered()
        self._held = metrics.sessions_held.labels(scheduler)
        self._blocks = metrics.session_blocks_held.labels(scheduler)
        self._events = {event: metrics.session_events.labels(scheduler, event)
                        for event in SESSION_EVENTS}
        self._seen = dict.fromkeys(SESSION_EVENTS, 0)

    def observe(self, sessions: int, blocks: int, counts: Mapping[str, int]) -> None:
        self._held.set(sessions)
        self._blocks.set(blocks)
        for event, counter in self._events.items():
            gained = counts.get(event, 0) - self._seen[event]
            if gained > 0:
                counter.inc(gained)
                self._seen[event] += gained
