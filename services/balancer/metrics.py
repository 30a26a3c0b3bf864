"""The balancer's Prometheus metrics, in its own registry (served by shared.metrics_http)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from services.balancer.allocation import UnleasedReason

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class BalancerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("kvlane_balancer_decisions_total", "Route requests by outcome", ["policy", "outcome"], registry=r)
        self.decision_seconds = LoopHistogram(
            "kvlane_balancer_decision_seconds", "Time the routing core takes per placement attempt", _LATENCY_BUCKETS, r
        )
        self.queue_length = Gauge("kvlane_balancer_queue_length", "Requests waiting in the central queue", registry=r)
        # Fair share (services/balancer/fair_share.py), per tenant with requests waiting (as many series as those).
        self.tenant_waiting = Gauge("kvlane_balancer_tenant_waiting", "Requests waiting in the central queue by tenant",
                                    ["tenant"], registry=r)
        self.tenant_service = Gauge("kvlane_balancer_tenant_service_tokens",
                                    "A waiting tenant's virtual service: its weighted tokens served, lifted when it was idle",
                                    ["tenant"], registry=r)
        self._tenants_shown: set[str] = set()
        # What KEDA activates a pool at zero on (k8s/components/keda): 0 -> 1 once any request waits here.
        self.held_from_zero = Gauge("kvlane_balancer_held_from_zero",
                                    "Requests waiting for a worker of a model whose pool is at zero", ["model"], registry=r)
        self.queue_wait = Histogram(
            "kvlane_balancer_queue_wait_seconds", "Time requests waited in the central queue", ["outcome"], buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.slots_used = Gauge("kvlane_balancer_slots_used", "Slots in use per chain (all replicas)", ["chain"], registry=r)
        self.slots_total = Gauge("kvlane_balancer_slots_total", "Slots per chain", ["chain"], registry=r)
        self.slot_conflicts = Counter(
            "kvlane_balancer_slot_conflicts_total", "Placements another replica's reservation beat", registry=r
        )
        self.expired_reservations = Counter(
            "kvlane_balancer_expired_reservations_total", "Reservations dropped at their deadline or when their node left", registry=r
        )
        self.fast_forwards = Counter("kvlane_balancer_fast_forwards_total", "Score policy fast-forwards to the cache node", registry=r)
        self.cache_holds = Counter("kvlane_balancer_cache_holds_total",
                                   "Requests kept queued for a busy node caching more of their prompt (each counted once)", registry=r)
        self.arrival_rate = Gauge("kvlane_balancer_arrival_rate", "Route requests per second (moving average)", registry=r)
        self.unleased_routes = Counter(
            "kvlane_balancer_unleased_routes_total",
            "Routes sent on without a KV lease because Redis or the cache-manager could not be reached, by reason",
            ["reason"], registry=r,
        )
        for reason in get_args(UnleasedReason):
            self.unleased_routes.labels(reason)  # every reason exported from the start, at 0

    def track_degradation(self, counts: Mapping[str, int]) -> None:
        """Export what the router's degradation did (read at each scrape): `kvlane_balancer_degraded_total{kind}`."""
        self.registry.register(_CountsCollector("kvlane_balancer_degraded", "Requests degraded under overload, by what was done",
                                                "kind", counts))

    def track_prefix_pulls(self, choices: Mapping[str, int], pulled_bytes: Mapping[str, int]) -> None:
        """Export the router's prefix pulls (read at each scrape): the choice made for each request some node could
        have pulled its prefix for, and the bytes pulled from each source."""
        self.registry.register(_CountsCollector(
            "kvlane_balancer_prefix_pull_choices",
            "Placed requests with a prefix pull on offer, by what was chosen (pull, recompute, run_on_source)", "choice", choices))
        self.registry.register(_CountsCollector(
            "kvlane_balancer_prefix_pull_bytes", "KV bytes of prefixes pulled, by the node they were pulled from", "source",
            pulled_bytes))

    def track_tenants(self, waiting: Mapping[str, int], counter: Callable[[str], float]) -> None:
        """The tenants with requests waiting now, and their virtual service; a tenant no longer waiting is dropped."""
        shown = {tenant or "-": tenant for tenant in waiting}  # the key-less tenant as "-", as the ingress labels it
        for label in self._tenants_shown - shown.keys():
            self.tenant_waiting.remove(label)
            self.tenant_service.remove(label)
        self._tenants_shown = set(shown)
        for label, tenant in shown.items():
            self.tenant_waiting.labels(label).set(waiting[tenant])
            self.tenant_service.labels(label).set(counter(tenant))


class _CountsCollector(Collector):
    def __init__(self, name: str, documentation: str, label: str, counts: Mapping[str, int]) -> None:
        self._name, self._documentation, self._label, self._counts = name, documentation, label, counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation, labels=[self._label])
        for value, count in sorted(self._counts.items()):
            family.add_metric([value], count)
        yield family


class LoopHistogram(Collector):
    """A histogram without labels, observed from the event loop's thread only.

    Observed on every placement attempt: `prometheus_client.Histogram.observe` walks the
    buckets in Python and takes two locks (about 1.4 µs on the development machine); this is
    one bisection and two additions (about 0.2 µs).
    A scrape from another thread may read the counts a moment apart from the sum, never a
    torn count. Exported as the same series (`_bucket{le}`, `_count`, `_sum`).
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = sorted(float(b) for b in buckets if b != float("inf"))
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        registry.register(self)

    def observe(self, amount: float) -> None:
        # The first bucket whose upper bound is at least `amount`, as prometheus_client counts it.
        self._counts[bisect.bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative = list(itertools.accumulate(self._counts))
        family = HistogramMetricFamily(self._name, self._documentation)
        family.add_metric([], [(floatToGoString(bound), count) for bound, count in zip(self._bounds, cumulative)]
                          + [("+Inf", cumulative[-1])], self._sum)
        yield family
