"""A node's heartbeat as Redis holds it, waited for: its key lives for `heartbeat_ttl_s` only, so one
late beat on a busy machine leaves no key for a moment."""

from __future__ import annotations

import time

import msgspec
import redis.asyncio as redis

from contracts import subjects
from contracts.messages import EngineStats, Heartbeat
from launch.fleet import Fleet
from tests.waiting import until

_decoder = msgspec.json.Decoder(Heartbeat)


async def heartbeat_of(redis_url: str, worker_id: str, timeout_s: float = 30) -> Heartbeat:
    """The heartbeat stored for `worker_id`, waiting while its key is missing."""
    found: list[Heartbeat] = []
    client = redis.Redis.from_url(redis_url)

    async def stored() -> bool:
        raw = await client.get(subjects.node_key(worker_id))
        found[:] = [_decoder.decode(raw)] if raw else []
        return bool(found)

    try:
        await until(stored, timeout_s, f"no heartbeat from {worker_id}")
    finally:
        await client.aclose()
    return found[0]


async def stats_of(fleet: Fleet, worker_id: str) -> EngineStats:
    return (await heartbeat_of(fleet.config.redis.url, worker_id)).stats


async def fresh_stats(fleet: Fleet, worker_id: str, timeout_s: float = 30) -> EngineStats:
    """The stats of a heartbeat sent a full interval after this call: they reflect what had happened by the call."""
    after = time.time() + fleet.config.cluster.heartbeat_interval_s
    fresh: list[Heartbeat] = []

    async def sent_after() -> bool:
        fresh[:] = [await heartbeat_of(fleet.config.redis.url, worker_id, timeout_s)]
        return fresh[0].sent_at >= after

    await until(sent_after, timeout_s, f"no heartbeat from {worker_id} sent after {after:.2f}")
    return fresh[0].stats
