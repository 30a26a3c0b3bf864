"""The vLLM engine's mappings, without starting an engine: sampling parameters and step stats."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from contracts.messages import SamplingParams

pytestmark = pytest.mark.vllm

vllm_engine = pytest.importorskip("services.worker.engines.vllm_engine")


def test_sampling_parameters_map_one_to_one() -> None:
    params = vllm_engine.to_vllm_sampling(SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3, stop=["\n\n"], presence_penalty=0.25, frequency_penalty=-0.5,
    ))
    assert (params.n, params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (1, 7, 0.5, 0.9, 40, 3)
    assert params.stop == ["\n\n"] and params.presence_penalty == 0.25 and params.frequency_penalty == -0.5
    assert params.output_kind == vllm_engine.RequestOutputKind.DELTA


def test_top_k_minus_one_disables_top_k() -> None:
    assert vllm_engine.to_vllm_sampling(SamplingParams(max_tokens=1, top_k=-1)).top_k == 0


def test_step_counters_accumulate_increments_and_measure_rates() -> None:
    now = [0.0]
    counters = vllm_engine.StepCounters(clock=lambda: now[0])
    scheduler = SimpleNamespace(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25,
                                prefix_cache_stats=SimpleNamespace(queries=64, hits=32), kv_connector_stats=None,
                                running_lora_adapters={"a": 2})
    iteration = SimpleNamespace(prompt_token_stats=SimpleNamespace(computed=100), num_generation_tokens=10, num_preempted_reqs=1)
    counters.on_step(scheduler, iteration)
    counters.on_step(scheduler, iteration)
    now[0] = 2.0
    assert counters.take_rates() == (100.0, 10.0)
    assert (counters.running, counters.waiting, counters.prefix_queries, counters.prefix_hits, counters.preemptions) == (3, 1, 128, 64, 2)
    assert counters.adapters_running == ["a"]
    now[0] = 3.0
    assert counters.take_rates() == (0.0, 0.0)


def test_step_counters_sum_the_nixl_transfers_each_step_reports() -> None:
    counters = vllm_engine.StepCounters(clock=lambda: 0.0)

    def step(transfers):
        return SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.0, prefix_cache_stats=None,
                               kv_connector_stats=transfers, running_lora_adapters={})

    # NixlKVConnectorStats.data: one list entry per finished transfer since the previous report.
    counters.on_step(step({"transfer_duration": [0.02, 0.001], "bytes_transferred": [98304, 229376],
                           "num_failed_transfers": []}), None)
    counters.on_step(step(None), None)
    counters.on_step(step({"transfer_duration": [], "bytes_transferred": [], "num_failed_handshakes": [1]}), None)
    assert (counters.kv_pulls, counters.kv_pull_bytes) == (2, 327_680)
    assert abs(counters.kv_pull_seconds - 0.021) < 1e-9
