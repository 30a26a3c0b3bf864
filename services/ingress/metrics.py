"""Client-side metrics of the ingress, in its own Prometheus registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvlane_ingress_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.in_flight = Gauge("kvlane_ingress_requests_in_flight", "Requests being served", registry=self.registry)
        self.ttft = Histogram(
            "kvlane_ingress_time_to_first_token_seconds", "Time from request receipt to first token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            "kvlane_ingress_inter_token_latency_seconds", "Time between consecutive tokens",
            buckets=_ITL_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "kvlane_ingress_e2e_request_latency_seconds", "Time from request receipt to last token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.prompt_tokens = Counter("kvlane_ingress_prompt_tokens", "Prompt tokens of served requests", registry=self.registry)
        self.cached_tokens = Counter(
            "kvlane_ingress_cached_prompt_tokens", "Prompt tokens served from a prefix cache", registry=self.registry
        )
        self.generation_tokens = Counter("kvlane_ingress_generation_tokens", "Generated tokens", registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
