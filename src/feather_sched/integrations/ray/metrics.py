"""Feather's metrics out of a Ray Serve replica, through Ray's own metrics export.

A replica's Feather scheduler runs in vLLM's engine-core process, a child of the replica
actor that Ray's metrics API cannot record from.  It writes its ``feather:`` metrics in
prometheus_client's multiprocess mode (``feather_sched.telemetry.prometheus``) to a directory of the
replica's own; ``MetricsRelay`` reads that directory every few seconds and records what
changed as Ray Serve metrics (``ray.serve.metrics``, tagged with the deployment, replica
and application), which every Ray node exports for Prometheus at its metrics export port
as ``ray_feather_...``, beside the replica's ``ray_vllm_...``.

Counters and gauges arrive exactly.  Histograms keep exact bucket counts (hence counts
and quantiles); their sums are approximate, since each new observation is replayed at
the middle of its bucket (or, past the last bound, at what the sum leaves for it).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.multiprocess import MultiProcessCollector

logger = logging.getLogger(__name__)
PREFIX = "feather:"
"""Only Feather's own metrics are relayed (vLLM's go through its Ray stat logger)."""
INTERVAL_S = 5.0
"""Between reads of the directory; Ray itself exports every 10 s by default."""

Key = tuple[str, tuple[tuple[str, str], ...]]
"""A sample's name and its labels, sorted."""


def ray_name(name: str) -> str:
    """The metric name Ray's OpenTelemetry export accepts (``:`` is not allowed)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


@dataclass
class Changes:
    """What changed since the last read, per metric: counter increases, gauge values and
    histogram observations to replay, each with its labels."""

    increases: list[tuple[str, dict[str, str], float]] = field(default_factory=list)
    values: list[tuple[str, dict[str, str], float]] = field(default_factory=list)
    observations: list[tuple[str, dict[str, str], list[float]]] = field(default_factory=list)
    bounds: dict[str, list[float]] = field(default_factory=dict)
    """Per histogram, its finite bucket bounds."""


class Differ:
    """Turns successive reads of cumulative Prometheus samples into ``Changes``.

    A cumulative value that fell (the engine process restarted) counts from zero again.
    Cost: O(samples) per read.
    """

    def __init__(self) -> None:
        self._last: dict[Key, float] = {}

    def changes(self, families: Iterable[Any]) -> Changes:
        """The changes in ``families`` (prometheus_client ``Metric``s) since the last call."""
        changes = Changes()
        for family in families:
            if not family.name.startswith(PREFIX):
                continue
            if family.type == "counter":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        increase = self._increase(sample.name, sample.labels, sample.value)
                        if increase > 0:
                            changes.increases.append((family.name, sample.labels, increase))
            elif family.type == "gauge":
                changes.values += [(family.name, s.labels, s.value) for s in family.samples]
            elif family.type == "histogram":
                changes.observations += self._observations(family)
                changes.bounds[family.name] = sorted(
                    {float(s.labels["le"]) for s in family.samples if "le" in s.labels}
                    - {math.inf})
        return changes

    def _increase(self, name: str, labels: dict[str, str], value: float) -> float:
        key = (name, tuple(sorted(labels.items())))
        last = self._last.get(key, 0.0)
        self._last[key] = value
        return value - last if value >= last else value

    def _observations(self, family: Any) -> list[tuple[str, dict[str, str], list[float]]]:
        """Per label set: the new observations, one value inside each one's bucket."""
        buckets: dict[tuple, list[tuple[float, float]]] = {}
        sums: dict[tuple, float] = {}
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            key = tuple(sorted(labels.items()))
            if sample.name.endswith("_bucket"):
                buckets.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                sums[key] = sample.value
        result = []
        for key, cumulative in buckets.items():
            cumulative.sort()
            new, below, lower = [], 0.0, 0.0
            for bound, count in cumulative:
                fresh = self._increase(f"{family.name}_bucket", {"le": str(bound), **dict(key)},
                                       count - below)
                below = count
                new.append((lower, bound, round(fresh)))
                lower = bound
            added = self._increase(f"{family.name}_sum", dict(key), sums.get(key, 0.0))
            values = _replayed(new, added)
            if values:
                result.append((family.name, dict(key), values))
        return result


def _replayed(buckets: list[tuple[float, float, int]], total: float) -> list[float]:
    """``count`` values inside each bucket (lower, upper], the first from 0 (Feather's
    histograms are of non-negative values): its middle; past the last finite bound, what
    ``total`` leaves for them (at least just past that bound)."""
    values: list[float] = []
    for lower, upper, count in buckets:
        if count <= 0:
            continue
        if math.isinf(upper):
            rest = (total - sum(values)) / count
            values += [max(rest, math.nextafter(lower, math.inf))] * count
        else:
            values += [(lower + upper) / 2] * count
    return values


class MetricsRelay:
    """Every ``interval_s`` (on a daemon thread), relays the changes in ``directory``'s
    multiprocess metrics to Ray Serve metrics; ``stop`` relays once more and ends it."""

    def __init__(self, directory: str, interval_s: float = INTERVAL_S) -> None:
        self.directory = directory
        self._collector = MultiProcessCollector(None, path=directory)
        self._differ = Differ()
        self._metrics: dict[str, Any] = {}
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feather-metrics-relay",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def relay(self) -> None:
        """Read the directory once and record what changed."""
        families = list(self._collector.collect())
        documentation = {family.name: family.documentation for family in families}
        changes = self._differ.changes(families)
        for name, labels, increase in changes.increases:
            self._metric("Counter", name, labels, documentation).inc(increase, tags=labels)
        for name, labels, value in changes.values:
            self._metric("Gauge", name, labels, documentation).set(value, tags=labels)
        for name, labels, values in changes.observations:
            histogram = self._metric("Histogram", name, labels, documentation,
                                     boundaries=changes.bounds[name])
            for value in values:
                histogram.observe(value, tags=labels)

    def _run(self) -> None:
        while True:
            stopping = self._stopped.wait(self._interval_s)
            try:
                self.relay()
            except Exception:  # metrics must never take the replica down
                logger.exception("feather: relaying metrics to Ray failed")
            if stopping:
                return

    def _metric(self, kind: str, name: str, labels: dict[str, str],
                documentation: dict[str, str], **options: Any) -> Any:
        """The Ray Serve metric relaying ``name``, made on first use."""
        if name not in self._metrics:
            from ray.serve import metrics

            self._metrics[name] = getattr(metrics, kind)(
                ray_name(name), description=documentation.get(name, ""),
                tag_keys=tuple(sorted(labels)), **options)
        return self._metrics[name]
