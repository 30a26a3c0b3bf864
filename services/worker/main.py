"""Wiring of the worker process: config in, connected `WorkerService` out."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import msgspec
import structlog

from contracts import subjects
from contracts.messages import KvTransfer, StepTime, WorkerRegistration, WorkerRole
from services.worker.amx import request_amx_permission
from services.worker.engines.base import Engine, EngineConfigError, EngineFacts
from services.worker.engines.sim import SimEngine
from shared.kv.links import advertised_kv_transfer, get_link
from shared.kv.step_profile import get_profile
from services.worker.batched_state import BatchedClusterState
from services.worker.metrics import WorkerMetrics
from services.worker.service import WorkerService
from shared.adapter_store import AdapterCache, AdapterStore, BaseShape, default_adapter_dir
from shared.bus import Bus
from shared.config import KvlaneConfig, LoraSettings, WorkerSettings
from shared.metrics_http import serve_metrics
from shared.model_store import with_published_tokenizer
from shared.runner import ServiceMain, announce_ready
from shared.state import ClusterState, connect_redis
from shared.telemetry import SHUTDOWN_FLUSH_S, Telemetry
from shared.tokenizer import HF_PREFIX, SimTokenizer
from shared.tokenizer_spec import load_tokenizer

log = structlog.get_logger("kvlane.worker")


def worker_id_from(config: KvlaneConfig) -> str:
    worker_id = config.worker.worker_id or f"w-{uuid.uuid4().hex[:8]}"
    if not subjects.is_valid_token(worker_id):
        raise SystemExit(f"worker_id {worker_id!r} must be 1-64 characters of A-Z a-z 0-9 _ -")
    return worker_id


def node_ids(worker_id: str, nodes: int) -> list[str]:
    """The id of each node the process hosts: the worker id itself for one, else `<worker_id>-<k>`."""
    if nodes == 1:
        return [worker_id]
    ids = [f"{worker_id}-{index}" for index in range(nodes)]
    if not subjects.is_valid_token(ids[-1]):
        raise SystemExit(f"worker_id {worker_id!r} with {nodes} nodes makes node ids such as {ids[-1]!r}, longer than 64 characters")
    return ids


def node_settings(settings: WorkerSettings, index: int) -> WorkerSettings:
    """The settings of the process's `index`th node: its own sampling seed, so nodes do not all generate alike."""
    if index == 0:
        return settings
    return msgspec.structs.replace(settings, sim=msgspec.structs.replace(settings.sim, seed=settings.sim.seed + index))


def command_line_overrides(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """`--engine` and `--nodes` as the KVLANE__WORKER__* variables they stand for, and the arguments left."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--engine", choices=["sim", "vllm"])
    parser.add_argument("--nodes", type=int)
    known, rest = parser.parse_known_args(list(argv))
    overrides = {}
    if known.engine is not None:
        overrides["KVLANE__WORKER__ENGINE"] = json.dumps(known.engine)
    if known.nodes is not None:
        overrides["KVLANE__WORKER__NODES"] = str(known.nodes)
    return rest, overrides


def build_engine(settings: WorkerSettings) -> tuple[Engine, EngineFacts]:
    """The configured engine, not started; raises `EngineConfigError` for a configuration that can never work."""
    if settings.engine == "vllm":
        from services.worker.engines.vllm_setup import build_vllm_engine
        from services.worker.served_tokenizer import served_tokenizer

        engine, facts = build_vllm_engine(settings)
        # With worker.vllm.chat_template: the model's tokenizer files rendering with it, advertised and published.
        return engine, msgspec.structs.replace(facts, tokenizer=served_tokenizer(facts.tokenizer, settings.vllm.chat_template))
    tokenizer = SimTokenizer()
    advertised = sim_prompt_tokenizer(settings.sim.tokenizer) if settings.sim.tokenizer else tokenizer.name
    facts = EngineFacts(settings.model, settings.sim.block_size, settings.sim.max_model_len, advertised)
    try:
        return SimEngine(settings.sim, tokenizer, lora=settings.lora), facts
    except KeyError as exc:  # an unknown profile or link names the known ones
        raise EngineConfigError(str(exc.args[0])) from None


def sim_prompt_tokenizer(spec: str) -> str:
    """`worker.sim.tokenizer` as advertised ("hf:<absolute dir>"), once it loads and its ids fit the sim's vocabulary."""
    if spec.startswith(HF_PREFIX):
        spec = HF_PREFIX + str(Path(spec[len(HF_PREFIX):]).expanduser().resolve())
    try:
        vocab_size = load_tokenizer(spec).vocab_size
    except ValueError as exc:
        raise EngineConfigError(f"worker.sim.tokenizer: {exc}") from None
    if vocab_size > SimTokenizer.vocab_size:
        raise EngineConfigError(f"worker.sim.tokenizer: {spec} has {vocab_size} token ids, the sim engine takes at most {SimTokenizer.vocab_size}")
    return spec


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


def advertised_kv_transfer_of(settings: WorkerSettings) -> KvTransfer | None:
    """How a sim worker's KV moves (its profile's KV size over `worker.sim.kv_link`); a vLLM worker does not say."""
    if settings.engine != "sim":
        return None
    try:
        profile, link = get_profile(settings.sim.profile), get_link(settings.sim.kv_link)
    except KeyError as exc:
        raise EngineConfigError(f"worker.sim: {exc.args[0]}") from None
    return advertised_kv_transfer(profile.kv_bytes_per_token, link, settings.sim.speed)


def advertised_tool_call_parser(settings: WorkerSettings) -> str:
    """The tool-call parser a worker's answers go through: a vLLM worker's, as `vllm serve`, uses `tool_call_parser`
    only with `enable_auto_tool_choice`; a sim worker's is `worker.sim.tool_call_parser` (its own format)."""
    if settings.engine == "sim":
        return settings.sim.tool_call_parser
    vllm = settings.vllm
    return vllm.tool_call_parser if vllm.enable_auto_tool_choice else ""


def adapter_cache(bus: Bus, lora: LoraSettings, model_directory: str) -> AdapterCache | None:
    """Where the worker keeps the adapters it fetched, checked against its model's shapes; None: it serves no adapter."""
    if not lora.max_loras:
        return None
    base = None
    if model_directory:
        try:
            base = BaseShape.of_config(json.loads((Path(model_directory) / "config.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            _fail(f"worker.lora: cannot read the model's shapes from {model_directory}/config.json: {exc}")
    directory = Path(lora.cache_dir).expanduser() if lora.cache_dir else default_adapter_dir()
    return AdapterCache(AdapterStore(bus.client), directory, base)


# The exit status of a worker whose engine died: not a configuration error (2), a failure to restart from.
ENGINE_DEAD_EXIT_CODE = 1


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
    ids = node_ids(worker_id, settings.nodes)
    if len(ids) > 1 and settings.engine != "sim":
        _fail(f"worker.nodes = {settings.nodes}: only the sim engine hosts several nodes in one process")
    structlog.contextvars.bind_contextvars(worker_id=worker_id)
    # Before any engine (and its subprocesses, which inherit it) may run an AMX kernel.
    request_amx_permission()
    try:
        engines = [build_engine(node_settings(settings, index)) for index in range(len(ids))]
        step_time = advertised_step_time(settings)
    except EngineConfigError as exc:
        _fail(str(exc))
    started_at, host = time.time(), f"{socket.gethostname()}:{os.getpid()}"
    registrations = [
        WorkerRegistration(
            worker_id=node_id,
            role=settings.role,
            model=facts.model,
            engine=settings.engine,
            inbox=subjects.worker_inbox(node_id),
            block_size=facts.block_size,
            max_model_len=facts.max_model_len,
            tokenizer=facts.tokenizer,
            started_at=started_at,
            host=host,
            max_num_seqs=settings.sim.max_num_seqs if settings.engine == "sim" else 0,
            step_time=step_time,
            kv_transfer=advertised_kv_transfer_of(settings),
            tool_call_parser=advertised_tool_call_parser(settings),
            reasoning_parser=settings.vllm.reasoning_parser if settings.engine == "vllm" else "",
            max_loras=settings.lora.max_loras,
            max_cpu_loras=max(settings.lora.max_cpu_loras, settings.lora.max_loras),
            kv_share=settings.shares_kv,
        )
        for node_id, (_, facts) in zip(ids, engines, strict=True)
    ]
    # kvlane-worker, kvlane-prefill-worker or kvlane-decode-worker in traces.
    service_name = "worker" if settings.role == "aggregated" else f"{settings.role}-worker"
    telemetry = Telemetry(config.tracing, service_name, instance_id=worker_id)
    redis_client = connect_redis(config.redis)
    bus = await Bus.connect(config.nats, f"kvlane-worker-{worker_id}", telemetry)
    # Before registering: an ingress without the model directory finds the tokenizer on the bus.
    registrations = [await with_published_tokenizer(bus.client, registration) for registration in registrations]
    if len(ids) > 1:  # the nodes' Redis keys in one round trip per tenth of a heartbeat interval
        state = BatchedClusterState(redis_client, config.cluster.heartbeat_ttl_s, config.cluster.heartbeat_interval_s / 10)
    else:
        state = ClusterState(redis_client, config.cluster.heartbeat_ttl_s)
    # The nodes of one process share its connections and its metrics (one /metrics per process).
    metrics = WorkerMetrics()
    services = [
        WorkerService(registration, engine, bus, state, config.cluster, settings, metrics=metrics, tracer=telemetry.tracer,
                      adapters=adapter_cache(bus, settings.lora, facts.model_directory))
        for registration, (engine, facts) in zip(registrations, engines, strict=True)
    ]
    metrics.count_in_flight(lambda: sum(service.in_flight for service in services))
    metrics_runner = None
    engine_death: str | None = None
    try:
        if settings.metrics_port:  # before the worker is announced ready
            metrics_runner = await serve_metrics(metrics.registry, settings.metrics_host, settings.metrics_port)
        try:
            for service in services:
                await service.start()
                announce_ready(model=service.registration.model, inbox=service.registration.inbox)
                if len(services) > 1:
                    # Spread the nodes' heartbeats over the interval, as independent hosts would be,
                    # rather than all at the same instant in bursts on NATS and Redis.
                    await asyncio.sleep(config.cluster.heartbeat_interval_s / len(services))
        except EngineConfigError as exc:
            await asyncio.gather(*(engine.shutdown() for engine, _ in engines), return_exceptions=True)
            _fail(str(exc))
        engine_death = await _serve_until_stopped(services, stop)
        # A node whose engine died has left already: a drain would only get in its way.
        await asyncio.gather(*(service.drain(settings.drain_timeout_s) for service in services if not service.engine_dead))
    finally:
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await bus.close()
        with contextlib.suppress(Exception):
            await redis_client.aclose()
        if not telemetry.shutdown():
            log.warning("telemetry_not_flushed", endpoint=config.tracing.otlp_endpoint, waited_s=SHUTDOWN_FLUSH_S)
    if engine_death is not None:
        print(f"kvlane worker: {engine_death}; the worker left the cluster and exits to be restarted", file=sys.stderr, flush=True)
        raise SystemExit(ENGINE_DEAD_EXIT_CODE)


async def _serve_until_stopped(services: Sequence[WorkerService], stop: asyncio.Event) -> str | None:
    """Serve until asked to stop (None) or until an engine died and its node left (why it died)."""
    stopped = asyncio.ensure_future(stop.wait())
    deaths = [asyncio.ensure_future(service.engine_death()) for service in services]
    try:
        await asyncio.wait({stopped, *deaths}, return_when=asyncio.FIRST_COMPLETED)
        for service, died in zip(services, deaths, strict=True):
            if service.engine_dead:
                return await died
        return None
    finally:
        for waiter in (stopped, *deaths):
            waiter.cancel()
