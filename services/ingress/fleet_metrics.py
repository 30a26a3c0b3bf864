"""The fleet's per-node engine metrics, in vLLM's names, read from heartbeats when scraped.

Every ingress already holds each live worker's newest heartbeat (`ClusterView`),
so a scrape of any ingress shows the whole fleet: `FleetCollector` turns the
view into series at scrape time. Nothing runs between scrapes, and a worker's
series go away with it.

Heartbeat counters (prefix-cache tokens, preemptions, KV pulls) count from the
worker's start, so a restarted worker starts again from zero. If a scrape then
saw a value below the last one, Prometheus would assume a reset and count the
new value from zero, which is right; but if the new incarnation has already
passed the old value by the next scrape, no drop is visible and everything the
old incarnation did since the previous scrape is lost to `rate()`.
`MonotonicTotals` therefore recognises a new incarnation by its registration's
`started_at` and adds the old incarnation's last total to everything after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from msgspec import Struct
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from contracts.messages import EngineStats, Heartbeat
from shared.cluster import ClusterView

NODE_LABELS = ["model_name", "worker"]

# (metric, help, EngineStats field): counters that count since the worker started.
_COUNTERS = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up (per worker).", "prefix_query_tokens"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached (per worker).", "prefix_hit_tokens"),
    ("vllm:external_prefix_cache_hits", "Prefix cache hits from other nodes' caches, in prompt tokens pulled (per worker).",
     "prefix_external_hit_tokens"),
    ("vllm:num_preemptions", "Requests the engine preempted to make room (per worker).", "preemptions"),
    ("kvlane_worker_kv_pulls", "Prompt KV caches this node pulled from a prefill node.", "kv_pulls"),
    ("kvlane_worker_kv_pull_bytes", "Bytes of KV this node pulled from prefill nodes.", "kv_pull_bytes"),
    ("kvlane_worker_kv_pull_seconds", "Seconds this node spent moving pulled KV.", "kv_pull_seconds"),
    ("kvlane_worker_kv_pull_failures", "KV pulls that failed here (the node then prefilled itself).", "kv_pull_failures"),
)


class _Total(Struct):
    incarnation: float
    last: float
    offset: float
    seen_at: float


class MonotonicTotals:
    """Counters that survive their source's restarts (pure).

    `total()` is fed the raw value a source reports and the identity of the
    source's current run (`incarnation`); it returns the raw value plus the
    final values of the source's earlier runs. A raw value that falls within
    one run (it should not) is treated as a new run too, so the total never
    goes down. Sources unseen for `forget_after_s` are forgotten.
    """

    def __init__(self, forget_after_s: float = 3600.0) -> None:
        self._forget_after_s = forget_after_s
        self._totals: dict[tuple[str, str], _Total] = {}

    def total(self, key: tuple[str, str], incarnation: float, value: float, now: float) -> float:
        entry = self._totals.get(key)
        if entry is None:
            entry = self._totals[key] = _Total(incarnation, value, 0.0, now)
        elif incarnation != entry.incarnation or value < entry.last:
            entry.offset += entry.last
            entry.incarnation = incarnation
        entry.last = value
        entry.seen_at = now
        return entry.offset + value

    def forget_stale(self, now: float) -> None:
        for key in [key for key, entry in self._totals.items() if now - entry.seen_at > self._forget_after_s]:
            del self._totals[key]

    def __len__(self) -> int:
        return len(self._totals)


def kv_cache_usage(stats: EngineStats) -> float:
    """The fraction of the node's KV blocks in use, as vLLM's `kv_cache_usage_perc` (1 = full)."""
    if stats.kv_blocks_total <= 0:
        return 0.0
    return min(1.0, stats.kv_blocks_used / stats.kv_blocks_total)


class FleetCollector:
    """A Prometheus collector over a `ClusterView`: one series per live worker and metric."""

    def __init__(
        self, view: ClusterView, clock: Callable[[], float] = time.monotonic, totals: MonotonicTotals | None = None
    ) -> None:
        self._view = view
        self._clock = clock
        self._totals = totals or MonotonicTotals()

    def describe(self) -> Iterator[Metric]:
        # The families without samples: lets the registry check names without reading the view.
        gauges, counters = self._families()
        yield from gauges + counters

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        gauges, counters = self._families()
        for heartbeat in self._view.live(now):
            self._add_node(heartbeat, gauges, counters, now)
        self._totals.forget_stale(now)
        yield from gauges + counters

    def _families(self) -> tuple[list[Metric], list[Metric]]:
        gauges: list[Metric] = [
            GaugeMetricFamily("vllm:num_requests_running", "Requests in the engine's running batch (per worker).", labels=NODE_LABELS),
            GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting in the engine's own queue (per worker).", labels=NODE_LABELS),
            GaugeMetricFamily("kvlane_worker_requests_prefilling",
                              "Requests whose prompt is not fully prefilled yet, waiting ones included (per worker).", labels=NODE_LABELS),
            GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage per worker; 1 means 100 percent.", labels=NODE_LABELS),
            GaugeMetricFamily("kvlane_worker_kv_held_blocks", "KV blocks a prefill node holds for decode nodes to pull.", labels=NODE_LABELS),
            GaugeMetricFamily("kvlane_worker_prefill_tokens_per_second", "Prompt tokens computed per second (per worker).", labels=NODE_LABELS),
            GaugeMetricFamily("kvlane_worker_decode_tokens_per_second", "Tokens generated per second (per worker).", labels=NODE_LABELS),
            GaugeMetricFamily("kvlane_worker_draining", "1 while the worker drains (takes no new requests).", labels=NODE_LABELS),
            GaugeMetricFamily(
                "kvlane_worker_info", "Always 1: each live worker's role and engine.", labels=[*NODE_LABELS, "role", "engine"]
            ),
        ]
        counters: list[Metric] = [CounterMetricFamily(name, documentation, labels=NODE_LABELS) for name, documentation, _ in _COUNTERS]
        return gauges, counters

    def _add_node(self, heartbeat: Heartbeat, gauges: list[Metric], counters: list[Metric], now: float) -> None:
        registration, stats = heartbeat.registration, heartbeat.stats
        labels = [registration.model, registration.worker_id]
        running, waiting, prefilling, usage, held, prefill_rate, decode_rate, draining, info = gauges
        running.add_metric(labels, stats.running)
        waiting.add_metric(labels, stats.waiting)
        if stats.prefilling is not None:  # a worker from before the count has no series
            prefilling.add_metric(labels, stats.prefilling)
        usage.add_metric(labels, kv_cache_usage(stats))
        held.add_metric(labels, stats.kv_held_blocks)
        prefill_rate.add_metric(labels, stats.prefill_tokens_per_s)
        decode_rate.add_metric(labels, stats.decode_tokens_per_s)
        draining.add_metric(labels, 1.0 if heartbeat.draining else 0.0)
        info.add_metric([*labels, registration.role, registration.engine], 1.0)
        for family, (name, _, field) in zip(counters, _COUNTERS, strict=True):
            raw = float(getattr(stats, field))
            family.add_metric(labels, self._totals.total((registration.worker_id, name), registration.started_at, raw, now))
