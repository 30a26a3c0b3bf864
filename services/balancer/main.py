"""Wiring of the balancer process."""

from __future__ import annotations

import asyncio
import uuid

from services.balancer.allocation import KvAllocator
from services.balancer.building import build_router, fallback_step_model
from services.balancer.from_zero import FromZero
from services.balancer.metrics import BalancerMetrics
from services.balancer.service import BalancerService
from services.balancer.slot_store import LocalSlotStore, RedisSlotStore
from services.balancer.status import SlotRates
from shared.kv.block_ledger import BlockLedger
from shared.config import KvlaneConfig
from shared.metrics_http import serve_metrics
from shared.runner import announce_ready
from shared.scale_from_zero import ModelsFromZeroWatcher
from shared.service_context import service_context


async def main(config: KvlaneConfig, stop: asyncio.Event) -> None:
    settings = config.balancer
    model = fallback_step_model(settings.speed.fallback_profile)
    balancer_id = f"b-{uuid.uuid4().hex[:8]}"
    async with service_context(config, "balancer", balancer_id) as ctx:
        metrics = BalancerMetrics()
        allocator = None
        if settings.allocate_kv:
            ledger = BlockLedger(ctx.redis, config.cache_manager.lease_ttl_s)
            allocator = KvAllocator(ctx.bus, settings.allocate_timeout_s, ledger, config.cache_manager, tracer=ctx.telemetry.tracer)
        # Whatever frees a request's slot frees its KV lease: the Redis store in the slot's own script.
        store = (RedisSlotStore(ctx.redis) if settings.slots.store == "redis"
                 else LocalSlotStore(allocator.release_many if allocator is not None else None))
        router = build_router(settings, model)
        metrics.track_degradation(router.degradation.counts)
        metrics.track_prefix_pulls(router.pulls.choices, router.pulls.pulled_bytes)
        # The models the autoscaler may scale to zero: their requests wait for a worker rather than get a 404.
        from_zero = ModelsFromZeroWatcher(ctx.bus, ctx.redis)
        await from_zero.start()
        service = BalancerService(
            ctx.bus, ctx.view, router, store, settings, metrics, SlotRates(settings.slots), allocator, balancer_id,
            tracer=ctx.telemetry.tracer, heartbeat_interval_s=config.cluster.heartbeat_interval_s,
            from_zero=FromZero(from_zero.models),
        )
        # Heartbeats reach the balancer through the watcher that keeps `ctx.view`: decoded and recorded once.
        ctx.watcher.add_heartbeat_listener(service.heard)
        metrics_runner = None
        try:
            await service.start()
            if settings.metrics_port:
                metrics_runner = await serve_metrics(metrics.registry, settings.metrics_host, settings.metrics_port)
            announce_ready(balancer_id=balancer_id, policy=settings.policy, slot_store=settings.slots.store)
            await stop.wait()
        finally:
            # Queued route requests are refused here; closing the bus then answers those already received.
            await service.stop()
            if metrics_runner is not None:
                await metrics_runner.cleanup()
