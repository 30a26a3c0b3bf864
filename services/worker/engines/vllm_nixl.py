"""How a prefill, decode or kv_share worker configures vLLM's NixlConnector (pure: no vllm import).

* A prefill node is a `kv_producer`: it runs prompts and holds their KV; a
  decode node is a `kv_consumer`: it pulls that KV (NIXL READ) and decodes.
  A consumer still prefills requests that come without a KV reference, which
  is how a decode node falls back when a pull fails.
* An aggregated worker with `kv_share` is both (`kv_both`): it holds a
  cached prefix's KV for another such worker, and pulls another's prefix
  and computes the rest of the prompt itself. vLLM pulls part of a prompt
  only in its bidirectional mode (`bidirectional_kv_xfer`), where a request
  marked `do_remote_decode` that names remote blocks loads those first; the
  whole-prompt pull of a decode node cannot stop short of the prompt's end.
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
import random
import socket
from collections.abc import Mapping

from shared.config import VllmSettings

CONNECTOR = "NixlConnector"
# vLLM's NixlConnector whose NIXL agents run no busy-polling progress thread.
CONNECTOR_MODULE = "services.worker.engines.vllm_nixl_connector"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
KV_SHARE_ROLE = "kv_both"
# Read by kvlane's connector: whether its NIXL agents keep NIXL's progress thread.
PROGRESS_THREAD = "kvlane_progress_thread"
RESERVED_CPUS = "VLLM_CPU_NUM_OF_RESERVED_CPU"
SMALL_HOST_CPUS = 2


def _kv_role(role: str, kv_share: bool) -> str | None:
    if role == "aggregated":
        return KV_SHARE_ROLE if kv_share else None
    return KV_ROLES.get(role)


def kv_transfer_config(role: str, hold_s: float, on_cpu: bool, kv_share: bool = False) -> dict | None:
    """vLLM's `kv_transfer_config` for a worker role; None for an aggregated worker without kv_share."""
    kv_role = _kv_role(role, kv_share)
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
    if kv_role == KV_SHARE_ROLE:
        config["kv_connector_extra_config"].update({
            # The partial pull: a request that names another engine's blocks
            # for its prompt's first tokens loads them and computes the rest.
            # Such a pull renews no lease: the source's blocks carry their
            # expiry instead, and a pull too close to it fails (vllm_nixl_connector.py).
            "bidirectional_kv_xfer": True,
            # kvlane's balancer already weighed pulling against computing; vLLM
            # would otherwise recompute prefixes under 64 tokens itself.
            "kv_recompute_threshold": 0,
        })
        if not on_cpu:
            config["kv_connector_extra_config"][PROGRESS_THREAD] = True
    if on_cpu or kv_role == KV_SHARE_ROLE:
        # On GPU hosts too for kv_share: kvlane's connector frees a pulling
        # request's blocks when it ends, where vLLM's holds them for a pull back.
        config["kv_connector_module_path"] = CONNECTOR_MODULE
    if on_cpu:
        # UCX threads: vLLM's 4 are sized for NIC-rich GPU hosts.
        config["kv_connector_extra_config"]["num_threads"] = 1
    return config


def nixl_installed() -> bool:
    return importlib.util.find_spec("nixl") is not None


# Side-channel ports are picked below Linux's default ephemeral range (32768-60999): vLLM binds the port
# seconds after it is picked, and a port the kernel hands out meanwhile (an outgoing connection's, or any
# bind to port 0) would take it; the engine's handshake listener then dies and its start never ends.
_SIDE_CHANNEL_PORTS = range(20000, 32768)


def _free_port(host: str) -> int:
    for port in random.sample(_SIDE_CHANNEL_PORTS, 64):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # that range is full: whatever the kernel gives
        sock.bind((host, 0))
        return sock.getsockname()[1]


def engine_env(settings: VllmSettings, role: str, on_cpu: bool, env: Mapping[str, str], cpu_count: int,
               kv_share: bool = False) -> dict[str, str]:
    """Variables the engine core of a prefill, decode or kv_share worker must start with."""
    if _kv_role(role, kv_share) is None:
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
