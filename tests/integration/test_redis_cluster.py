"""`redis.mode = "cluster"` against a real three-master Redis Cluster: the client that
`connect_redis` makes routes scripts and batches of scripts to their keys' nodes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster

from shared.api_keys import make_record
from shared.config import RedisSettings
from shared.key_limits import KeyLimiter, limit_keys
from shared.redis_scripts import run_batch
from shared.state import connect_redis
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
