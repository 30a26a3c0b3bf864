"""Wiring of the health-prober process."""

from __future__ import annotations

import asyncio
import uuid

from contracts import subjects
from services.health_prober.service import HealthProberService
from shared.bus import StreamReceiver
from shared.config import KvlaneConfig
from shared.metrics_http import serve_metrics
from shared.runner import announce_ready
from shared.service_context import service_context


async def main(config: KvlaneConfig, stop: asyncio.Event) -> None:
    prober_id = config.health.prober_id or f"h-{uuid.uuid4().hex[:8]}"
    if not subjects.is_valid_token(prober_id):
        raise SystemExit(f"health.prober_id {prober_id!r} must be 1-64 characters of A-Z a-z 0-9 _ -")
    async with service_context(config, "health-prober", prober_id) as ctx:
        streams = StreamReceiver(ctx.bus, prober_id)
        await streams.start()
        service = HealthProberService(config.health, ctx.bus, ctx.view, streams, ctx.redis)
        metrics_runner = None
        try:
            await service.start()
            if config.health.metrics_port:
                metrics_runner = await serve_metrics(service.metrics.registry, config.health.metrics_host, config.health.metrics_port)
            announce_ready(prober_id=prober_id)
            await stop.wait()
        finally:
            await service.stop()
            if metrics_runner is not None:
                await metrics_runner.cleanup()
