"""Tiny random LoRA adapters for the tiny test model, made locally in milliseconds.

Tests and demos of multi-LoRA serving need adapters that vLLM loads like any
PEFT adapter and whose greedy outputs visibly differ from the base model's
and from each other's; nothing may be downloaded to get them. This writes
one: `adapter_config.json` and `adapter_model.safetensors` in PEFT's layout,
with shapes read from the base model's `config.json`, and seeded random A
and B matrices. The same seed and base config write the same files, byte for
byte.

B is random, not zero as PEFT initialises it: a freshly initialised PEFT
adapter is a no-op, and an adapter that changes nothing proves nothing about
which adapter served a request.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from launch.tiny_model import staged_directory
from shared.adapter_store import CONFIG_FILE, WEIGHTS_FILE, BaseShape, projection_sizes

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# How far the adapter moves each weight, as a standard deviation of B @ A
# (times alpha / r, which is 1 here). The tiny model's own weights have
# initializer_range 0.2: a delta that size changes the first greedy tokens,
# while a much smaller one can leave a random model's argmax where it was.
DELTA_STD = 0.2


def module_shapes(base_config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection a LoRA may target, from a Llama-style config."""
    return projection_sizes(BaseShape.of_config(base_config))


def module_prefix(module: str) -> str:
    return "self_attn" if module in ATTENTION_MODULES else "mlp"


def adapter_tensors(base_config: dict, seed: int, rank: int, target_modules: Iterable[str]) -> dict:
    """PEFT's tensor names to float32 arrays: lora_A [r, in_features], lora_B [out_features, r]."""
    import numpy as np

    shapes = module_shapes(base_config)
    unknown = sorted(set(target_modules) - set(shapes))
    if unknown:
        raise ValueError(f"no such module in a Llama layer: {', '.join(unknown)} (known: {', '.join(shapes)})")
    # Each factor's std so that sum over r of A*B has std DELTA_STD.
    factor_std = (DELTA_STD / rank**0.5) ** 0.5
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(base_config["num_hidden_layers"]):
        for module in target_modules:
            in_features, out_features = shapes[module]
            stem = f"base_model.model.model.layers.{layer}.{module_prefix(module)}.{module}"
            # float32 whatever the base's dtype: vLLM casts adapters to the model's dtype when it loads them.
            tensors[f"{stem}.lora_A.weight"] = rng.normal(0.0, factor_std, (rank, in_features)).astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = rng.normal(0.0, factor_std, (out_features, rank)).astype(np.float32)
    return tensors


def adapter_config(base_directory: Path, rank: int, target_modules: Iterable[str]) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_directory),
        "r": rank,
        # alpha == r: PEFT scales B @ A by alpha / r, and a scale of 1 keeps DELTA_STD what it says.
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def make_tiny_adapter(
    directory: str | Path,
    base_directory: str | Path,
    seed: int,
    rank: int = 8,
    target_modules: Iterable[str] = ATTENTION_MODULES,
) -> Path:
    """Write a random LoRA adapter for the model in `base_directory` into `directory` (replacing what is there).

    Returns the adapter's absolute path. Written to a sibling temporary
    directory first and renamed, so a server loading it at the same moment
    never sees half an adapter.
    """
    from safetensors.numpy import save_file

    if rank < 1:
        raise ValueError(f"rank must be at least 1, not {rank}")
    target_modules = tuple(target_modules)
    base = Path(base_directory).expanduser().resolve()
    base_config = json.loads((base / "config.json").read_text())
    with staged_directory(directory) as (staging, target):
        save_file(adapter_tensors(base_config, seed, rank, target_modules), str(staging / WEIGHTS_FILE))
        config = adapter_config(base, rank, target_modules)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        # mkdtemp (and safetensors) create owner-only files; a server running
        # as another user, in a container say, must still read the adapter.
        for path in (staging, staging / CONFIG_FILE, staging / WEIGHTS_FILE):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return target
