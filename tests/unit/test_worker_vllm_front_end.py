"""What the vLLM worker's front end costs per token: the benchmark's accounting, and vLLM's stat loggers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loadtest.vllm_vs_direct import cpu_ms_per_token


def test_cpu_per_token_counts_the_front_end_apart_from_the_engine_and_the_client() -> None:
    cpu_s = {"worker-w0": 0.5, "worker-w0/VLLM::EngineCore": 3.0, "ingress": 0.25, "nats-server": 0.25, "loadtest-client": 9.0}
    per_token = cpu_ms_per_token(cpu_s, completion_tokens=1000)
    assert per_token["worker-w0"] == pytest.approx(0.5)
    assert per_token["worker-w0/VLLM::EngineCore"] == pytest.approx(3.0)
    assert per_token["front_end"] == pytest.approx(1.0)  # worker, ingress and NATS only


def test_cpu_per_token_without_tokens_is_unknown_not_zero() -> None:
    assert cpu_ms_per_token({"ingress": 0.1}, completion_tokens=0) == {"ingress": None, "front_end": None}


@pytest.mark.vllm
def test_the_step_counters_take_the_place_of_vllms_prometheus_logger() -> None:
    vllm_engine = pytest.importorskip("services.worker.engines.vllm_engine")
    from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager

    counters = vllm_engine.StepCounters(clock=lambda: 0.0)
    manager = StatLoggerManager(SimpleNamespace(), custom_stat_loggers=[vllm_engine._stat_logger_factory(counters)],
                                enable_default_loggers=False)
    prometheus = [logger for logger in manager.stat_loggers if isinstance(logger, PrometheusStatLogger)]
    # One logger, ours: vLLM added none of its own (whose histograms nobody here reads).
    assert len(manager.stat_loggers) == 1 and len(prometheus) == 1
    scheduler = SimpleNamespace(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5, prefix_cache_stats=None,
                                kv_connector_stats=None)
    iteration = SimpleNamespace(prompt_token_stats=SimpleNamespace(computed=128), num_generation_tokens=2, num_preempted_reqs=0)
    manager.record(scheduler, iteration)
    assert (counters.running, counters.waiting, counters.kv_usage) == (2, 1, 0.5)
