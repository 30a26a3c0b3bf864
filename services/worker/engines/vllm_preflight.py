"""Checks a vLLM worker's configuration before the engine starts (pure).

vLLM reports a bad model or a cache too small only after tens of seconds,
from a subprocess, buried in pages of log. These checks read the model's
`config.json` and the settings, and fail at once with one sentence that
names the problem and the setting to change.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.worker.engines.base import EngineConfigError
from shared.config import VllmSettings

# vLLM's CPU backend would otherwise reserve 92% of the machine's memory per
# engine, which fails as soon as two workers share a host; its legacy default was 4 GiB.
CPU_DEFAULT_KV_CACHE_GIB = 4
# From vLLM's CPU attention backend (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    directory: Path
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    vocab_size: int
    dtype: str

    def kv_bytes_per_token(self, dtype: str) -> int:
        element = _DTYPE_BYTES.get(self.dtype if dtype == "auto" else dtype, 2)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


@dataclass(frozen=True)
class ResolvedEngine:
    """What the worker advertises and what vLLM is told, agreed before it starts."""

    shape: ModelShape
    max_model_len: int
    block_size: int
    # None: vLLM sizes the cache itself (gpu_memory_utilization on a GPU).
    kv_cache_bytes: int | None


def read_model_shape(model: str) -> ModelShape:
    if not model:
        raise EngineConfigError("worker.vllm.model is not set: name a local model directory (config.json, weights, tokenizer)")
    directory = Path(model).expanduser()
    if not directory.is_dir():
        raise EngineConfigError(f"worker.vllm.model: model directory {directory} does not exist")
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise EngineConfigError(f"worker.vllm.model: {directory} has no config.json, so it is not a model directory") from None
    except (OSError, ValueError) as exc:
        raise EngineConfigError(f"worker.vllm.model: cannot read {config_path}: {exc}") from exc
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    try:
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return ModelShape(
            directory=directory.resolve(),
            num_layers=int(config["num_hidden_layers"]),
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
            vocab_size=int(config.get("vocab_size") or 0),
            dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineConfigError(f"worker.vllm.model: {config_path} lacks a usable {exc} entry") from exc


def kv_cache_bytes(settings: VllmSettings, on_cpu: bool, env: Mapping[str, str]) -> int | None:
    if settings.kv_cache_gib > 0:
        return int(settings.kv_cache_gib * GIB)
    if not on_cpu:
        return None
    legacy = env.get("VLLM_CPU_KVCACHE_SPACE", "")
    try:
        gib = int(legacy) if legacy else CPU_DEFAULT_KV_CACHE_GIB
    except ValueError:
        raise EngineConfigError(f"VLLM_CPU_KVCACHE_SPACE={legacy!r} is not a whole number of GiB") from None
    return (gib or CPU_DEFAULT_KV_CACHE_GIB) * GIB


def preflight(settings: VllmSettings, on_cpu: bool, env: Mapping[str, str]) -> ResolvedEngine:
    """Raise `EngineConfigError` if the engine can never serve a request with these settings."""
    shape = read_model_shape(settings.model)
    if on_cpu and shape.head_dim not in CPU_HEAD_SIZES:
        raise EngineConfigError(
            f"model {shape.directory} has head_dim {shape.head_dim}, which vLLM's CPU attention does not support "
            f"(supported: {', '.join(map(str, CPU_HEAD_SIZES))})"
        )
    if on_cpu and settings.block_size % 32:
        raise EngineConfigError(f"worker.vllm.block_size {settings.block_size} must be a multiple of 32 on the CPU backend")
    max_model_len = settings.max_model_len or shape.max_position_embeddings
    if max_model_len <= 0:
        raise EngineConfigError(f"worker.vllm.max_model_len is 0 and {shape.directory}/config.json gives no max_position_embeddings")
    if shape.max_position_embeddings and max_model_len > shape.max_position_embeddings:
        raise EngineConfigError(
            f"worker.vllm.max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{shape.max_position_embeddings}"
        )
    cache_bytes = kv_cache_bytes(settings, on_cpu, env)
    if cache_bytes is not None:
        per_token = shape.kv_bytes_per_token(settings.dtype)
        blocks = cache_bytes // (per_token * settings.block_size)
        needed = math.ceil(max_model_len / settings.block_size)
        if blocks < needed:
            raise EngineConfigError(
                f"worker.vllm.kv_cache_gib {cache_bytes / GIB:g} holds {blocks} blocks of {settings.block_size} tokens "
                f"({per_token} bytes per token), but one request of max_model_len {max_model_len} needs {needed}: "
                f"raise kv_cache_gib to at least {needed * settings.block_size * per_token / GIB:.3g} or lower max_model_len"
            )
    return ResolvedEngine(shape=shape, max_model_len=max_model_len, block_size=settings.block_size, kv_cache_bytes=cache_bytes)


def check_kv_transfer(role: str, nixl_installed: bool) -> None:
    """A prefill or decode worker moves KV with NIXL: fail at once when it is missing, not at the first pull."""
    if role in ("prefill", "decode") and not nixl_installed:
        raise EngineConfigError(
            f"worker.role is {role!r}, which moves KV between workers with NIXL, but the nixl package is not installed: "
            "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
        )
