"""Prometheus metrics of the cache-manager, in its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class CacheMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.allocations = Counter("kvlane_cache_allocations", "Allocation requests by result", ["result"], registry=self.registry)
        self.preemptions = Counter("kvlane_cache_preemptions", "Running requests preempted to make room", registry=self.registry)
        self.prewarms = Counter("kvlane_cache_prewarms", "Hot prefixes pre-filled onto another node", registry=self.registry)
        self.expired_leases = Counter("kvlane_cache_expired_leases", "Leases reaped after their TTL", registry=self.registry)
        self.indexed_blocks = Gauge("kvlane_cache_indexed_blocks", "Distinct block hashes in the prefix index", registry=self.registry)
        self.preemption_count = 0
        self.prewarm_count = 0

    def preempted(self) -> None:
        self.preemptions.inc()
        self.preemption_count += 1

    def prewarmed(self) -> None:
        self.prewarms.inc()
        self.prewarm_count += 1
