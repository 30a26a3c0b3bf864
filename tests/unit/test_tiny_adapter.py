"""`make_tiny_adapter` (launch/tiny_adapter.py): PEFT-format LoRA files whose names and shapes
match the base model's config, with non-zero B, the same bytes for the same seed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from launch.tiny_adapter import CONFIG_FILE, DELTA_STD, MLP_MODULES, WEIGHTS_FILE, make_tiny_adapter
from launch.tiny_model import MODEL_SHAPE

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture
def base_dir(tmp_path: Path) -> Path:
    """The tiny model's config.json alone: all the adapter maker reads, without building the model."""
    directory = tmp_path / "base"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1030, **MODEL_SHAPE}))
    return directory


def expected_shapes(config: dict, rank: int, modules: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    in_out = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, config["intermediate_size"]),
        "up_proj": (hidden, config["intermediate_size"]),
        "down_proj": (config["intermediate_size"], hidden),
    }
    shapes = {}
    for layer in range(config["num_hidden_layers"]):
        for module in modules:
            block = "self_attn" if module in ATTENTION else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_features, out_features = in_out[module]
            shapes[f"{stem}.lora_A.weight"] = (rank, in_features)
            shapes[f"{stem}.lora_B.weight"] = (out_features, rank)
    return shapes


def test_the_config_is_a_peft_lora_config_for_the_base(tmp_path: Path, base_dir: Path) -> None:
    adapter = make_tiny_adapter(tmp_path / "a1", base_dir, seed=1)
    assert adapter == (tmp_path / "a1").resolve()
    assert sorted(p.name for p in adapter.iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE])
    config = json.loads((adapter / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA"
    assert config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 8
    assert config["lora_alpha"] == 8
    assert config["target_modules"] == list(ATTENTION)
    assert config["bias"] == "none"
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    # Nothing of the staging directory is left beside the adapter.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a1", "base"]


@pytest.mark.parametrize(("rank", "modules"), [(8, ATTENTION), (4, ("q_proj", "v_proj")), (16, (*ATTENTION, *MLP_MODULES))])
def test_tensor_names_and_shapes_follow_the_base_config(tmp_path: Path, base_dir: Path, rank: int, modules: tuple[str, ...]) -> None:
    adapter = make_tiny_adapter(tmp_path / "adapter", base_dir, seed=3, rank=rank, target_modules=modules)
    tensors = load_file(str(adapter / WEIGHTS_FILE))
    config = json.loads((base_dir / "config.json").read_text())
    assert {name: tensor.shape for name, tensor in tensors.items()} == expected_shapes(config, rank, modules)
    assert all(tensor.dtype == np.float32 for tensor in tensors.values())
    assert json.loads((adapter / CONFIG_FILE).read_text())["r"] == rank


def test_head_dim_defaults_to_hidden_over_heads(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    config = {"hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3, "intermediate_size": 160}
    (base / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(make_tiny_adapter(tmp_path / "adapter", base, seed=0) / WEIGHTS_FILE))
    assert {name: tensor.shape for name, tensor in tensors.items()} == expected_shapes(config, 8, ATTENTION)
    assert tensors["base_model.model.model.layers.2.self_attn.k_proj.lora_B.weight"].shape == (48, 8)


def test_b_is_not_zero_and_the_update_is_as_large_as_the_base_weights(tmp_path: Path, base_dir: Path) -> None:
    tensors = load_file(str(make_tiny_adapter(tmp_path / "a1", base_dir, seed=1) / WEIGHTS_FILE))
    for name, tensor in tensors.items():
        assert np.count_nonzero(tensor) == tensor.size, name
    for name in (n for n in tensors if n.endswith("lora_B.weight")):
        delta = tensors[name] @ tensors[name.replace("lora_B", "lora_A")]
        assert DELTA_STD / 2 < delta.std() < DELTA_STD * 2, name


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, base_dir: Path) -> None:
    first = make_tiny_adapter(tmp_path / "first", base_dir, seed=1)
    again = make_tiny_adapter(tmp_path / "again", base_dir, seed=1)
    other = make_tiny_adapter(tmp_path / "other", base_dir, seed=2)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (first / name).read_bytes() == (again / name).read_bytes()
    assert (first / CONFIG_FILE).read_bytes() == (other / CONFIG_FILE).read_bytes()
    assert (first / WEIGHTS_FILE).read_bytes() != (other / WEIGHTS_FILE).read_bytes()
    mine, theirs = load_file(str(first / WEIGHTS_FILE)), load_file(str(other / WEIGHTS_FILE))
    assert mine.keys() == theirs.keys()
    assert all(not np.array_equal(mine[name], theirs[name]) for name in mine)


def test_rewriting_replaces_the_adapter(tmp_path: Path, base_dir: Path) -> None:
    target = tmp_path / "adapter"
    make_tiny_adapter(target, base_dir, seed=1)
    (target / "stale.txt").write_text("left from before")
    make_tiny_adapter(target, base_dir, seed=2, rank=4)
    assert not (target / "stale.txt").exists()
    assert json.loads((target / CONFIG_FILE).read_text())["r"] == 4


def test_unknown_modules_and_bad_ranks_are_refused_and_leave_nothing(tmp_path: Path, base_dir: Path) -> None:
    with pytest.raises(ValueError, match="no such module in a Llama layer: qkv_proj"):
        make_tiny_adapter(tmp_path / "adapter", base_dir, seed=1, target_modules=("q_proj", "qkv_proj"))
    with pytest.raises(ValueError, match="rank must be at least 1"):
        make_tiny_adapter(tmp_path / "adapter", base_dir, seed=1, rank=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]
