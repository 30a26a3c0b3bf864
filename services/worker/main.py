"""Wiring of the worker process: config in, connected `WorkerService` out."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid

import structlog

from contracts import subjects
from contracts.messages import WorkerRegistration
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerService
from shared.bus import Bus
from shared.config import KvlaneConfig
from shared.state import ClusterState, connect_redis
from shared.telemetry import Telemetry
from shared.tokenizer import SimTokenizer

log = structlog.get_logger("kvlane.worker")


def worker_id_from(config: KvlaneConfig) -> str:
    worker_id = config.worker.worker_id or f"w-{uuid.uuid4().hex[:8]}"
    if not subjects.is_valid_token(worker_id):
        raise SystemExit(f"worker_id {worker_id!r} must be 1-64 characters of A-Z a-z 0-9 _ -")
    return worker_id


async def main(config: KvlaneConfig, stop: asyncio.Event) -> None:
    settings = config.worker
    worker_id = worker_id_from(config)
    structlog.contextvars.bind_contextvars(worker_id=worker_id)
    tokenizer = SimTokenizer()
    engine = SimEngine(settings.sim, tokenizer)
    registration = WorkerRegistration(
        worker_id=worker_id,
        role=settings.role,
        model=settings.model,
        engine=settings.engine,
        inbox=subjects.worker_inbox(worker_id),
        block_size=settings.sim.block_size,
        max_model_len=settings.sim.max_model_len,
        tokenizer=tokenizer.name,
        started_at=time.time(),
        host=f"{socket.gethostname()}:{os.getpid()}",
    )
    telemetry = Telemetry(config.tracing, "worker")
    redis_client = connect_redis(config.redis)
    bus = await Bus.connect(config.nats, f"kvlane-worker-{worker_id}", telemetry)
    service = WorkerService(registration, engine, bus, ClusterState(redis_client, config.cluster.heartbeat_ttl_s), config.cluster)
    try:
        await service.start()
        await stop.wait()
        await service.drain(settings.drain_timeout_s)
    finally:
        await bus.close()
        with contextlib.suppress(Exception):
            await redis_client.aclose()
        telemetry.shutdown()
