"""The health-prober's Prometheus metrics, in its own registry (served by shared.metrics_http).

Counters and the probe histogram carry no worker label, so departed workers
leave no series behind; each node's current verdict is read from the prober's
`NodeHealth` table at scrape time (`NodeHealthCollector`) and goes with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from contracts.health import HealthState
from services.health_prober.health import NodeHealth

STATES: tuple[HealthState, ...] = ("healthy", "suspect", "unhealthy")
_PROBE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class NodeHealthCollector:
    """Each node's state (one series per state, 1 for the current one), routing weight and probe latencies."""

    def __init__(self, nodes: Callable[[], Iterable[NodeHealth]], clock: Callable[[], float] = time.time) -> None:
        self._nodes = nodes
        self._clock = clock

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        state, weight, latency, baseline = families = self._families()
        now = self._clock()
        for node in list(self._nodes()):
            verdict = node.verdict(now)
            for name in STATES:
                state.add_metric([node.worker_id, name], 1.0 if verdict.state == name else 0.0)
            weight.add_metric([node.worker_id], verdict.weight)
            if verdict.probe_latency_s is not None:
                latency.add_metric([node.worker_id], verdict.probe_latency_s)
            if verdict.baseline_latency_s is not None:
                baseline.add_metric([node.worker_id], verdict.baseline_latency_s)
        yield from families

    @staticmethod
    def _families() -> list[Metric]:
        return [
            GaugeMetricFamily("kvlane_health_node_state", "1 for the node's current health state, 0 for the others.",
                              labels=["worker", "state"]),
            GaugeMetricFamily("kvlane_health_node_weight", "The routing weight the verdict gives the node (1 healthy, 0 unhealthy).",
                              labels=["worker"]),
            GaugeMetricFamily("kvlane_health_probe_latency_seconds", "The node's last answered probe.", labels=["worker"]),
            GaugeMetricFamily("kvlane_health_probe_baseline_seconds", "The node's learnt probe latency while healthy.",
                              labels=["worker"]),
        ]


class HealthMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.probes = Counter("kvlane_health_probes", "Canary probes by result (ok, timeout, failed).", ["result"], registry=r)
        self.probe_seconds = Histogram(
            "kvlane_health_probe_seconds", "Time to a complete one-token answer, for answered probes.", buckets=_PROBE_BUCKETS,
            registry=r,
        )
        self.transitions = Counter("kvlane_health_transitions", "Nodes entering a health state.", ["state"], registry=r)
        self.feedback = Counter("kvlane_health_feedback", "Client feedback reports from ingress, by kind.", ["kind"], registry=r)

    def watch(self, nodes: Callable[[], Iterable[NodeHealth]]) -> None:
        """Export the verdicts of `nodes` (read at each scrape)."""
        self.registry.register(NodeHealthCollector(nodes))
