"""Wiring of the ingress process."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import structlog
from aiohttp import web

from contracts import subjects
from services.ingress.app import IngressApp
from services.ingress.dispatch import Dispatcher
from services.ingress.metrics import IngressMetrics
from shared.bus import Bus, StreamReceiver
from shared.cluster import ClusterView, ClusterWatcher
from shared.config import KvlaneConfig
from shared.state import ClusterState, connect_redis
from shared.telemetry import Telemetry

log = structlog.get_logger("kvlane.ingress")


async def main(config: KvlaneConfig, stop: asyncio.Event) -> None:
    settings = config.ingress
    ingress_id = settings.ingress_id or f"i-{uuid.uuid4().hex[:8]}"
    if not subjects.is_valid_token(ingress_id):
        raise SystemExit(f"ingress_id {ingress_id!r} must be 1-64 characters of A-Z a-z 0-9 _ -")
    telemetry = Telemetry(config.tracing, "ingress")
    redis_client = connect_redis(config.redis)
    bus = await Bus.connect(config.nats, f"kvlane-ingress-{ingress_id}", telemetry)
    view = ClusterView(config.cluster.heartbeat_ttl_s)
    watcher = ClusterWatcher(bus, ClusterState(redis_client, config.cluster.heartbeat_ttl_s), view, config.cluster.resync_interval_s)
    streams = StreamReceiver(bus, ingress_id)
    app = IngressApp(settings, view, Dispatcher(bus, streams, settings), IngressMetrics(), lambda: bus.connected)
    runner = web.AppRunner(app.build(), access_log=None, shutdown_timeout=settings.request_timeout_s)
    try:
        await watcher.start()
        await streams.start()
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        log.info("ingress_listening", host=settings.host, port=settings.port, ingress_id=ingress_id)
        await stop.wait()
    finally:
        # Stops accepting connections, then waits for in-flight responses.
        await runner.cleanup()
        await watcher.stop()
        await bus.close()
        with contextlib.suppress(Exception):
            await redis_client.aclose()
        telemetry.shutdown()
