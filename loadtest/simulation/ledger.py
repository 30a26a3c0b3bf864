"""KV leases in memory: what the Redis ledger's scripts do, for one process and virtual time.

The rules are the ledger's (`shared.kv.block_ledger`): a lease holds blocks in
one pool of one node; `short_first` takes the short pool when the blocks
fit there, else the general one; a lease is found through its node, so a
request leased again on another node keeps its first lease there until a
release names that node (or names none); a release is idempotent. Which node
and how many blocks is decided by the same pure core the services use
(`shared.kv.allocation`), and so is preemption.
tests/integration/test_ledger_conformance.py holds the two to the same
operation sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from msgspec import Struct

from shared.config import CacheManagerSettings
from shared.kv.allocation import Demand, NodeAsk, NodeCapacity, PreemptionPlan, RunningLease, ask_on_node, plan_preemption


class _Lease(Struct):
    blocks: int
    pool: str
    priority: float
    max_tokens: int
    granted_at: float


class MemoryLedger:
    def __init__(self) -> None:
        # node -> request -> its lease there, as the ledger's keys carry the node's tag
        self._leases: dict[str, dict[str, _Lease]] = {}
        self._used: dict[str, dict[str, int]] = {}

    def reserve(self, request_id: str, worker_id: str, ask: NodeAsk, priority: float, max_tokens: int, now: float) -> bool:
        leases = self._leases.setdefault(worker_id, {})
        if request_id in leases:
            return True
        used = self._used.setdefault(worker_id, {"general": 0, "short": 0})
        pools = ("short", "general") if ask.pool == "short_first" else (ask.pool,)
        for pool in pools:
            capacity = ask.short_capacity if pool == "short" else ask.general_capacity
            if used[pool] + ask.blocks <= capacity:
                used[pool] += ask.blocks
                leases[request_id] = _Lease(ask.blocks, pool, priority, max_tokens, now)
                return True
        return False

    def release(self, request_id: str, worker_id: str | None = None) -> int | None:
        """Blocks given back (on every node when `worker_id` is None), or None when the request held none there."""
        nodes = [worker_id] if worker_id is not None else sorted(self._leases)
        freed = [blocks for node in nodes if (blocks := self._release_on(request_id, node)) is not None]
        return sum(freed) if freed else None

    def _release_on(self, request_id: str, worker_id: str) -> int | None:
        lease = self._leases.get(worker_id, {}).pop(request_id, None)
        if lease is None:
            return None
        self._used[worker_id][lease.pool] -= lease.blocks
        return lease.blocks

    def release_node(self, worker_id: str) -> None:
        for request_id in list(self._leases.get(worker_id, {})):
            self._release_on(request_id, worker_id)

    def used(self, worker_id: str) -> tuple[int, int]:
        used = self._used.get(worker_id, {})
        return used.get("general", 0), used.get("short", 0)

    def leases_on(self, worker_id: str, generated: Callable[[str], int]) -> list[RunningLease]:
        return [
            RunningLease(request_id, worker_id, lease.blocks, lease.pool, lease.priority,  # type: ignore[arg-type]
                         lease.max_tokens, generated(request_id), lease.granted_at)
            for request_id, lease in self._leases.get(worker_id, {}).items()
        ]


class LeaseGrant(Struct, frozen=True):
    granted: bool
    preempted: list[str] = []


class SimAllocator:
    """The balancer's lease for the node it chose; on refusal, the cache-manager's preemption, as in the services."""

    def __init__(self, ledger: MemoryLedger, settings: CacheManagerSettings) -> None:
        self.ledger = ledger
        self._settings = settings
        self.preemptions = 0

    def allocate(
        self, demand: Demand, worker_id: str, blocks_total: int, block_size: int, cached_blocks: int,
        generated: Callable[[str], int], now: float,
    ) -> LeaseGrant:
        ask = ask_on_node(demand, blocks_total, block_size, cached_blocks, self._settings)
        if self.ledger.reserve(demand.request_id, worker_id, ask, demand.priority, demand.max_tokens, now):
            return LeaseGrant(True)
        plan = self._preemption(demand, worker_id, blocks_total, block_size, cached_blocks, generated)
        if plan is None:
            return LeaseGrant(False)
        for victim in plan.victims:
            self.ledger.release(victim.request_id, worker_id)
        self.preemptions += len(plan.victims)
        granted = self.ledger.reserve(demand.request_id, worker_id, ask, demand.priority, demand.max_tokens, now)
        return LeaseGrant(granted, [v.request_id for v in plan.victims])

    def _preemption(self, demand: Demand, worker_id: str, blocks_total: int, block_size: int, cached_blocks: int,
                    generated: Callable[[str], int]) -> PreemptionPlan | None:
        node = NodeCapacity(worker_id, blocks_total, block_size, *self.ledger.used(worker_id))
        nodes: Sequence[tuple[NodeCapacity, Sequence[RunningLease]]] = [(node, self.ledger.leases_on(worker_id, generated))]
        return plan_preemption(demand, nodes, {worker_id: cached_blocks}, self._settings)
