"""Wiring of the cache-manager process."""

from __future__ import annotations

import asyncio
import uuid

from shared.kv.block_ledger import BlockLedger
from services.cache_manager.metrics import CacheMetrics
from services.cache_manager.service import CacheManagerService, prewarm_leadership
from shared.config import KvlaneConfig
from shared.metrics_http import serve_metrics
from shared.runner import announce_ready
from shared.service_context import service_context


async def main(config: KvlaneConfig, stop: asyncio.Event) -> None:
    settings = config.cache_manager
    manager_id = f"c-{uuid.uuid4().hex[:8]}"
    async with service_context(config, "cache-manager", manager_id) as ctx:
        metrics = CacheMetrics()
        ledger = BlockLedger(ctx.redis, settings.lease_ttl_s)
        service = CacheManagerService(settings, ctx.bus, ctx.view, ledger, metrics, manager_id, tracer=ctx.telemetry.tracer,
                                      prewarm_leader=prewarm_leadership(ctx.redis, settings, manager_id))
        metrics_runner = None
        try:
            await service.start()
            if settings.metrics_port:
                metrics_runner = await serve_metrics(metrics.registry, settings.metrics_host, settings.metrics_port)
            announce_ready(manager_id=manager_id)
            await stop.wait()
        finally:
            await service.stop()
            if metrics_runner is not None:
                await metrics_runner.cleanup()
