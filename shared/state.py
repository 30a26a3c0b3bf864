"""Cluster state in Redis: one heartbeat key per node with a TTL.

A node is alive exactly while its key exists: a worker that dies stops
refreshing the key and Redis forgets it within the TTL, with no cleanup
needed. The set `kvlane:v1:nodes` indexes the keys so readers need no SCAN;
members whose key has expired are pruned by whoever reads them.
"""

from __future__ import annotations

import msgspec
import redis.asyncio as redis
import structlog
from redis.asyncio.cluster import RedisCluster

from contracts import subjects
from contracts.messages import Heartbeat
from shared.config import RedisSettings
from shared.credentials import redis_url_and_options

log = structlog.get_logger("kvlane.state")


def connect_redis(settings: RedisSettings) -> redis.Redis:
    url, options = redis_url_and_options(settings)
    if settings.mode == "cluster":
        # One pool per cluster node (`max_connections` each); commands, scripts and pipelines go to their keys' nodes.
        return RedisCluster.from_url(  # type: ignore[return-value]
            url,
            **options,
            max_connections=settings.max_connections,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.socket_timeout_s,
            health_check_interval=5,
        )
    # A blocking pool makes a burst of concurrent commands wait for a
    # connection instead of failing with "Too many connections".
    pool = redis.BlockingConnectionPool.from_url(
        url,
        **options,
        max_connections=settings.max_connections,
        timeout=settings.pool_timeout_s,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.socket_timeout_s,
        health_check_interval=5,
    )
    return redis.Redis(connection_pool=pool)


class LiveHeartbeat(msgspec.Struct, frozen=True):
    heartbeat: Heartbeat
    # How long ago the key was last refreshed, from its remaining TTL, so a
    # reader does not take a dead node's last key for a fresh one.
    age_s: float


class ClusterState:
    def __init__(self, client: redis.Redis, ttl_s: float) -> None:
        self._redis = client
        self._ttl_ms = int(ttl_s * 1000)
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(Heartbeat)

    async def put_heartbeat(self, heartbeat: Heartbeat) -> None:
        worker_id = heartbeat.registration.worker_id
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(subjects.node_key(worker_id), self._encoder.encode(heartbeat), px=self._ttl_ms)
            pipe.sadd(subjects.NODE_SET_KEY, worker_id)
            await pipe.execute()

    async def put_heartbeats(self, heartbeats: list[Heartbeat]) -> None:
        """Several nodes' heartbeats in one round trip (a process hosting many nodes); each node's key
        and set membership as `put_heartbeat` writes them, not one transaction for all."""
        if not heartbeats:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for heartbeat in heartbeats:
                worker_id = heartbeat.registration.worker_id
                pipe.set(subjects.node_key(worker_id), self._encoder.encode(heartbeat), px=self._ttl_ms)
            pipe.sadd(subjects.NODE_SET_KEY, *(heartbeat.registration.worker_id for heartbeat in heartbeats))
            await pipe.execute()

    async def remove_node(self, worker_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(subjects.node_key(worker_id))
            pipe.srem(subjects.NODE_SET_KEY, worker_id)
            await pipe.execute()

    async def live_heartbeats(self) -> list[LiveHeartbeat]:
        worker_ids = sorted(member.decode() for member in await self._redis.smembers(subjects.NODE_SET_KEY))
        if not worker_ids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.get(subjects.node_key(worker_id))
                pipe.pttl(subjects.node_key(worker_id))
            replies = await pipe.execute()
        live: list[LiveHeartbeat] = []
        gone: list[str] = []
        for worker_id, raw, pttl in zip(worker_ids, replies[0::2], replies[1::2], strict=True):
            if raw is None or pttl is None or pttl < 0:
                gone.append(worker_id)
                continue
            try:
                heartbeat = self._decoder.decode(raw)
            except msgspec.DecodeError as exc:
                log.warning("bad_heartbeat_key", worker_id=worker_id, error=str(exc))
                continue
            live.append(LiveHeartbeat(heartbeat, max(0.0, (self._ttl_ms - pttl) / 1000)))
        if gone:
            await self._redis.srem(subjects.NODE_SET_KEY, *gone)
        return live
