"""A finished request's KV lease goes in the balancer's slot release, one script with its slot, on a real Redis and
a real Redis Cluster: whatever became of the slot, from whichever replica, and credited to the ledger once. And in a
fleet, with either slot store, the balancer gives every lease back (the cache-manager frees none)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as redis

from services.balancer.slot_store import RedisSlotStore, chain_slots_key, request_slot_key
from shared.kv.block_ledger import BlockLedger, expiry_key, lease_key
from tests.integration.conftest import launch, run_leased, stop_and_check
from tests.waiting import until

pytestmark = pytest.mark.integration

FAR = 4_000_000_000.0  # an expiry far in the future
BLOCKS = 3
NODES = ("w0", "w1")


def lease_call(ledger: BlockLedger, request_id: str, worker_id: str) -> tuple[list, list]:
    return ledger.allocate_call(request_id, worker_id, BLOCKS, "general", 100, 0, 1.0, 10)


async def placed(store: RedisSlotStore, ledger: BlockLedger, request_id: str, chain_id: str,
                 expires_at: float = FAR) -> None:
    """`request_id`'s slot and lease, taken together as a route decision takes them."""
    both = await store.reserve_with_lease(request_id, chain_id, 100, expires_at,
                                          lease_call(ledger, request_id, chain_id.partition("@")[0]))
    assert both.slot_taken and both.lease is not None and both.lease.granted


async def used_blocks(ledger: BlockLedger, worker_id: str = "w0") -> tuple[int, int, int]:
    return (await ledger.usage([worker_id]))[worker_id]


def count_batches(store: RedisSlotStore) -> list[int]:
    """The size of each script batch `store` sends from now on."""
    sizes: list[int] = []
    send = store._batch._send

    async def counted(batch):
        sizes.append(len(batch))
        return await send(batch)

    store._batch._send = counted  # type: ignore[method-assign]
    return sizes


async def test_the_replica_that_placed_a_request_frees_slot_and_lease_in_one_script(redis_client: redis.Redis) -> None:
    store, ledger = RedisSlotStore(redis_client), BlockLedger(redis_client, lease_ttl_s=60)
    await placed(store, ledger, "r1", "w0@1")
    await placed(store, ledger, "r2", "w0@1")
    assert await used_blocks(ledger) == (2 * BLOCKS, 0, 2)
    batches = count_batches(store)
    assert await store.release_many([("r1", "w0")], ["w0@1"]) == [("w0@1", 1)]
    assert batches == [1]  # nothing read first, no second script
    assert await used_blocks(ledger) == (BLOCKS, 0, 1)
    assert not await redis_client.exists(lease_key("w0", "r1"), request_slot_key("w0", "r1"))
    # Released again (another replica, a repeated event): nothing more is credited.
    assert await store.release_many([("r1", "w0")], ["w0@1"]) == [None]
    assert await used_blocks(ledger) == (BLOCKS, 0, 1)


async def test_the_lease_goes_though_the_slot_expired_or_moved(redis_client: redis.Redis) -> None:
    store, ledger = RedisSlotStore(redis_client), BlockLedger(redis_client, lease_ttl_s=60)
    # The slot lapses at the request's deadline while the request runs on (renewing its lease).
    await placed(store, ledger, "late", "w0@1", expires_at=time.time() + 0.3)

    async def slot_lapsed() -> bool:
        return not await redis_client.exists(request_slot_key("w0", "late"))

    await until(slot_lapsed, 10, "the slot's key expired")
    # The worker restarted (a new chain) and the request was placed again on it: same node, same lease.
    await placed(store, ledger, "moved", "w0@1")
    assert (await store.reserve("moved", "w0@2", 100, FAR))[0]
    assert await used_blocks(ledger) == (2 * BLOCKS, 0, 2)
    released = await store.release_many([("late", "w0"), ("moved", "w0")], ["w0@1", "w0@1"])
    assert released == [None, ("w0@2", 0)]
    assert await used_blocks(ledger) == (0, 0, 0)
    assert await store.usage(["w0@2"], 0.0) == {"w0@2": 0}


async def test_a_replica_that_did_not_place_the_request_frees_its_lease_too(redis_client: redis.Redis) -> None:
    placer = RedisSlotStore(redis_client)
    other = RedisSlotStore(redis_client)
    ledger = BlockLedger(redis_client, lease_ttl_s=60)
    await placed(placer, ledger, "both", "w0@1")
    # The slot-and-lease script found no room: the slot alone, and the lease a preemption granted on the same node.
    assert (await placer.reserve("granted-by-cache-manager", "w1@1", 100, FAR))[0]
    assert (await ledger.reserve("granted-by-cache-manager", "w1", BLOCKS, "general", 100, 0, 1.0, 10)).granted
    # A lease whose slot is gone already (lapsed, or freed by a release that failed to reach the ledger's keys).
    await placed(placer, ledger, "lease-only", "w0@1")
    await redis_client.delete(request_slot_key("w0", "lease-only"))
    await redis_client.zrem(chain_slots_key("w0@1"), "lease-only")
    batches = count_batches(other)
    released = await other.release_many([("both", "w0"), ("granted-by-cache-manager", "w1"), ("lease-only", "w0"),
                                         ("never", "w0"), ("both", "w1")])
    assert released == [("w0@1", 0), ("w1@1", 0), None, None, None]
    # One script each reads the slot's chain and frees the lease; then the two slots found.
    assert batches == [5, 2]
    assert await ledger.usage(list(NODES)) == {"w0": (0, 0, 0), "w1": (0, 0, 0)}
    # Now that both are gone, a replica that hears of the requests again only reads.
    batches.clear()
    assert await other.release_many([("both", "w0"), ("lease-only", "w0")]) == [None, None]
    assert batches == [2]
    assert await ledger.usage(list(NODES)) == {"w0": (0, 0, 0), "w1": (0, 0, 0)}


async def test_replicas_releasing_the_same_requests_at_once_credit_each_lease_once(redis_client: redis.Redis) -> None:
    replicas = [RedisSlotStore(redis_client) for _ in range(3)]
    ledger = BlockLedger(redis_client, lease_ttl_s=60)
    requests = [(f"r{i}", NODES[i % 2]) for i in range(30)]
    for request_id, worker_id in requests:
        await placed(replicas[0], ledger, request_id, f"{worker_id}@1")
    # A late request keeps blocks on each node, so that a lease credited twice would show as too few used.
    for worker_id in NODES:
        await placed(replicas[0], ledger, f"keeps-{worker_id}", f"{worker_id}@1")
    chains = [f"{worker_id}@1" for _, worker_id in requests]
    await asyncio.gather(replicas[0].release_many(requests, chains), replicas[1].release_many(requests),
                         replicas[2].release_many(requests), replicas[1].release_many(requests, chains))
    assert await ledger.usage(list(NODES)) == {worker_id: (BLOCKS, 0, 1) for worker_id in NODES}
    assert await replicas[0].usage(["w0@1", "w1@1"], 0.0) == {"w0@1": 1, "w1@1": 1}


async def test_a_lease_reaped_already_is_not_credited_again(redis_client: redis.Redis) -> None:
    store, ledger = RedisSlotStore(redis_client), BlockLedger(redis_client, lease_ttl_s=60)
    await placed(store, ledger, "lapsed", "w0@1")
    await placed(store, ledger, "running", "w0@1")
    await redis_client.zadd(expiry_key("w0"), {"lapsed": 0})  # its worker stopped renewing it
    assert await ledger.reap(["w0"]) == ["lapsed"]
    assert await used_blocks(ledger) == (BLOCKS, 0, 1)
    assert await store.release_many([("lapsed", "w0")], ["w0@1"]) == [("w0@1", 1)]  # the slot still goes
    assert await used_blocks(ledger) == (BLOCKS, 0, 1)


def local_slots(config):
    """Slots kept by the one balancer alone: it frees leases through its allocator, not in a slot script."""
    balancer = config.balancer
    return msgspec.structs.replace(config, balancer=msgspec.structs.replace(
        balancer, slots=msgspec.structs.replace(balancer.slots, store="local")))


@pytest.mark.parametrize("tune", [None, local_slots], ids=["redis-slots", "local-slots"])
async def test_the_balancer_gives_every_lease_back_whatever_its_slot_store(tmp_path: Path, tune) -> None:
    # Leases outlive the test unless released: only a release gives them back in time.
    fleet = launch(tmp_path, workers=2, tune=tune, speed=0.2)
    try:
        assert fleet.config.balancer.slots.store == ("redis" if tune is None else "local")
        redis_client = redis.Redis.from_url(fleet.config.redis.url)
        ledger = BlockLedger(redis_client, lease_ttl_s=60)
        await run_leased(fleet, ledger, list(NODES), 8, "leased request")

        async def all_back() -> bool:
            return set((await ledger.usage(list(NODES))).values()) == {(0, 0, 0)}

        # Well within the lease TTL (10 s): released, not reaped.
        await until(all_back, 5, lambda: "leases were not given back")
        await redis_client.aclose()
    finally:
        stop_and_check(fleet)
