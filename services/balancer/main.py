"""Wiring of the balancer process."""

from __future__ import annotations

import asyncio
import uuid

from services.balancer.allocation import KvAllocator
from services.balancer.central_queue import CentralQueue
from services.balancer.metrics import BalancerMetrics
from services.balancer.policies import make_policy
from services.balancer.router import Router
from services.balancer.service import BalancerService
from services.balancer.slot_store import LocalSlotStore, RedisSlotStore
from services.balancer.slot_table import SlotTable
from services.balancer.snapshot import SnapshotBuilder
from services.balancer.speed import StepModel
from services.balancer.status import SlotRates
from services.balancer.trackers import QueueGrowth, SpeedTracker
from shared.block_ledger import BlockLedger
from shared.config import BalancerSettings, KvlaneConfig
from shared.metrics_http import serve_metrics
from shared.prefix_index import PrefixIndex
from shared.runner import announce_ready
from shared.service_context import service_context
from shared.step_profile import get_profile


def fallback_step_model(profile_name: str) -> StepModel:
    """The named sim profile's coefficients: what a node is assumed to do before it is measured."""
    try:
        profile = get_profile(profile_name)
    except KeyError as exc:
        raise SystemExit(f"balancer.speed.fallback_profile: {exc.args[0]}") from None
    return StepModel(a=profile.a, b=profile.b, c=profile.c, d=profile.d, per_request=profile.per_request)


def build_router(settings: BalancerSettings, model: StepModel, use_index: bool = True) -> Router:
    """The routing core; `use_index=False` decides on a fresh snapshot per request (benchmarks compare the two)."""
    speed = SpeedTracker(model, settings.speed.smoothing, settings.speed.equal_within)
    builder = SnapshotBuilder(settings, speed, QueueGrowth(settings.speed.smoothing))
    return Router(
        make_policy(settings.policy, settings),
        builder,
        PrefixIndex(settings.prefix_index_max_blocks),
        SlotTable(),
        CentralQueue(settings.queue.max_length),
        settings.queue,
        settings.disaggregation,
        settings.degradation,
        use_index=use_index,
    )


async def main(config: KvlaneConfig, stop: asyncio.Event) -> None:
    settings = config.balancer
    model = fallback_step_model(settings.speed.fallback_profile)
    balancer_id = f"b-{uuid.uuid4().hex[:8]}"
    async with service_context(config, "balancer", balancer_id) as ctx:
        # With leases, slot and lease of a finished request go in one script (the cache-managers then leave them).
        store = RedisSlotStore(ctx.redis, settings.releases_kv_leases) if settings.slots.store == "redis" else LocalSlotStore()
        metrics = BalancerMetrics()
        allocator = None
        if settings.allocate_kv:
            ledger = BlockLedger(ctx.redis, config.cache_manager.lease_ttl_s)
            allocator = KvAllocator(ctx.bus, settings.allocate_timeout_s, ledger, config.cache_manager, tracer=ctx.telemetry.tracer)
        router = build_router(settings, model)
        metrics.track_degradation(router.degradation.counts)
        service = BalancerService(
            ctx.bus, ctx.view, router, store, settings, metrics, SlotRates(settings.slots), allocator, balancer_id,
            tracer=ctx.telemetry.tracer, heartbeat_interval_s=config.cluster.heartbeat_interval_s,
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
