"""The ingress's Prometheus metrics, in its own registry, served on its HTTP port at `/metrics`.

Request metrics carry vLLM's names and labels (`vllm:time_to_first_token_seconds`
and so on, labelled `model_name`), measured where the client sees them: from
the moment ingress received the request. Per-node engine metrics come from the
workers' heartbeats (`FleetCollector`), so a dashboard built for vLLM works on
a kvlane fleet by scraping its ingresses.

With several ingress processes on one port (`ingress.processes`), a scrape
reaches any one of them: each then writes its request metrics to files in
PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode, chosen when
that variable is set) and serves the sum over all processes, alive or gone.
A metrics port of each process's own would leave /metrics on the shared
port answering for one random process. The fleet's per-node metrics, which
every process reads from the same heartbeats, come from the process scraped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.metrics import MetricWrapperBase

from contracts.messages import StreamEnd
from services.ingress.fleet_metrics import FleetCollector
from shared.cluster import ClusterView

# vLLM's bucket boundaries (vllm/v1/metrics/buckets.py), each with finer ones
# below its smallest: kvlane's sim and CPU engines answer well under vLLM's
# first bucket, where its histograms could tell nothing apart. Every vLLM
# boundary is kept, so quantiles compare with a vLLM server's.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)

MODEL = ["model_name"]


# Tenants labelled one by one in the per-tenant metrics; the rest count as "other".
_TENANT_LABELS_MAX = 256


class IngressMetrics:
    def __init__(self, view: ClusterView | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`view`: the live workers, whose heartbeats become the per-node metrics (none without it)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self._labelled: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        self.requests = Counter("kvlane_ingress_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        # Summed over the live processes (multiprocess mode; a plain gauge otherwise).
        self.in_flight = Gauge("kvlane_ingress_requests_in_flight", "Requests being served", registry=r,
                               multiprocess_mode="livesum")
        # Completions (HTTP and NATS) by the tenant of their API key ("-": none, auth off or no valid key) and outcome.
        self._tenant_labels: set[str] = set()
        self._tenant_requests = Counter(
            "kvlane_ingress_tenant_requests", "Completion requests by API-key tenant and status", ["tenant", "status"], registry=r,
        )
        self._tenant_tokens = Counter(
            "kvlane_ingress_tenant_tokens", "Tokens of finished completions by API-key tenant and kind (prompt, completion)",
            ["tenant", "kind"], registry=r,
        )
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time from the request's arrival at ingress to its first token.",
            MODEL, buckets=TTFT_BUCKETS, registry=r,
        )
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive token chunks of a request, seen at ingress.",
            MODEL, buckets=ITL_BUCKETS, registry=r,
        )
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Time from the request's arrival at ingress to its final frame.",
            MODEL, buckets=REQUEST_LATENCY_BUCKETS, registry=r,
        )
        self._queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time a route request waited in the balancer's central queue before a node took it (one per route).",
            MODEL, buckets=REQUEST_LATENCY_BUCKETS, registry=r,
        )
        self._prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", MODEL, registry=r)
        self._cached_tokens = Counter(
            "vllm:prompt_tokens_cached", "Prompt tokens of finished requests served from a prefix cache.", MODEL, registry=r
        )
        self._generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated for finished requests (including those before a migration).", MODEL,
            registry=r,
        )
        self._success = Counter(
            "vllm:request_success", "Requests that ended with a final frame, by finish reason.", [*MODEL, "finished_reason"],
            registry=r,
        )
        self._migrations = Counter(
            "kvlane_ingress_migrations",
            "Broken-off streams resumed on a node, by cause (preempted, handed_back, error, timeout, reconnect).", [*MODEL, "cause"],
            registry=r,
        )
        # The balancer replicas this ingress sends route requests to (`RouteAsker`); in multiprocess mode the
        # fewest any live process hears, so that one process deaf to a replica still shows.
        self._balancer_replicas = Gauge(
            "kvlane_ingress_balancer_replicas", "Balancer replicas heard from within the heartbeat TTL", registry=r,
            multiprocess_mode="livemin",
        )
        self._balancer_silences = Counter(
            "kvlane_ingress_balancer_silences", "Balancer replicas found silent for the heartbeat TTL", registry=r,
        )
        self._routes_given_up = Counter(
            "kvlane_ingress_routes_given_up",
            "Route requests given up because the balancer replica holding them fell silent (each is asked again once)",
            registry=r,
        )
        self._balancer_waits = Counter(
            "kvlane_ingress_balancer_waits",
            "Route requests held because no balancer took them (none running, or every replica silent), then asked again",
            registry=r,
        )
        # What a scrape serves: these metrics, or in multiprocess mode those of every process.
        self._exposed = r
        if shared_dir := os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self._exposed = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._exposed, shared_dir)
        if view is not None:
            fleet = FleetCollector(view, clock)
            r.register(fleet)
            if self._exposed is not r:
                self._exposed.register(fleet)

    def _series(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: a handful of lookups per request cost less than as many `labels` calls."""
        key = (metric, labels)
        series = self._labelled.get(key)
        if series is None:
            series = self._labelled[key] = metric.labels(*labels)
        return series

    # Called by the HTTP app, the completion path (services/ingress/completions.py) and the dispatcher.

    def http_request(self, endpoint: str, status: int) -> None:
        self._series(self.requests, endpoint, str(status)).inc()

    def first_token(self, model: str, seconds: float) -> None:
        self._series(self._ttft, model).observe(seconds)

    def inter_token(self, model: str, seconds: float) -> None:
        self._series(self._itl, model).observe(seconds)

    def finished(self, model: str, end: StreamEnd, e2e_seconds: float) -> None:
        usage = end.usage
        self._series(self._e2e, model).observe(e2e_seconds)
        self._series(self._prompt_tokens, model).inc(usage.prompt_tokens)
        self._series(self._cached_tokens, model).inc(usage.cached_tokens)
        self._series(self._generation_tokens, model).inc(usage.completion_tokens)
        self._series(self._success, model, end.finish_reason).inc()

    def queued(self, model: str, seconds: float) -> None:
        self._series(self._queue_time, model).observe(seconds)

    def migrated(self, model: str, cause: str) -> None:
        self._series(self._migrations, model, cause).inc()

    def balancer_replicas(self, live: int) -> None:
        self._balancer_replicas.set(live)

    def balancer_silent(self, routes_given_up: int) -> None:
        self._balancer_silences.inc()
        self._routes_given_up.inc(routes_given_up)

    def balancer_waited(self) -> None:
        self._balancer_waits.inc()

    def tenant_request(self, tenant: str, status: int, end: StreamEnd | None = None) -> None:
        """A completion request ended with `status` (its HTTP status; 499: the caller left); `end`: its usage, if it finished."""
        label = tenant or "-"
        if label not in self._tenant_labels:
            # Without keys a client names its tenant in a header: so many names cannot each become series.
            if len(self._tenant_labels) >= _TENANT_LABELS_MAX:
                label = "other"
            self._tenant_labels.add(label)
        self._series(self._tenant_requests, label, str(status)).inc()
        if end is not None:
            self._series(self._tenant_tokens, label, "prompt").inc(end.usage.prompt_tokens)
            self._series(self._tenant_tokens, label, "completion").inc(end.usage.completion_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self._exposed)
