"""Wiring of the worker process: config in, connected `WorkerService` out."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
import uuid
from typing import NoReturn

import msgspec
import structlog

from contracts import subjects
from contracts.messages import StepTime, WorkerRegistration, WorkerRole
from services.worker.amx import request_amx_permission
from services.worker.engines.base import Engine, EngineConfigError, EngineFacts
from services.worker.engines.sim import SimEngine
from shared.step_profile import get_profile
from services.worker.service import WorkerService
from shared.bus import Bus
from shared.config import KvlaneConfig, WorkerSettings
from shared.metrics_http import serve_metrics
from shared.runner import ServiceMain
from shared.state import ClusterState, connect_redis
from shared.telemetry import Telemetry
from shared.tokenizer import SimTokenizer

log = structlog.get_logger("kvlane.worker")


def worker_id_from(config: KvlaneConfig) -> str:
    worker_id = config.worker.worker_id or f"w-{uuid.uuid4().hex[:8]}"
    if not subjects.is_valid_token(worker_id):
        raise SystemExit(f"worker_id {worker_id!r} must be 1-64 characters of A-Z a-z 0-9 _ -")
    return worker_id


def build_engine(settings: WorkerSettings) -> tuple[Engine, EngineFacts]:
    """The configured engine, not started; raises `EngineConfigError` for a configuration that can never work."""
    if settings.engine == "vllm":
        from services.worker.engines.vllm_setup import build_vllm_engine

        return build_vllm_engine(settings)
    tokenizer = SimTokenizer()
    facts = EngineFacts(settings.model, settings.sim.block_size, settings.sim.max_model_len, tokenizer.name)
    try:
        return SimEngine(settings.sim, tokenizer), facts
    except KeyError as exc:  # an unknown profile or link names the known ones
        raise EngineConfigError(str(exc.args[0])) from None


def advertised_step_time(settings: WorkerSettings) -> StepTime | None:
    """What a step costs here in wall seconds: `worker.step_profile`, else a sim worker's own profile."""
    name = settings.step_profile or (settings.sim.profile if settings.engine == "sim" else "")
    if not name:
        return None
    try:
        profile = get_profile(name)
    except KeyError as exc:
        raise EngineConfigError(f"worker.step_profile: {exc.args[0]}") from None
    # A sim worker runs its profile `speed` times faster than the GPU it models.
    speed = settings.sim.speed if settings.engine == "sim" else 1.0
    return StepTime(a=profile.a / speed, b=profile.b / speed, c=profile.c / speed, d=profile.d / speed,
                    per_request=profile.per_request / speed)


def _fail(message: str) -> NoReturn:
    # One line that names the problem, and exit 2 as for any configuration error.
    print(f"kvlane worker: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def main_for_role(role: WorkerRole) -> ServiceMain:
    """`main` for a worker that always runs as `role` (the prefill-worker and decode-worker services)."""

    async def main_with_role(config: KvlaneConfig, stop: asyncio.Event) -> None:
        worker = msgspec.structs.replace(config.worker, role=role)
        await main(msgspec.structs.replace(config, worker=worker), stop)

    return main_with_role


async def main(config: KvlaneConfig, stop: asyncio.Event) -> None:
    settings = config.worker
    worker_id = worker_id_from(config)
    structlog.contextvars.bind_contextvars(worker_id=worker_id)
    # Before any engine (and its subprocesses, which inherit it) may run an AMX kernel.
    request_amx_permission()
    try:
        engine, facts = build_engine(settings)
        step_time = advertised_step_time(settings)
    except EngineConfigError as exc:
        _fail(str(exc))
    registration = WorkerRegistration(
        worker_id=worker_id,
        role=settings.role,
        model=facts.model,
        engine=settings.engine,
        inbox=subjects.worker_inbox(worker_id),
        block_size=facts.block_size,
        max_model_len=facts.max_model_len,
        tokenizer=facts.tokenizer,
        started_at=time.time(),
        host=f"{socket.gethostname()}:{os.getpid()}",
        max_num_seqs=settings.sim.max_num_seqs if settings.engine == "sim" else 0,
        step_time=step_time,
    )
    # kvlane-worker, kvlane-prefill-worker or kvlane-decode-worker in traces.
    service_name = "worker" if settings.role == "aggregated" else f"{settings.role}-worker"
    telemetry = Telemetry(config.tracing, service_name, instance_id=worker_id)
    redis_client = connect_redis(config.redis)
    bus = await Bus.connect(config.nats, f"kvlane-worker-{worker_id}", telemetry)
    state = ClusterState(redis_client, config.cluster.heartbeat_ttl_s)
    service = WorkerService(registration, engine, bus, state, config.cluster, settings, tracer=telemetry.tracer)
    metrics_runner = None
    try:
        if settings.metrics_port:  # before start(), which announces the worker ready
            metrics_runner = await serve_metrics(service.metrics.registry, settings.metrics_host, settings.metrics_port)
        try:
            await service.start()
        except EngineConfigError as exc:
            await engine.shutdown()
            _fail(str(exc))
        await stop.wait()
        await service.drain(settings.drain_timeout_s)
    finally:
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await bus.close()
        with contextlib.suppress(Exception):
            await redis_client.aclose()
        telemetry.shutdown()
