"""`redis.mode = "cluster"` against a real three-master Redis Cluster: the client that
`connect_redis` makes routes scripts and batches of scripts to their keys' nodes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster

from services.balancer.slot_store import (
    RedisSlotStore,
    chain_slots_key,
    request_slot_key,
)
from shared.api_keys import make_record
from shared.kv.block_ledger import (
    BlockLedger,
    expiry_key,
    lease_key,
    node_leases_key,
    usage_key,
)
from shared.config import RedisSettings
from services.ingress.key_limits import KeyLimiter, limit_keys
from shared.redis_scripts import run_batch
from shared.state import ClusterState, connect_redis
from tests.integration.conftest import launch, run_leased, stop_and_check
from tests.waiting import until
from tests.integration.redis_cluster import MASTERS, redis_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster_ports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    with redis_cluster(Path(tmp_path_factory.mktemp("redis-cluster"))) as ports:
        yield ports


@pytest.fixture
async def client(cluster_ports: list[int]) -> AsyncIterator[RedisCluster]:
    client = connect_redis(RedisSettings(url=f"redis://127.0.0.1:{cluster_ports[0]}/0", mode="cluster"))
    assert isinstance(client, RedisCluster)
    await client.flushall()
    yield client
    await client.aclose()


async def test_a_burst_larger_than_the_pools_waits_for_connections_instead_of_failing(cluster_ports: list[int]) -> None:
    # redis-py's own cluster client raises MaxConnectionsError here at once.
    client = connect_redis(RedisSettings(url=f"redis://127.0.0.1:{cluster_ports[0]}/0", mode="cluster", max_connections=2))
    try:
        await asyncio.gather(*(client.set(f"burst:{i}", i) for i in range(300)))
        pipelines = []
        for start in range(0, 300, 30):
            pipe = client.pipeline()
            for i in range(start, start + 30):
                pipe.get(f"burst:{i}")
            pipelines.append(pipe.execute())
        values = [int(v) for batch in await asyncio.gather(*pipelines) for v in batch]
        assert values == list(range(300))
    finally:
        await client.aclose()


def node_of(client: RedisCluster, key: str) -> str:
    return client.get_node_from_key(key).name


async def test_a_batch_of_scripts_runs_on_every_keys_node_and_survives_forgotten_scripts(client: RedisCluster) -> None:
    script = client.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    keys = [f"kvlane:v1:test:{{k{i}}}" for i in range(30)]
    assert len({node_of(client, key) for key in keys}) == MASTERS
    calls = [([key], [i]) for i, key in enumerate(keys)]
    assert await run_batch(client, script, calls) == list(range(30))
    # As after a restart of the cluster's nodes: no node knows the script any more.
    await client.execute_command("SCRIPT FLUSH", target_nodes=RedisCluster.ALL_NODES)
    assert await run_batch(client, script, calls) == [2 * i for i in range(30)]


async def test_key_limits_hold_per_key_on_a_cluster(client: RedisCluster) -> None:
    limiter = KeyLimiter(client)
    records = [make_record(f"tenant-{i}", rpm=2)[0] for i in range(12)]
    # Each key's four Redis keys share one slot; different keys spread over the nodes.
    assert all(len({node_of(client, key) for key in limit_keys(r.id)}) == 1 for r in records)
    assert len({node_of(client, limit_keys(r.id)[0]) for r in records}) > 1
    for record in records:
        verdicts = [await limiter.admit(record, f"r{i}", 1, 30.0) for i in range(3)]
        assert [v.admitted for v in verdicts] == [True, True, False]
        assert verdicts[2].reason == "rpm"


async def test_each_nodes_ledger_and_slot_keys_share_a_slot_and_nodes_spread_over_the_masters(client: RedisCluster) -> None:
    def keys_of(worker_id: str) -> list[str]:
        return [usage_key(worker_id), lease_key(worker_id, "r1"), expiry_key(worker_id), node_leases_key(worker_id),
                chain_slots_key(f"{worker_id}@1700000000000"), request_slot_key(worker_id, "r1")]

    workers = [f"w{i}" for i in range(12)]
    for worker_id in workers:
        assert len({await client.cluster_keyslot(key) for key in keys_of(worker_id)}) == 1, worker_id
    assert len({node_of(client, keys_of(worker_id)[0]) for worker_id in workers}) == MASTERS
    # What one route reserves lies on the master its node's keys name, and releases from there.
    store, ledger = RedisSlotStore(client), BlockLedger(client, lease_ttl_s=60)
    for worker_id in workers:
        both = await store.reserve_with_lease("r1", f"{worker_id}@1", 2, 4_000_000_000.0,
                                              ledger.allocate_call("r1", worker_id, 3, "general", 10, 0, 1.0, 10))
        assert both.slot_taken and both.lease is not None and both.lease.granted
    for key in keys_of("w0")[:2]:
        holders = []
        for node in client.get_primaries():
            async with redis.Redis(host=node.host, port=node.port) as direct:
                if await direct.keys(key):  # not EXISTS, which a master not serving the key answers with MOVED
                    holders.append(node.name)
        assert holders == [node_of(client, key)]
    # The slot's release frees the lease in the same script, on the same master.
    assert await store.release_many([("r1", w) for w in workers]) == [(f"{w}@1", 0) for w in workers]
    assert set((await ledger.usage(workers)).values()) == {(0, 0, 0)}
    assert await ledger.release_many([("r1", w) for w in workers]) == [None] * len(workers)  # nothing left to free


async def test_a_fleet_on_a_cluster_serves_requests_with_kv_leases_and_gives_every_one_back(
    tmp_path: Path, client: RedisCluster, cluster_ports: list[int]
) -> None:
    settings = RedisSettings(url=f"redis://127.0.0.1:{cluster_ports[0]}/0", mode="cluster")
    fleet = launch(tmp_path, workers=2, redis=settings, speed=0.2)
    try:
        workers = ["w0", "w1"]

        async def heartbeats_stored() -> bool:
            live = await ClusterState(client, 5).live_heartbeats()
            return sorted(item.heartbeat.registration.worker_id for item in live) == workers

        await until(heartbeats_stored, 10, "the workers' heartbeats are not in the cluster")
        ledger = BlockLedger(client, lease_ttl_s=60)
        # While they run, their leases are in the ledger, on their nodes' masters.
        await run_leased(fleet, ledger, workers, 6, "cluster request")

        async def all_back() -> bool:
            slots = await RedisSlotStore(client).usage([await chain_of(client, w) for w in workers], 0.0)
            return set((await ledger.usage(workers)).values()) == {(0, 0, 0)} and not any(slots.values())

        await until(all_back, 10, lambda: "leases or slots were not given back")
    finally:
        stop_and_check(fleet)


async def chain_of(client: RedisCluster, worker_id: str) -> str:
    """The chain id the balancer keys `worker_id`'s slots by (`snapshot.chain_id_of`)."""
    (live,) = [live for live in await ClusterState(client, 5).live_heartbeats() if live.heartbeat.registration.worker_id == worker_id]
    return f"{worker_id}@{int(live.heartbeat.registration.started_at * 1000)}"
