"""Links that KV travels over from a prefill node to a decode node (pure).

A transfer of ``n`` bytes takes ``latency_s + n / bytes_per_s``. Bandwidths
are the nominal one-direction figures of ``REFERENCE-NUMBERS.md`` ("Links
for KV hand-off"); latencies are typical one-way setup costs of a
transfer over each (a NIXL/UCX read is one round trip plus the copy).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import msgspec

from contracts.messages import KvTransfer


class LinkProfile(msgspec.Struct, frozen=True):
    name: str
    bytes_per_s: float
    latency_s: float

    def transfer_seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s if num_bytes > 0 else 0.0


NAMED_LINKS: Mapping[str, LinkProfile] = MappingProxyType(
    {
        # Same host, GPU to GPU (H100: 900 GB/s both ways, 450 each).
        "nvlink": LinkProfile("nvlink", bytes_per_s=450e9, latency_s=5e-6),
        "pcie5": LinkProfile("pcie5", bytes_per_s=64e9, latency_s=10e-6),
        "pcie4": LinkProfile("pcie4", bytes_per_s=32e9, latency_s=10e-6),
        # Across hosts: InfiniBand / RoCE at 400 Gb/s, then Ethernet.
        "rdma-400g": LinkProfile("rdma-400g", bytes_per_s=50e9, latency_s=20e-6),
        "ethernet-100g": LinkProfile("ethernet-100g", bytes_per_s=12.5e9, latency_s=50e-6),
        "ethernet-25g": LinkProfile("ethernet-25g", bytes_per_s=3.125e9, latency_s=50e-6),
    }
)


def get_link(name: str) -> LinkProfile:
    try:
        return NAMED_LINKS[name]
    except KeyError:
        raise KeyError(f"unknown KV link {name!r}; known links: {', '.join(sorted(NAMED_LINKS))}") from None


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for one token."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def advertised_kv_transfer(kv_bytes_per_token: int, link: LinkProfile, speed: float = 1.0) -> KvTransfer | None:
    """What a node whose model keeps `kv_bytes_per_token` and whose KV travels over `link` tells balancers.

    A sim worker running `speed` times faster than the GPU it models moves
    its KV that much faster too. None when the model's KV size is unknown.
    """
    if kv_bytes_per_token <= 0 or speed <= 0:
        return None
    return KvTransfer(bytes_per_token=kv_bytes_per_token, link_bytes_per_s=link.bytes_per_s * speed,
                      link_latency_s=link.latency_s / speed)


def hand_off_seconds(tokens: int, source: KvTransfer | None, destination: KvTransfer | None) -> float:
    """Moving `tokens` of KV from `source` to `destination`, over the slower of the two nodes' links.

    A side that did not advertise its link does not slow the transfer; when
    neither did, the cost is unknown and counted as 0.
    """
    known = [side for side in (source, destination) if side is not None]
    if tokens <= 0 or not known:
        return 0.0
    bytes_per_token = (source or destination).bytes_per_token  # type: ignore[union-attr]
    bytes_per_s = min(side.link_bytes_per_s for side in known)
    latency_s = max(side.link_latency_s for side in known)
    return latency_s + tokens * bytes_per_token / bytes_per_s
