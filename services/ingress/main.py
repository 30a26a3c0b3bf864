"""Wiring of the ingress process."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import time
import uuid

import structlog
from aiohttp import web

from contracts import subjects
from contracts.balancer import BalancerStatusReply, BalancerStatusRequest
from contracts.cache import CacheReply, LookupRequest
from services.ingress.adapters import AdapterCatalog
from services.ingress.app import COMPLETION_PATHS, IngressApp
from services.ingress.auth import Authenticator
from services.ingress.balancers import RouteAsker
from services.ingress.completions import Completions
from services.ingress.dispatch import Dispatcher
from services.ingress.http_guard import HttpGuard
from services.ingress.key_limits import KeyLimiter
from services.ingress.metrics import IngressMetrics
from services.ingress.nats_api import NatsApi
from services.ingress.processes import SHARES_PORT_ENV, process_ids
from services.ingress.readiness import Dependency, Readiness
from services.ingress.response_store import ResponseStore
from services.ingress.responses import Responses
from services.ingress.served_events import ServedEvents
from shared.adapter_store import AdapterStore
from shared.api_keys import ApiKeyStore
from shared.bus import StreamReceiver
from shared.config import KvlaneConfig
from shared.model_store import ModelFileCache, default_cache_dir
from shared.periodic import Periodic
from shared.runner import announce_ready
from shared.scale_from_zero import ModelsFromZeroWatcher
from shared.service_context import service_context

log = structlog.get_logger("kvlane.ingress")


async def main(config: KvlaneConfig, stop: asyncio.Event) -> None:
    settings = config.ingress
    if settings.processes > 1:
        raise SystemExit("ingress.processes > 1 runs as sibling processes under a supervising one: "
                         "start the ingress with `python -m services.ingress`")
    try:
        (ingress_id,) = process_ids(settings.ingress_id or f"i-{uuid.uuid4().hex[:8]}", 1)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    async with service_context(config, "ingress", ingress_id) as ctx:
        bus, view = ctx.bus, ctx.view
        streams = StreamReceiver(bus, ingress_id)
        await streams.start()
        # The fleet's per-node metrics come from the heartbeats in `view`, read at each scrape.
        metrics = IngressMetrics(view)
        routes = RouteAsker(bus, config.cluster.heartbeat_ttl_s, settings.liveness_check_s, metrics=metrics)
        dispatcher = Dispatcher(
            bus, streams, settings, lambda worker_id: view.live_start(worker_id, time.monotonic()), config.balancer.queue.max_wait_s,
            metrics=metrics, tracer=ctx.telemetry.tracer, routes=routes,
        )
        dependencies = [Dependency("balancer", subjects.BALANCER_STATUS, BalancerStatusRequest(model="-"), BalancerStatusReply)]
        if config.balancer.allocate_kv:
            # Without one, routes go on without KV leases (the balancer counts them): served, less safely.
            dependencies.append(Dependency("cache-manager", subjects.CACHE_REQUEST, LookupRequest([]), CacheReply, required=False))
        try:  # API keys: in Redis (shared by every replica) and, optionally, a keys file
            auth = Authenticator(settings.auth, ApiKeyStore(ctx.redis), KeyLimiter(ctx.redis))
        except ValueError as exc:
            raise SystemExit(str(exc)) from exc
        served_events = ServedEvents(bus)
        # The models the autoscaler may scale to zero: taken while no worker serves them, not refused with a 404.
        from_zero = ModelsFromZeroWatcher(bus, ctx.redis)
        await from_zero.start()
        completions = Completions(
            settings, view, dispatcher, metrics, telemetry=ctx.telemetry,
            on_served=served_events.add, auth=auth,
            model_files=ModelFileCache(bus.client, settings.model_cache_dir or default_cache_dir()),
            adapters=AdapterCatalog(AdapterStore(bus.client)),
            from_zero=from_zero.models,
        )
        # Stored responses live in Redis: any replica continues any conversation.
        responses = Responses(completions, ResponseStore(ctx.redis, settings.responses_ttl_s), settings.max_tokens_default)
        # Slow clients, oversized heads, too many connections or streams per client (http_guard.py).
        guard = HttpGuard(settings, COMPLETION_PATHS)
        app = IngressApp(settings.max_body_bytes, view, completions, metrics, lambda: bus.connected, Readiness(bus, dependencies),
                         guard=guard, responses=responses)
        nats_api = NatsApi(bus, completions, ingress_id, importlib.metadata.version("kvlane"), responses)
        # handler_cancellation: a client that hangs up cancels its handler at once, so its
        # request is aborted on the worker even while nothing is being written to it
        # (a queue wait, a prefill, output that is not text yet, a non-streamed reply).
        runner = guard.runner(app.build(), access_log=None, shutdown_timeout=settings.request_timeout_s,
                              handler_cancellation=True)
        # A model's tokenizer loads as soon as a worker for it shows up, not on its first request.
        preloading = Periodic("tokenizers", config.cluster.heartbeat_interval_s, completions.preload_tokenizers, immediately=True)
        try:
            await routes.start()
            await runner.setup()
            await nats_api.start()
            preloading.start()
            auth.start()
            # Listening last: a process sharing the port with its siblings joins the kernel's spread of connections
            # only once nothing else in its start can fail; one that failed after listening would reset the
            # connections queued on it.
            shares_port = os.environ.get(SHARES_PORT_ENV) == "1"
            site = web.TCPSite(runner, settings.host, settings.port, reuse_port=shares_port or None)
            await site.start()
            log.info("api_keys", required=settings.auth.required, keys_file=settings.auth.keys_file or None)
            announce_ready(host=settings.host, port=settings.port, ingress_id=ingress_id)
            await stop.wait()
        finally:
            await preloading.stop()
            await routes.stop()
            # Both stop taking requests, then wait for those in flight.
            await asyncio.gather(nats_api.stop(settings.request_timeout_s), runner.cleanup())
            await auth.close()  # the last requests' limits settled in Redis
            await served_events.close()
