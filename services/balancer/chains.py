"""Chains and their slots (pure).

A chain is what runs one request end to end: one aggregated worker, or a
(prefill, decode) pair. Its slots are how many requests of typical size it
may run at once; the balancer never gives a chain more.

`pair_chains` is the chain-building step of Greedy Cache Allocation (Sun,
He and Hou, arXiv 2604.14993): sort both sides by speed, pair the fastest
prefill node with the fastest decode node, give the chain the bottleneck's
slot count, subtract it from both, and repeat. A node with slots left over
joins the next chain, so a big decode node can serve several prefill nodes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from msgspec import Struct


class PoolNode(Struct, frozen=True):
    """One side's node as pairing sees it."""

    worker_id: str
    speed: float
    slots: int


class PairedChain(Struct, frozen=True):
    prefill_id: str
    decode_id: str
    slots: int


def pair_chains(prefill: Sequence[PoolNode], decode: Sequence[PoolNode]) -> list[PairedChain]:
    """Fastest-first (prefill, decode) chains with bottleneck slot counts.

    Ties in speed go by worker id so every balancer replica builds the same
    chains from the same heartbeats.
    """
    order = lambda n: (-n.speed, n.worker_id)  # noqa: E731
    prefill_left = [[n.worker_id, n.slots] for n in sorted(prefill, key=order) if n.slots > 0]
    decode_left = [[n.worker_id, n.slots] for n in sorted(decode, key=order) if n.slots > 0]
    chains: list[PairedChain] = []
    p = d = 0
    while p < len(prefill_left) and d < len(decode_left):
        slots = min(prefill_left[p][1], decode_left[d][1])
        chains.append(PairedChain(prefill_left[p][0], decode_left[d][0], slots))
        prefill_left[p][1] -= slots
        decode_left[d][1] -= slots
        if prefill_left[p][1] == 0:
            p += 1
        if decode_left[d][1] == 0:
            d += 1
    return chains


def kv_slots(kv_blocks_total: int, block_size: int, typical_request_tokens: int, cap: int = 0) -> int:
    """Requests of `typical_request_tokens` that `kv_blocks_total` blocks hold, capped by `cap` (0: none).

    A node that has not reported its KV size yet gets the cap, or one slot:
    enough to be used and measured, not enough to be flooded.
    """
    if kv_blocks_total <= 0:
        return cap if cap > 0 else 1
    blocks_per_request = math.ceil(typical_request_tokens / block_size)
    slots = max(1, kv_blocks_total // blocks_per_request)
    return min(slots, cap) if cap > 0 else slots
