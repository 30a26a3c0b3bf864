"""Wiring of the balancer process."""

from __future__ import annotations

import asyncio
import contextlib

from services.balancer.policies import make_policy
from services.balancer.service import BalancerService
from shared.bus import Bus
from shared.cluster import ClusterView, ClusterWatcher
from shared.config import KvlaneConfig
from shared.state import ClusterState, connect_redis
from shared.telemetry import Telemetry


async def main(config: KvlaneConfig, stop: asyncio.Event) -> None:
    telemetry = Telemetry(config.tracing, "balancer")
    redis_client = connect_redis(config.redis)
    bus = await Bus.connect(config.nats, "kvlane-balancer", telemetry)
    view = ClusterView(config.cluster.heartbeat_ttl_s)
    watcher = ClusterWatcher(bus, ClusterState(redis_client, config.cluster.heartbeat_ttl_s), view, config.cluster.resync_interval_s)
    try:
        await watcher.start()
        await BalancerService(bus, view, make_policy(config.balancer.policy)).start()
        await stop.wait()
    finally:
        await watcher.stop()
        # Draining the connection answers the route requests already received.
        await bus.close()
        with contextlib.suppress(Exception):
            await redis_client.aclose()
        telemetry.shutdown()
