"""How a prefill or decode worker configures vLLM's NixlConnector (pure: no vllm import).

* A prefill node is a `kv_producer`: it runs prompts and holds their KV; a
  decode node is a `kv_consumer`: it pulls that KV (NIXL READ) and decodes.
  A consumer still prefills requests that come without a KV reference, which
  is how a decode node falls back when a pull fails.
* Each engine serves its NIXL metadata on its own side channel (ZMQ, TCP);
  vLLM reads where from environment variables when its engine core starts.
* A failed pull fails the decode request (`kv_load_failure_policy="fail"`)
  instead of silently recomputing: kvlane then sees the failure, counts it,
  retries, and prefills locally itself.
* On the CPU build the connector is kvlane's (vllm_nixl_connector.py: the
  same, minus NIXL's busy-polling progress thread) with one UCX thread:
  measured here, the stock one kept a core busy per idle engine and halved
  what two engines on two cores could do. GPU hosts keep vLLM's defaults.
"""

from __future__ import annotations

import importlib.util
import math
import socket
from collections.abc import Mapping

from shared.config import VllmSettings

CONNECTOR = "NixlConnector"
# vLLM's NixlConnector whose NIXL agents run no busy-polling progress thread.
CONNECTOR_MODULE = "services.worker.engines.vllm_nixl_connector"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
RESERVED_CPUS = "VLLM_CPU_NUM_OF_RESERVED_CPU"
SMALL_HOST_CPUS = 2


def kv_transfer_config(role: str, hold_s: float, on_cpu: bool) -> dict | None:
    """vLLM's `kv_transfer_config` for a worker role; None for an aggregated worker."""
    kv_role = KV_ROLES.get(role)
    if kv_role is None:
        return None
    config: dict = {
        "kv_connector": CONNECTOR,
        "kv_role": kv_role,
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            # How long a producer keeps blocks nobody pulled (the decode node
            # died, or dropped the request) before freeing them; whole seconds
            # in vLLM. A consumer that waits to pull renews it by heartbeat.
            "kv_lease_duration": max(1, math.ceil(hold_s)),
        },
    }
    if on_cpu:
        config["kv_connector_module_path"] = CONNECTOR_MODULE
        # UCX threads: vLLM's 4 are sized for NIC-rich GPU hosts.
        config["kv_connector_extra_config"]["num_threads"] = 1
    return config


def nixl_installed() -> bool:
    return importlib.util.find_spec("nixl") is not None


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def engine_env(settings: VllmSettings, role: str, on_cpu: bool, env: Mapping[str, str], cpu_count: int) -> dict[str, str]:
    """Variables the engine core of a prefill or decode worker must start with."""
    if role not in KV_ROLES:
        return {}
    host = settings.nixl_side_channel_host
    port = settings.nixl_side_channel_port or _free_port(host)
    extra = {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}
    if on_cpu and RESERVED_CPUS not in env and cpu_count <= SMALL_HOST_CPUS:
        # With a connector vLLM's CPU backend reserves a core for NIXL on top
        # of the scheduler's: on a small host that leaves no core for the
        # model's OpenMP threads, which then pile onto one.
        extra[RESERVED_CPUS] = "1"
    return extra
