"""The autoscaler's decisions as Prometheus metrics (what KEDA or an HPA reads)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from contracts.autoscaler import ScalingDecision


class AutoscalerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.desired = Gauge("kvlane_autoscaler_desired_replicas", "Replicas the autoscaler wants per pool", ["pool"],
                             registry=self.registry)
        self.current = Gauge("kvlane_autoscaler_current_replicas", "Replicas serving per pool when it decided", ["pool"],
                             registry=self.registry)
        self.pressure = Gauge("kvlane_autoscaler_pressure", "Worst signal over its target per pool (1 = at target)",
                              ["pool", "window"], registry=self.registry)
        self.changes = Counter("kvlane_autoscaler_changes", "Changes of the desired replicas", ["pool", "direction"],
                               registry=self.registry)
        self._last: dict[str, int] = {}

    def record(self, decision: ScalingDecision) -> None:
        for pool in decision.pools:
            previous = self._last.get(pool.pool)
            if previous is not None and previous != pool.desired:
                self.changes.labels(pool.pool, "up" if pool.desired > previous else "down").inc()
            self._last[pool.pool] = pool.desired
            self.desired.labels(pool.pool).set(pool.desired)
            self.current.labels(pool.pool).set(pool.current)
            self.pressure.labels(pool.pool, "stable").set(pool.pressure)
            self.pressure.labels(pool.pool, "panic").set(pool.panic_pressure)
