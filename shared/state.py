"""Cluster state in Redis: one heartbeat key per node with a TTL.

A node is alive exactly while its key exists: a worker that dies stops
refreshing the key and Redis forgets it within the TTL, with no cleanup
needed. The set `kvlane:v1:nodes` indexes the keys so readers need no SCAN;
members whose key has expired are pruned by whoever reads them. A key and
its membership are written together but not as one transaction: on a Redis
Cluster they lie in different slots, and a reader tolerates either alone
(a member without a key is pruned; a key not yet a member waits one beat).
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import msgspec
import redis.asyncio as redis
import structlog
from redis.asyncio.cluster import ClusterPipeline, RedisCluster

from contracts import subjects
from contracts.messages import Heartbeat
from shared.config import RedisSettings
from shared.credentials import redis_url_and_options

log = structlog.get_logger("kvlane.state")


def connect_redis(settings: RedisSettings) -> redis.Redis:
    url, options = redis_url_and_options(settings)
    if settings.mode == "cluster":
        # One pool per cluster node (`max_connections` each); commands, scripts and pipelines go to their keys' nodes.
        return BoundedRedisCluster.from_url(  # type: ignore[return-value]
            url,
            **options,
            max_in_flight=settings.max_connections,
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


# Set while a task holds a permit, so a pipeline's own retries of single commands do not ask for another.
_holding_permit: contextvars.ContextVar[bool] = contextvars.ContextVar("holding_permit", default=False)


class BoundedRedisCluster(RedisCluster):
    """redis-py's async cluster client fails a command at once (MaxConnectionsError) when a node's
    pool is used up. This one makes a burst wait instead, as the blocking pool does for one Redis:
    at most `max_in_flight` commands or pipelines at a time, so no node's pool of as many runs out."""

    def __init__(self, *args: Any, max_in_flight: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_flight = asyncio.Semaphore(max_in_flight)

    async def _bounded(self, call: Any) -> Any:
        if _holding_permit.get():
            return await call()
        async with self._in_flight:
            token = _holding_permit.set(True)
            try:
                return await call()
            finally:
                _holding_permit.reset(token)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await self._bounded(lambda: super(BoundedRedisCluster, self).execute_command(*args, **kwargs))

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # refused by redis-py, with its message
        return _BoundedPipeline(self, transaction)


class _BoundedPipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        client: BoundedRedisCluster = self.cluster_client
        return await client._bounded(lambda: super(_BoundedPipeline, self).execute(raise_on_error, allow_redirections))


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
        async with self._redis.pipeline(transaction=False) as pipe:
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
        async with self._redis.pipeline(transaction=False) as pipe:
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
