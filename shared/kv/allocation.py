"""Greedy KV-cache allocation and victim choice (pure core, no I/O).

A request r needs `need(r,n) = ceil((p + o_reserve) / B) - h(r,n)` new
blocks on node n, where h counts prompt blocks n already caches. Among the
nodes with room the greedy choice maximises

    utility(r,n) = w / (need(r,n) * (1 + load(n)) * len_penalty(p))

so a cached prefix (smaller need) and an idle node both attract the
request. `len_penalty` grows with the prompt, so that under pressure the
requests that free memory fast rank first. Each node keeps a share of its
blocks (the short pool) that only short requests may use, so a burst of
long contexts cannot starve them. Paged blocks need no contiguity: capacity
is a count, never a layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal
from msgspec import Struct

from contracts.cache import Pool
from shared.config import CacheManagerSettings


class NodeCapacity(Struct, frozen=True):
    worker_id: str
    blocks_total: int
    block_size: int
    used_general: int = 0
    used_short: int = 0

    def short_pool(self, policy: CacheManagerSettings) -> int:
        return int(self.blocks_total * policy.short_pool_share)

    def free(self, policy: CacheManagerSettings) -> tuple[int, int]:
        """(free general blocks, free short-pool blocks)."""
        short = self.short_pool(policy)
        return self.blocks_total - short - self.used_general, short - self.used_short

    @property
    def load(self) -> float:
        return (self.used_general + self.used_short) / self.blocks_total if self.blocks_total else 1.0


class Demand(Struct, frozen=True):
    request_id: str
    prompt_tokens: int
    max_tokens: int
    priority: float = 1.0


class Plan(Struct, frozen=True):
    worker_id: str
    blocks: int
    cached_blocks: int
    pool: Pool
    utility: float


def output_reserve(demand: Demand, policy: CacheManagerSettings) -> int:
    return min(demand.max_tokens, policy.output_reserve_cap)


def need_blocks(demand: Demand, block_size: int, cached_blocks: int, policy: CacheManagerSettings) -> int:
    total = math.ceil((demand.prompt_tokens + output_reserve(demand, policy)) / block_size)
    # A cached prefix never covers the output, so at least one block is new.
    return max(1, total - cached_blocks)


def is_short(demand: Demand, policy: CacheManagerSettings) -> bool:
    return demand.prompt_tokens + output_reserve(demand, policy) <= policy.short_request_tokens


def pool_for(node: NodeCapacity, blocks: int, short: bool, policy: CacheManagerSettings) -> Pool | None:
    """Where `blocks` fit on `node`: short requests try their pool first."""
    free_general, free_short = node.free(policy)
    if short and blocks <= free_short:
        return "short"
    if blocks <= free_general:
        return "general"
    return None


class NodeAsk(Struct, frozen=True):
    """What to ask the ledger for on one given node: it checks room and picks the pool itself."""

    blocks: int
    cached_blocks: int
    pool: Literal["general", "short_first"]
    general_capacity: int
    short_capacity: int


def ask_on_node(demand: Demand, blocks_total: int, block_size: int, cached_blocks: int, policy: CacheManagerSettings) -> NodeAsk:
    """The reservation for `demand` on one node chosen already (nothing to rank), as `rank` would plan it there."""
    node = NodeCapacity("", blocks_total, block_size)
    cached_blocks = min(cached_blocks, demand.prompt_tokens // block_size)
    short = node.short_pool(policy)
    return NodeAsk(
        blocks=need_blocks(demand, block_size, cached_blocks, policy),
        cached_blocks=cached_blocks,
        # The ledger's "short_first" is `pool_for`'s order: the short pool if it fits there, else the general one.
        pool="short_first" if is_short(demand, policy) else "general",
        general_capacity=blocks_total - short,
        short_capacity=short,
    )


def length_penalty(prompt_tokens: int, policy: CacheManagerSettings) -> float:
    return 1.0 + (prompt_tokens / policy.length_penalty_tokens) ** policy.length_penalty_power


def rank(
    demand: Demand,
    nodes: Sequence[NodeCapacity],
    cached: Mapping[str, int],
    policy: CacheManagerSettings,
) -> list[Plan]:
    """Every node with room for `demand`, best utility first (ties by node id)."""
    short = is_short(demand, policy)
    penalty = length_penalty(demand.prompt_tokens, policy)
    plans = []
    for node in nodes:
        cached_blocks = min(cached.get(node.worker_id, 0), demand.prompt_tokens // node.block_size)
        blocks = need_blocks(demand, node.block_size, cached_blocks, policy)
        pool = pool_for(node, blocks, short, policy)
        if pool is None:
            continue
        utility = demand.priority / (blocks * (1.0 + node.load) * penalty)
        plans.append(Plan(node.worker_id, blocks, cached_blocks, pool, utility))
    plans.sort(key=lambda p: (-p.utility, p.worker_id))
    return plans


class RunningLease(Struct, frozen=True):
    request_id: str
    worker_id: str
    blocks: int
    pool: Pool
    priority: float
    max_tokens: int
    generated: int
    granted_at: float


def retention_value(lease: RunningLease, needed_blocks: int) -> float:
    """What keeping `lease` is worth (the design's formula): its priority,
    scaled by the share of its output still to come (at least 0.1), less its
    blocks as a share of those needed. So a high priority with much still to
    generate keeps a lease, and a lease nearly done or holding many blocks
    (that would make room) is a better victim."""
    progress = max(0.1, 1.0 - lease.generated / lease.max_tokens)
    return lease.priority * progress - lease.blocks / max(needed_blocks, 1)


def choose_victims(
    leases: Sequence[RunningLease],
    needed_blocks: int,
    free_blocks: int,
    newcomer_priority: float,
    policy: CacheManagerSettings,
) -> list[RunningLease] | None:
    """The cheapest running leases whose blocks make room, or None.

    `leases` and `free_blocks` belong to one pool of one node (a request
    is never split across pools). Only leases of a strictly lower priority
    may be preempted, so equals never evict each other back and forth;
    among those, the lowest retention value (or, for LRU, the oldest) goes
    first.
    """
    candidates = [a for a in leases if a.priority < newcomer_priority]
    if policy.eviction == "lru":
        order = sorted(candidates, key=lambda a: (a.granted_at, a.request_id))
    else:
        order = sorted(candidates, key=lambda a: (retention_value(a, needed_blocks), a.request_id))
    victims, room = [], free_blocks
    for lease in order:
        if room >= needed_blocks:
            break
        victims.append(lease)
        room += lease.blocks
    return victims if room >= needed_blocks else None


class PreemptionPlan(Struct, frozen=True):
    worker_id: str
    pool: Pool
    blocks: int
    cached_blocks: int
    victims: list[RunningLease]


def plan_preemption(
    demand: Demand,
    nodes: Sequence[tuple[NodeCapacity, Sequence[RunningLease]]],
    cached: Mapping[str, int],
    policy: CacheManagerSettings,
) -> PreemptionPlan | None:
    """Where preempting frees room for `demand` at the least cost (blocks taken back), or None.

    `nodes` pairs each candidate node's usage with its running leases. A
    short request may preempt in the short pool or the general one.
    """
    short = is_short(demand, policy)
    best: PreemptionPlan | None = None
    best_cost = 0
    for node, leases in nodes:
        cached_blocks = min(cached.get(node.worker_id, 0), demand.prompt_tokens // node.block_size)
        blocks = need_blocks(demand, node.block_size, cached_blocks, policy)
        free_general, free_short = node.free(policy)
        pools: tuple[tuple[Pool, int], ...] = (("short", free_short), ("general", free_general)) if short else (("general", free_general),)
        for pool, free in pools:
            victims = choose_victims([a for a in leases if a.pool == pool], blocks, free, demand.priority, policy)
            if victims is None:
                continue
            cost = sum(a.blocks for a in victims)
            if best is None or cost < best_cost:
                best, best_cost = PreemptionPlan(node.worker_id, pool, blocks, cached_blocks, victims), cost
    return best
