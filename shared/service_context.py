"""What every service process opens at start and closes at exit.

Telemetry, a Redis client, the NATS bus and (for services that route or
watch workers) a live `ClusterView`, closed in reverse order however the
service ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog
from redis.asyncio import Redis

from shared.bus import Bus
from shared.cluster import ClusterView, ClusterWatcher
from shared.config import KvlaneConfig
from shared.state import ClusterState, connect_redis
from shared.telemetry import SHUTDOWN_FLUSH_S, Telemetry

log = structlog.get_logger("kvlane.service")


@dataclass
class ServiceContext:
    telemetry: Telemetry
    redis: Redis
    bus: Bus
    state: ClusterState
    view: ClusterView
    # Feeds `view`; services that act on each heartbeat listen on it.
    watcher: ClusterWatcher


@contextlib.asynccontextmanager
async def service_context(config: KvlaneConfig, service: str, instance_id: str) -> AsyncIterator[ServiceContext]:
    telemetry = Telemetry(config.tracing, service, instance_id=instance_id)
    redis_client = connect_redis(config.redis)
    state = ClusterState(redis_client, config.cluster.heartbeat_ttl_s)
    bus = await Bus.connect(config.nats, f"kvlane-{service}-{instance_id}", telemetry)
    view = ClusterView(config.cluster.heartbeat_ttl_s)
    watcher = ClusterWatcher(bus, state, view, config.cluster.resync_interval_s)
    try:
        await watcher.start()
        yield ServiceContext(telemetry, redis_client, bus, state, view, watcher)
    finally:
        await watcher.stop()
        await bus.close()
        with contextlib.suppress(Exception):
            await redis_client.aclose()
        if not telemetry.shutdown():
            log.warning("telemetry_not_flushed", endpoint=config.tracing.otlp_endpoint, waited_s=SHUTDOWN_FLUSH_S)
