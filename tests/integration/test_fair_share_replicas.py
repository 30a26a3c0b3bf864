"""Three balancer replicas share the tenants' fair-share counters through Redis (single and Cluster): they split the
fleet between tenants as one replica does, where each alone, on its own counters, would not."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from redis.asyncio import Redis

from contracts.messages import RouteRequest
from services.balancer.central_queue import CentralQueue
from services.balancer.fair_share import TenantShares
from services.balancer.slot_store import RedisSlotStore

pytestmark = pytest.mark.integration

SLOTS_FREED = 600
READ_EVERY = 6  # slots freed between reads of the shared counters (the balancers read them every tick)
_ids = itertools.count()


def request(tenant: str) -> RouteRequest:
    return RouteRequest(request_id=f"r{next(_ids)}", model="m", prompt_tokens=100, max_tokens=50, timeout_s=60.0,
                        tenant=tenant)


class Replica:
    """A balancer's queue and counters; its waiting requests are only a's (`only_a`) or both tenants'."""

    def __init__(self, store: RedisSlotStore | None, only_a: bool) -> None:
        self.store = store
        self.tenants = ("a",) if only_a else ("a", "b")
        self.shares = TenantShares()
        self.queue = CentralQueue(10_000)
        for tenant in self.tenants:
            for _ in range(3):
                self.arrive(tenant)

    def arrive(self, tenant: str) -> None:
        self.shares.arrived(tenant, self.queue.waiting_per_tenant())
        self.queue.push(request(tenant), 0.0, 1e9)

    async def serve_one(self) -> str:
        """A slot freed: the next request in fair order takes it (and its tenant sends another: both stay backlogged)."""
        entry = next(self.queue.in_order(self.shares))
        self.queue.remove(entry.request_id)
        charge = self.shares.placed(entry.request)
        assert charge is not None
        if self.store is not None:
            self.store.charge(charge)  # rides along with the next batch: here, the next read's
        self.arrive(entry.request.tenant)
        return entry.request.tenant

    async def read(self) -> None:
        if self.store is not None:
            _, counters = await self.store.usage_and_counters([], 0.0)
            assert counters is not None
            self.shares.read(counters)


async def split(replicas: list[Replica]) -> float:
    """b's share of the requests served, slots freeing at each replica in turn."""
    served: Counter[str] = Counter()
    for freed in range(SLOTS_FREED):
        served[await replicas[freed % len(replicas)].serve_one()] += 1
        if freed % READ_EVERY == READ_EVERY - 1:
            for replica in replicas:
                await replica.read()
    return served["b"] / SLOTS_FREED


async def test_replicas_sharing_counters_split_as_one_replica_does(redis_client: Redis) -> None:
    # One replica sees both tenants: it serves them equally.
    alone = await split([Replica(RedisSlotStore(redis_client), only_a=False)])
    await redis_client.flushall()
    # Of three, the first is asked only by a; the other two, by both. Sharing the counters, those two serve b the
    # more, so that the fleet serves both equally.
    shared = await split([Replica(RedisSlotStore(redis_client), only_a=i == 0) for i in range(3)])
    # Each on its own counters, the two split their slots equally, and a takes the first's too: b gets a third.
    apart = await split([Replica(None, only_a=i == 0) for i in range(3)])
    assert alone == pytest.approx(0.5, abs=0.02)
    assert shared == pytest.approx(alone, abs=0.04)
    assert apart == pytest.approx(1 / 3, abs=0.02)
