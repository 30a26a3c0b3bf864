"""Wiring of the autoscaler process."""

from __future__ import annotations

import asyncio
import uuid

from services.autoscaler.service import AutoscalerService
from shared.config import KvlaneConfig
from shared.metrics_http import serve_metrics
from shared.runner import announce_ready
from shared.service_context import service_context


async def main(config: KvlaneConfig, stop: asyncio.Event) -> None:
    autoscaler_id = f"a-{uuid.uuid4().hex[:8]}"
    settings = config.autoscaler
    async with service_context(config, "autoscaler", autoscaler_id) as ctx:
        service = AutoscalerService(settings, ctx.bus, ctx.view, ctx.redis, autoscaler_id)
        metrics_runner = None
        try:
            await service.start()
            if settings.metrics_port:
                metrics_runner = await serve_metrics(service.metrics.registry, settings.metrics_host, settings.metrics_port)
            announce_ready(autoscaler_id=autoscaler_id)
            await stop.wait()
        finally:
            await service.stop()
            if metrics_runner is not None:
                await metrics_runner.cleanup()
