"""One worker's own Prometheus metrics, in its own registry (served by shared.metrics_http).

The engine's numbers (running, waiting, KV usage, prefix cache, KV pulls) are
not here: every ingress exports them for the whole fleet from the heartbeats,
and exporting them twice would double every sum over all scrape targets.
What is here only the worker knows: how its requests ended, its hand-offs,
and how long a decode request waited for its pulled KV.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_KV_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.finished = Counter(
            "kvlane_worker_requests_finished", "Requests that ended on this node, by outcome (stop, length, abort, error).",
            ["outcome"], registry=r,
        )
        self.handoffs = Counter(
            "kvlane_worker_handoffs", "Prefill node: requests handed to a decode node, by outcome (handed_off, failed).",
            ["outcome"], registry=r,
        )
        self.kv_first_token = Histogram(
            "kvlane_worker_kv_pull_to_first_token_seconds",
            "Decode node: from asking the source for a prompt's KV to the first token computed on it.",
            buckets=_KV_WAIT_BUCKETS, registry=r,
        )
        self.in_flight = Gauge("kvlane_worker_requests_in_flight", "Requests this node is running or prefilling.", registry=r)
        # vLLM's LoRA gauge, under its name and labels, which the Gateway API Inference Extension's adapter
        # scorer reads: the series of the node's current adapters, valued at the time it was set (worker_id added).
        self.lora_info = Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters", "worker_id"], registry=r,
        )
        self._lora_labels: dict[str, tuple[str, ...]] = {}

    def count_in_flight(self, count: Callable[[], int]) -> None:
        """Read the in-flight count from `count` at each scrape."""
        self.in_flight.set_function(count)

    def adapters(self, worker_id: str, max_loras: int, in_slots: list[str]) -> None:
        """The node's adapters now: its series replaces the one it had (label sets would otherwise pile up).

        Those in batch slots go in `running_lora_adapters`, which the GIE's scorer reads as the adapters a server
        has active; `waiting_lora_adapters` stays empty, as engines report no adapter queue to the worker."""
        labels = (str(max_loras), ",".join(in_slots), "", worker_id)
        earlier = self._lora_labels.get(worker_id)
        if earlier is not None and earlier != labels:
            self.lora_info.remove(*earlier)
        self._lora_labels[worker_id] = labels
        self.lora_info.labels(*labels).set_to_current_time()
