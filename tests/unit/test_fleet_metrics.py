"""vLLM-compatible metrics: the fleet collector over heartbeats, the ingress's request metrics,
and the worker's and health-prober's own registries."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from contracts.messages import EngineStats, Heartbeat, StreamEnd, Timings, Usage, WorkerRegistration
from services.health_prober.health import NodeHealth
from services.health_prober.metrics import HealthMetrics
from services.ingress.fleet_metrics import FleetCollector, MonotonicTotals, kv_cache_usage
from services.ingress.metrics import IngressMetrics
from services.worker.metrics import WorkerMetrics
from shared.cluster import ClusterView
from shared.config import HealthSettings

TTL = 3.0


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def heartbeat(worker_id: str, stats: EngineStats, *, model: str = "m", started_at: float = 1.0, sent_at: float = 100.0,
              role: str = "aggregated", draining: bool = False) -> Heartbeat:
    registration = WorkerRegistration(
        worker_id=worker_id, role=role, model=model, engine="sim", inbox=f"inbox.{worker_id}", block_size=16,
        max_model_len=4096, tokenizer="sim", started_at=started_at,
    )
    return Heartbeat(registration=registration, stats=stats, sent_at=sent_at, seq=1, draining=draining)


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape, parsed back from the text format Prometheus reads."""
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def node(worker: str, model: str = "m") -> tuple[tuple[str, str], ...]:
    return (("model_name", model), ("worker", worker))


def fleet(view: ClusterView, clock: Clock) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(FleetCollector(view, clock))
    return registry


# --- MonotonicTotals --------------------------------------------------------------


def test_totals_pass_values_through_within_one_run() -> None:
    totals = MonotonicTotals()
    assert [totals.total(("w", "c"), 1.0, v, 0.0) for v in (0, 5, 5, 9)] == [0, 5, 5, 9]


def test_a_restart_carries_the_old_runs_total_forward() -> None:
    totals = MonotonicTotals()
    assert totals.total(("w", "c"), 1.0, 100, 0.0) == 100
    # The new run has passed the old value by the next scrape: no drop to see, yet nothing is lost.
    assert totals.total(("w", "c"), 2.0, 150, 1.0) == 250
    assert totals.total(("w", "c"), 2.0, 160, 2.0) == 260


def test_a_value_that_falls_within_a_run_counts_as_a_reset() -> None:
    totals = MonotonicTotals()
    totals.total(("w", "c"), 1.0, 40, 0.0)
    assert totals.total(("w", "c"), 1.0, 3, 1.0) == 43


def test_sources_unseen_for_long_are_forgotten() -> None:
    totals = MonotonicTotals(forget_after_s=10.0)
    totals.total(("old", "c"), 1.0, 40, 0.0)
    totals.total(("new", "c"), 1.0, 1, 8.0)
    totals.forget_stale(15.0)
    assert len(totals) == 1
    assert totals.total(("old", "c"), 2.0, 5, 16.0) == 5


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1000)), max_size=40))
def test_totals_never_go_down(reports: list[tuple[int, int]]) -> None:
    totals = MonotonicTotals()
    previous = 0.0
    for step, (incarnation, value) in enumerate(reports):
        total = totals.total(("w", "c"), float(incarnation), float(value), float(step))
        assert total >= previous
        assert total >= value
        previous = total


# --- FleetCollector ----------------------------------------------------------------


def test_collector_exports_each_live_worker_in_vllm_names() -> None:
    clock, view = Clock(), ClusterView(TTL)
    view.observe(heartbeat("w0", EngineStats(running=3, waiting=2, prefilling=4, kv_blocks_total=200, kv_blocks_used=50,
                                             prefix_query_tokens=640, prefix_hit_tokens=320, preemptions=1)), 100.0)
    view.observe(heartbeat("p0", EngineStats(kv_held_blocks=7, kv_pulls=0), role="prefill", model="other"), 100.0)
    view.observe(heartbeat("d0", EngineStats(kv_pulls=4, kv_pull_bytes=4096, kv_pull_seconds=0.5, kv_pull_failures=1,
                                             prefix_external_hit_tokens=64),
                           role="decode", draining=True), 100.0)
    samples = scrape(fleet(view, clock))
    assert samples[("vllm:num_requests_running", node("w0"))] == 3
    assert samples[("vllm:num_requests_waiting", node("w0"))] == 2
    assert samples[("kvlane_worker_requests_prefilling", node("w0"))] == 4
    assert ("kvlane_worker_requests_prefilling", node("p0", "other")) not in samples  # not reported: no series
    assert samples[("vllm:kv_cache_usage_perc", node("w0"))] == 0.25
    assert samples[("vllm:prefix_cache_queries_total", node("w0"))] == 640
    assert samples[("vllm:prefix_cache_hits_total", node("w0"))] == 320
    assert samples[("vllm:num_preemptions_total", node("w0"))] == 1
    assert samples[("kvlane_worker_kv_held_blocks", node("p0", "other"))] == 7
    assert samples[("kvlane_worker_kv_pulls_total", node("d0"))] == 4
    assert samples[("vllm:external_prefix_cache_hits_total", node("d0"))] == 64
    assert samples[("kvlane_worker_kv_pull_bytes_total", node("d0"))] == 4096
    assert samples[("kvlane_worker_kv_pull_seconds_total", node("d0"))] == 0.5
    assert samples[("kvlane_worker_kv_pull_failures_total", node("d0"))] == 1
    assert samples[("kvlane_worker_draining", node("d0"))] == 1
    assert samples[("kvlane_worker_info", (("engine", "sim"), ("model_name", "other"), ("role", "prefill"), ("worker", "p0")))] == 1
    running = {labels for name, labels in samples if name == "vllm:num_requests_running"}
    assert running == {node("w0"), node("p0", "other"), node("d0")}


def test_collector_reads_the_view_at_each_scrape_and_drops_stale_workers() -> None:
    clock, view = Clock(), ClusterView(TTL)
    registry = fleet(view, clock)
    assert not [k for k in scrape(registry) if k[0] == "vllm:num_requests_running"]
    view.observe(heartbeat("w0", EngineStats(running=1)), 100.0)
    assert scrape(registry)[("vllm:num_requests_running", node("w0"))] == 1
    view.observe(heartbeat("w0", EngineStats(running=4), sent_at=101.0), 101.0)
    assert scrape(registry)[("vllm:num_requests_running", node("w0"))] == 4
    clock.now = 101.0 + TTL + 0.1
    assert ("vllm:num_requests_running", node("w0")) not in scrape(registry)


def test_collector_counters_survive_a_worker_restart() -> None:
    clock, view = Clock(), ClusterView(TTL)
    registry = fleet(view, clock)
    view.observe(heartbeat("w0", EngineStats(prefix_query_tokens=1000), started_at=1.0), 100.0)
    assert scrape(registry)[("vllm:prefix_cache_queries_total", node("w0"))] == 1000
    # Restarted under the same id: its own count starts again, the exported one goes on.
    view.observe(heartbeat("w0", EngineStats(prefix_query_tokens=1200), started_at=50.0, sent_at=101.0), 101.0)
    assert scrape(registry)[("vllm:prefix_cache_queries_total", node("w0"))] == 2200


def test_kv_usage_is_a_fraction_even_for_odd_reports() -> None:
    assert kv_cache_usage(EngineStats()) == 0.0
    assert kv_cache_usage(EngineStats(kv_blocks_total=4, kv_blocks_used=1)) == 0.25
    assert kv_cache_usage(EngineStats(kv_blocks_total=4, kv_blocks_used=9)) == 1.0


# --- IngressMetrics -----------------------------------------------------------------


def end(reason: str = "length", prompt: int = 10, completion: int = 4, cached: int = 2) -> StreamEnd:
    return StreamEnd("r1", 4, reason, Usage(prompt, completion, cached), Timings(), "w0")  # type: ignore[arg-type]


def test_ingress_request_metrics_have_vllm_names_and_labels() -> None:
    metrics = IngressMetrics()
    metrics.first_token("m", 0.03)
    for _ in range(3):
        metrics.inter_token("m", 0.002)
    metrics.finished("m", end("length"), 0.5)
    metrics.finished("m", end("stop", prompt=5, completion=1, cached=0), 0.1)
    metrics.queued("m", 0.0)
    metrics.queued("m", 2.0)
    metrics.migrated("m", "preempted")
    samples = scrape(metrics.registry)
    model = (("model_name", "m"),)
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 1
    assert samples[("vllm:time_to_first_token_seconds_bucket", (("le", "0.04"), *model))] == 1
    assert samples[("vllm:inter_token_latency_seconds_count", model)] == 3
    assert samples[("vllm:inter_token_latency_seconds_bucket", (("le", "0.0025"), *model))] == 3
    assert samples[("vllm:e2e_request_latency_seconds_count", model)] == 2
    assert math.isclose(samples[("vllm:e2e_request_latency_seconds_sum", model)], 0.6)
    assert samples[("vllm:request_queue_time_seconds_count", model)] == 2
    assert samples[("vllm:prompt_tokens_total", model)] == 15
    assert samples[("vllm:generation_tokens_total", model)] == 5
    assert samples[("vllm:prompt_tokens_cached_total", model)] == 2
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), *model))] == 1
    assert samples[("vllm:request_success_total", (("finished_reason", "stop"), *model))] == 1
    assert samples[("kvlane_ingress_migrations_total", (("cause", "preempted"), *model))] == 1


def test_ingress_exposition_carries_the_fleet_when_given_the_view() -> None:
    view = ClusterView(TTL)
    view.observe(heartbeat("w0", EngineStats(running=2)), 100.0)
    metrics = IngressMetrics(view, Clock())
    text = metrics.exposition().decode()
    assert 'vllm:num_requests_running{model_name="m",worker="w0"} 2.0' in text
    assert "kvlane_ingress_requests_in_flight" in text


# --- worker and health-prober registries -----------------------------------------------


def test_worker_metrics_read_in_flight_at_scrape() -> None:
    metrics = WorkerMetrics()
    running = {"a", "b"}
    metrics.count_in_flight(lambda: len(running))
    metrics.finished.labels("stop").inc()
    samples = scrape(metrics.registry)
    assert samples[("kvlane_worker_requests_in_flight", ())] == 2
    assert samples[("kvlane_worker_requests_finished_total", (("outcome", "stop"),))] == 1


def test_health_collector_reports_each_nodes_state_and_weight() -> None:
    settings = HealthSettings(bad_probes_to_suspect=1, suspect_weight=0.3)
    nodes = {"w0": NodeHealth("w0", settings, 0.0), "w1": NodeHealth("w1", settings, 0.0)}
    nodes["w0"].observe_probe(0.02, 1.0)
    nodes["w1"].observe_probe(None, 1.0)
    metrics = HealthMetrics()
    metrics.watch(lambda: nodes.values())
    samples = scrape(metrics.registry)
    assert samples[("kvlane_health_node_state", (("state", "healthy"), ("worker", "w0")))] == 1
    assert samples[("kvlane_health_node_state", (("state", "suspect"), ("worker", "w0")))] == 0
    assert samples[("kvlane_health_node_state", (("state", "suspect"), ("worker", "w1")))] == 1
    assert samples[("kvlane_health_node_weight", (("worker", "w1"),))] == 0.3
    assert samples[("kvlane_health_probe_latency_seconds", (("worker", "w0"),))] == 0.02
    del nodes["w1"]
    assert ("kvlane_health_node_weight", (("worker", "w1"),)) not in scrape(metrics.registry)


def test_a_resumed_streams_cause_names_what_broke_it() -> None:
    from services.ingress.dispatch import StreamInterrupted

    assert StreamInterrupted("x", None, preempted=True).cause == "preempted"
    assert StreamInterrupted("x", "timeout", "w0").cause == "timeout"
    assert StreamInterrupted("x", "error", "w0").cause == "error"
    assert StreamInterrupted("x", None).cause == "reconnect"
