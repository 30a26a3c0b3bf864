"""What `shared/adapter_store.py` accepts as a LoRA adapter, and what it refuses with a clear error:

* files: an unknown file, a missing config or weights file, a config that is not JSON or not LoRA, a rank
  that is not a positive integer, no target modules;
* weights: a truncated or garbled safetensors file, a tensor whose bytes do not match its shape, a tensor that is
  not a LoRA A or B weight, A and B of another rank, an A without its B;
* the object: not an adapter at all, another adapter's name, files that do not match their revision (corrupt);
* against the base model: a layer it does not have, a module it does not have, a width it does not have;
* names clients cannot use as a model.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from launch.tiny_adapter import make_tiny_adapter
from launch.tiny_model import MODEL_SHAPE
from shared.adapter_store import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    AdapterInfo,
    BaseShape,
    _info,
    check_adapter_files,
    check_adapter_name,
    check_against_base,
    pack_adapter,
    read_adapter_files,
    unpack_adapter,
)

BASE_CONFIG = {"model_type": "llama", "vocab_size": 1030, **MODEL_SHAPE}


@pytest.fixture
def adapter_files(tmp_path: Path) -> dict[str, bytes]:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(BASE_CONFIG))
    return read_adapter_files(make_tiny_adapter(tmp_path / "adapter", base, seed=1, rank=4))


def _weights(header: dict, body: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + body


def _one_pair(rank: int = 4, a_shape: list[int] | None = None, b_shape: list[int] | None = None) -> bytes:
    a_shape = a_shape or [rank, MODEL_SHAPE["hidden_size"]]
    b_shape = b_shape or [MODEL_SHAPE["hidden_size"], rank]
    a_bytes, b_bytes = 4 * a_shape[0] * a_shape[1], 4 * b_shape[0] * b_shape[1]
    stem = "base_model.model.model.layers.0.self_attn.o_proj"
    header = {f"{stem}.lora_A.weight": {"dtype": "F32", "shape": a_shape, "data_offsets": [0, a_bytes]},
              f"{stem}.lora_B.weight": {"dtype": "F32", "shape": b_shape, "data_offsets": [a_bytes, a_bytes + b_bytes]}}
    return _weights(header, bytes(a_bytes + b_bytes))


def _config(**fields: object) -> bytes:
    return json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["o_proj"], **fields}).encode()


def test_a_tiny_adapter_passes_every_check(adapter_files: dict[str, bytes]) -> None:
    facts = check_adapter_files(adapter_files)
    assert facts.rank == 4 and facts.target_modules == ("k_proj", "o_proj", "q_proj", "v_proj")
    assert 0 < facts.tensor_bytes < len(adapter_files[WEIGHTS_FILE])
    check_against_base(adapter_files, BaseShape.of_config(BASE_CONFIG))


def test_pack_and_unpack_round_trip_with_a_content_revision(adapter_files: dict[str, bytes]) -> None:
    name, data, facts = pack_adapter("support-bot", "tiny", adapter_files)
    assert name.startswith("adapters/support-bot/")
    bundle = unpack_adapter(name, data)
    assert (bundle.name, bundle.base, bundle.rank, bundle.files) == ("support-bot", "tiny", facts.rank, adapter_files)
    # The same files always get the same name: publishing twice stores one object.
    assert pack_adapter("support-bot", "tiny", adapter_files)[0] == name
    changed = dict(adapter_files, **{CONFIG_FILE: adapter_files[CONFIG_FILE] + b" "})
    assert pack_adapter("support-bot", "tiny", changed)[0] != name


@pytest.mark.parametrize(("files", "message"), [
    ({CONFIG_FILE: _config(), WEIGHTS_FILE: _one_pair(), "adapter_model.bin": b"pickle"}, "unexpected adapter files"),
    ({CONFIG_FILE: _config()}, "no adapter_model.safetensors"),
    ({WEIGHTS_FILE: _one_pair()}, "no adapter_config.json"),
    ({CONFIG_FILE: b"{not json", WEIGHTS_FILE: _one_pair()}, "is not JSON"),
    ({CONFIG_FILE: b"[1]", WEIGHTS_FILE: _one_pair()}, "not a JSON object"),
    ({CONFIG_FILE: _config(peft_type="PREFIX_TUNING"), WEIGHTS_FILE: _one_pair()}, "is not LORA"),
    ({CONFIG_FILE: _config(r=0), WEIGHTS_FILE: _one_pair()}, "must be a positive integer"),
    ({CONFIG_FILE: _config(r="4"), WEIGHTS_FILE: _one_pair()}, "must be a positive integer"),
    ({CONFIG_FILE: _config(target_modules=[]), WEIGHTS_FILE: _one_pair()}, "target_modules"),
    ({CONFIG_FILE: _config(), WEIGHTS_FILE: b"\x01\x02"}, "not a safetensors file"),
    ({CONFIG_FILE: _config(), WEIGHTS_FILE: struct.pack("<Q", 10_000) + b"{}"}, "truncated"),
    ({CONFIG_FILE: _config(), WEIGHTS_FILE: struct.pack("<Q", 3) + b"{{{"}, "unreadable header"),
    ({CONFIG_FILE: _config(), WEIGHTS_FILE: _one_pair()[:-4]}, "does not match its bytes"),
    ({CONFIG_FILE: _config(), WEIGHTS_FILE: _weights({}, b"")}, "holds no tensor"),
    ({CONFIG_FILE: _config(), WEIGHTS_FILE: _weights({"lm_head.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                                                     bytes(4))}, "not a LoRA A or B weight"),
    ({CONFIG_FILE: _config(r=8), WEIGHTS_FILE: _one_pair(rank=4)}, "not of rank 8"),
])
def test_bad_adapter_files_are_refused_with_the_reason(files: dict[str, bytes], message: str) -> None:
    with pytest.raises(AdapterError, match=message):
        check_adapter_files(files)


def test_an_a_without_its_b_is_refused() -> None:
    stem = "base_model.model.model.layers.0.self_attn.o_proj"
    weights = _weights({f"{stem}.lora_A.weight": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]}}, bytes(128))
    with pytest.raises(AdapterError, match="has no .*lora_B"):
        check_adapter_files({CONFIG_FILE: _config(), WEIGHTS_FILE: weights})


def test_an_object_that_is_not_what_its_name_says_is_refused(adapter_files: dict[str, bytes]) -> None:
    name, data, _ = pack_adapter("a", "tiny", adapter_files)
    with pytest.raises(AdapterError, match="not an adapter"):
        unpack_adapter(name, b"\x00garbage")
    with pytest.raises(AdapterError, match="holds adapters/a/"):
        unpack_adapter(name.replace("adapters/a/", "adapters/b/"), data)
    # A flipped byte in the weights: the files no longer hash to their revision.
    corrupt = bytearray(data)
    corrupt[data.index(adapter_files[WEIGHTS_FILE][-64:]) + 10] ^= 0xFF
    with pytest.raises(AdapterError, match="do not match their revision"):
        unpack_adapter(name, bytes(corrupt))
    # A changed rank beside intact files.
    rank_changed = bytearray(data)
    rank_changed[-1] ^= 0x01
    with pytest.raises(AdapterError, match="rank and size do not match"):
        unpack_adapter(name, bytes(rank_changed))


@pytest.mark.parametrize(("shape", "message"), [
    (dict(MODEL_SHAPE, num_hidden_layers=1), "has 1 layers"),
    (dict(MODEL_SHAPE, hidden_size=MODEL_SHAPE["hidden_size"] * 2, head_dim=MODEL_SHAPE.get("head_dim") or 16), "does not fit"),
])
def test_an_adapter_of_another_base_is_refused(adapter_files: dict[str, bytes], shape: dict, message: str) -> None:
    with pytest.raises(AdapterError, match=message):
        check_against_base(adapter_files, BaseShape.of_config(shape))


def test_a_module_the_base_does_not_have_is_refused() -> None:
    stem = "base_model.model.model.layers.0.self_attn.rotary_proj"
    weights = _weights({f"{stem}.lora_A.weight": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]},
                        f"{stem}.lora_B.weight": {"dtype": "F32", "shape": [2, 4], "data_offsets": [32, 64]}}, bytes(64))
    files = {CONFIG_FILE: _config(target_modules=["rotary_proj"]), WEIGHTS_FILE: weights}
    check_adapter_files(files)
    with pytest.raises(AdapterError, match="no rotary_proj to adapt"):
        check_against_base(files, BaseShape.of_config(BASE_CONFIG))


@pytest.mark.parametrize("name", ["", "-starts-with-dash", "has/slash", "has space", "x" * 129, "ünïcode"])
def test_names_a_client_could_not_ask_for_are_refused(name: str) -> None:
    with pytest.raises(AdapterError, match="not allowed"):
        check_adapter_name(name)


@pytest.mark.parametrize("name", ["a", "support-bot", "team.v2:ft_3", "A" * 128])
def test_plain_names_are_allowed(name: str) -> None:
    assert check_adapter_name(name) == name


class _Entry:
    def __init__(self, name: str, description: str | None, deleted: bool = False) -> None:
        self.name, self.description, self.deleted = name, description, deleted


def test_a_listing_keeps_only_live_adapters_kvlane_published() -> None:
    described = json.dumps({"base": "tiny", "rank": 4, "tensor_bytes": 100, "created": 7})
    assert _info(_Entry("adapters/a/rev1", described)) == AdapterInfo("a", "tiny", "rev1", 4, 100, 7)
    assert _info(_Entry("adapters/a/rev1", described, deleted=True)) is None
    assert _info(_Entry("tiny/rev", described)) is None  # a tokenizer's files
    assert _info(_Entry("adapters/a/rev1", "not json")) is None
    assert _info(_Entry("adapters/a/rev1", json.dumps({"base": "tiny"}))) is None
