"""The autoscaler's decisions as Prometheus metrics (what KEDA or an HPA reads).

One series per pool: its base model as `model_name` (the label vLLM's own metrics name it by) and its role as `pool`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from contracts.autoscaler import PoolKey, ScalingDecision


class AutoscalerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        pool = ["model_name", "pool"]
        self.desired = Gauge("kvlane_autoscaler_desired_replicas", "Replicas the autoscaler wants per pool", pool,
                             registry=self.registry)
        self.current = Gauge("kvlane_autoscaler_current_replicas", "Replicas serving per pool when it decided", pool,
                             registry=self.registry)
        self.pressure = Gauge("kvlane_autoscaler_pressure", "Worst signal over its target per pool (1 = at target)",
                              [*pool, "window"], registry=self.registry)
        self.changes = Counter("kvlane_autoscaler_changes", "Changes of the desired replicas", [*pool, "direction"],
                               registry=self.registry)
        self._last: dict[PoolKey, int] = {}

    def record(self, decision: ScalingDecision) -> None:
        for pool in decision.pools:
            labels = (pool.model, pool.pool)
            previous = self._last.get(pool.key)
            if previous is not None and previous != pool.desired:
                self.changes.labels(*labels, "up" if pool.desired > previous else "down").inc()
            self._last[pool.key] = pool.desired
            self.desired.labels(*labels).set(pool.desired)
            self.current.labels(*labels).set(pool.current)
            self.pressure.labels(*labels, "stable").set(pool.pressure)
            self.pressure.labels(*labels, "panic").set(pool.panic_pressure)
