"""The vLLM engine's pure parts: KV-event re-hashing, preflight checks, AMX request.

None of this needs vLLM installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.worker.amx import request_amx_permission
from services.worker.engines.base import EngineConfigError, net_kv_delta
from services.worker.engines.kv_rehash import KvEventRehasher
from services.worker.engines.vllm_preflight import preflight, read_model_shape
from shared.kv.block_hash import chained_block_hashes
from shared.config import VllmSettings, load_config

BS = 4


def vllm_hash(tag: int) -> bytes:
    return tag.to_bytes(32, "big")  # stands in for vLLM's opaque sha256-derived hash


@given(st.lists(st.integers(0, 50_000), min_size=BS, max_size=12 * BS), st.integers(1, 5))
def test_split_stored_events_rehash_to_the_prompt_chain(tokens: list[int], first_event_blocks: int) -> None:
    full = len(tokens) // BS
    tokens = tokens[: full * BS]
    cut = min(first_event_blocks, full)
    rehasher = KvEventRehasher(BS)
    # One event for the first `cut` blocks, one continuing from its last block.
    rehasher.stored([vllm_hash(i) for i in range(cut)], None, tokens[: cut * BS], BS)
    if cut < full:
        rehasher.stored([vllm_hash(i) for i in range(cut, full)], vllm_hash(cut - 1), tokens[cut * BS :], BS)
    events, cleared = rehasher.drain()
    assert [h for _, h in events] == chained_block_hashes(tokens, BS)
    assert all(stored for stored, _ in events) and not cleared


def test_removed_maps_back_and_unknown_parents_are_skipped() -> None:
    tokens = list(range(3 * BS))
    expected = chained_block_hashes(tokens, BS)
    rehasher = KvEventRehasher(BS)
    rehasher.stored([b"a", b"b", b"c"], None, tokens, BS)
    rehasher.removed([b"c", b"unknown"])
    # A parent never seen (stored before we subscribed) cannot be continued.
    rehasher.stored([b"x"], b"never-seen", list(range(BS)), BS)
    events, _ = rehasher.drain()
    delta = net_kv_delta(events)
    assert delta.stored == expected[:2] and delta.removed == [expected[2]]
    assert rehasher.skipped_blocks == 1
    assert len(rehasher) == 2


def test_block_size_mismatch_is_skipped_and_clear_resets() -> None:
    rehasher = KvEventRehasher(BS)
    rehasher.stored([b"a"], None, list(range(2 * BS)), 2 * BS)
    rehasher.stored([b"b"], None, list(range(BS)), BS)
    rehasher.all_cleared()
    rehasher.stored([b"c"], None, list(range(BS, 2 * BS)), BS)
    events, cleared = rehasher.drain()
    assert cleared and events == [(True, chained_block_hashes(list(range(BS, 2 * BS)), BS)[0])]
    assert rehasher.skipped_blocks == 1
    assert rehasher.drain() == ([], False)


def write_model(directory: Path, **overrides: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 128,
              "head_dim": 64, "max_position_embeddings": 4096, "vocab_size": 1024, "torch_dtype": "float32"}
    (directory / "config.json").write_text(json.dumps({**config, **overrides}))
    return directory


def test_preflight_accepts_a_good_model_and_resolves_lengths(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m")
    resolved = preflight(VllmSettings(model=str(model), kv_cache_gib=0.5), on_cpu=True, env={})
    assert resolved.max_model_len == 4096 and resolved.block_size == 32
    assert read_model_shape(str(model)).kv_bytes_per_token("auto") == 2 * 2 * 1 * 64 * 4


@pytest.mark.parametrize(
    ("settings", "overrides", "on_cpu", "message"),
    [
        ({"model": ""}, {}, True, "worker.vllm.model is not set"),
        ({"model": "/nonexistent/model"}, {}, True, "does not exist"),
        ({}, {"head_dim": 16, "hidden_size": 32}, True, "head_dim 16"),
        ({"block_size": 16}, {}, True, "multiple of 32"),
        ({"max_model_len": 9000}, {}, True, "exceeds the model's max_position_embeddings"),
        ({"kv_cache_gib": 0.0001}, {}, False, "needs 128"),
    ],
)
def test_preflight_names_the_problem(tmp_path: Path, settings: dict, overrides: dict, on_cpu: bool, message: str) -> None:
    model = write_model(tmp_path / "m", **overrides)
    with pytest.raises(EngineConfigError, match=message):
        preflight(VllmSettings(**{"model": str(model), **settings}), on_cpu=on_cpu, env={})


def test_head_dim_16_is_fine_off_the_cpu(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", head_dim=16)
    assert preflight(VllmSettings(model=str(model)), on_cpu=False, env={}).shape.head_dim == 16


def test_missing_config_json(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineConfigError, match="no config.json"):
        preflight(VllmSettings(model=str(tmp_path / "empty")), on_cpu=True, env={})


def test_vllm_settings_from_environment() -> None:
    config = load_config(env={
        "KVLANE__WORKER__ENGINE": "vllm",
        "KVLANE__WORKER__VLLM__MODEL": "/models/x",
        "KVLANE__WORKER__VLLM__KV_CACHE_GIB": "1.5",
        "KVLANE__WORKER__VLLM__EXTRA_ENGINE_ARGS": '{"enforce_eager": true}',
    })
    assert config.worker.engine == "vllm"
    assert config.worker.vllm.model == "/models/x" and config.worker.vllm.kv_cache_gib == 1.5
    assert config.worker.vllm.extra_engine_args == {"enforce_eager": True}


def test_amx_request_is_harmless() -> None:
    assert request_amx_permission() in (True, False)
    assert request_amx_permission() in (True, False)  # asking twice is fine


def test_cpu_kv_cache_defaults_to_4_gib_or_the_legacy_variable(tmp_path: Path) -> None:
    model = str(write_model(tmp_path / "m"))
    assert preflight(VllmSettings(model=model), on_cpu=True, env={}).kv_cache_bytes == 4 << 30
    assert preflight(VllmSettings(model=model), on_cpu=True, env={"VLLM_CPU_KVCACHE_SPACE": "2"}).kv_cache_bytes == 2 << 30
    assert preflight(VllmSettings(model=model, kv_cache_gib=1), on_cpu=True, env={"VLLM_CPU_KVCACHE_SPACE": "2"}).kv_cache_bytes == 1 << 30
    assert preflight(VllmSettings(model=model), on_cpu=False, env={}).kv_cache_bytes is None


def test_parser_options_load_and_are_advertised_as_vllm_uses_them() -> None:
    from services.worker.main import advertised_tool_call_parser

    config = load_config(env={
        "KVLANE__WORKER__ENGINE": '"vllm"',
        "KVLANE__WORKER__VLLM__TOOL_CALL_PARSER": '"hermes"',
        "KVLANE__WORKER__VLLM__REASONING_PARSER": '"qwen3"',
        "KVLANE__WORKER__VLLM__ENABLE_AUTO_TOOL_CHOICE": "true",
    })
    vllm = config.worker.vllm
    assert (vllm.tool_call_parser, vllm.reasoning_parser, vllm.enable_auto_tool_choice) == ("hermes", "qwen3", True)
    assert advertised_tool_call_parser(config.worker) == "hermes"
    # Without auto tool choice vLLM never uses the tool-call parser; a sim worker parses nothing.
    without_auto = msgspec.structs.replace(config.worker, vllm=msgspec.structs.replace(vllm, enable_auto_tool_choice=False))
    assert advertised_tool_call_parser(without_auto) == ""
    assert advertised_tool_call_parser(msgspec.structs.replace(config.worker, engine="sim")) == config.worker.sim.tool_call_parser
