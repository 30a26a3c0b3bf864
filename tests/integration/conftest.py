"""Fixtures that start real servers: nats-server, redis-server and kvlane services.

Each fleet gets its own NATS and Redis on free ports, so fleets never see
each other's workers and fault tests may kill or restart servers freely.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest
import uvloop
from redis.asyncio import Redis

from contracts import subjects
from contracts.balancer import BalancerStatus, BalancerStatusReply, BalancerStatusRequest
from launch.fleet import Fleet, start_fleet
from launch.launcher import Launcher, free_port
from shared.config import (
    ClusterSettings,
    IngressSettings,
    KvlaneConfig,
    LoggingSettings,
    NatsSettings,
    RedisSettings,
    SimSettings,
    WorkerSettings,
)
from shared.kv.block_ledger import BlockLedger
from shared.state import connect_redis
from tests.integration.redis_cluster import redis_cluster
from tests.waiting import until

FAST_HEARTBEATS = {"heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0, "resync_interval_s": 0.5}
MODEL = "kvlane-sim"


def fleet_config(nats_port: int, redis_port: int, redis: RedisSettings | None = None, **sim: object) -> KvlaneConfig:
    return KvlaneConfig(
        nats=NatsSettings(url=f"nats://127.0.0.1:{nats_port}"),
        redis=redis or RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0"),
        logging=LoggingSettings(format="json", level="info"),
        cluster=ClusterSettings(**FAST_HEARTBEATS),
        ingress=IngressSettings(port=free_port(), stall_timeout_s=10.0),
        worker=WorkerSettings(drain_timeout_s=20.0, sim=SimSettings(**sim)),
    )


def launch(
    log_dir: Path,
    workers: int = 2,
    tune: Callable[[KvlaneConfig], KvlaneConfig] | None = None,
    prefill_workers: int = 0,
    decode_workers: int = 0,
    cache_managers: int = 1,
    redis: RedisSettings | None = None,
    jetstream: bool = False,
    **sim: object,
) -> Fleet:
    """A fleet on its own NATS and Redis; `tune` may adjust the config first.

    `redis`: a Redis (or Redis Cluster) started already, instead of a Redis of the fleet's own.
    `jetstream`: NATS with JetStream (its object store carries tokenizers and LoRA adapters)."""
    launcher = Launcher(log_dir)
    nats_port, redis_port = free_port(), free_port()
    try:
        launcher.start_nats(nats_port, extra_args=["-js", "-sd", str(log_dir / "jetstream")] if jetstream else None)
        if redis is None:
            launcher.start_redis(redis_port)
        config = fleet_config(nats_port, redis_port, redis, **sim)
        return start_fleet(launcher, tune(config) if tune else config, workers,
                           prefill_workers=prefill_workers, decode_workers=decode_workers, cache_managers=cache_managers)
    except BaseException:
        launcher.stop_all()
        raise


def stop_and_check(fleet: Fleet) -> None:
    crashed = [p for p in fleet.services() if not p.alive() and p.popen.returncode not in (0, -9)]
    fleet.stop()
    assert not crashed, "\n".join(f"{p.name} exited {p.popen.returncode}:\n{p.log_tail()}" for p in crashed)


@pytest.fixture(scope="module", params=["single", "cluster"])
def redis_backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSettings]:
    """The settings that reach one redis-server, then a real three-master Redis Cluster: tests taking it run on both."""
    folder = Path(tmp_path_factory.mktemp(f"redis-{request.param}"))
    if request.param == "cluster":
        with redis_cluster(folder) as ports:
            yield RedisSettings(url=f"redis://127.0.0.1:{ports[0]}/0", mode="cluster")
        return
    launcher = Launcher(folder)
    port = free_port()
    launcher.start_redis(port)
    try:
        yield RedisSettings(url=f"redis://127.0.0.1:{port}/0")
    finally:
        launcher.stop_all()


async def flush(settings: RedisSettings) -> None:
    client = connect_redis(settings)
    await client.flushall()
    await client.aclose()


@pytest.fixture
async def redis_client(redis_backend: RedisSettings) -> AsyncIterator[Redis]:
    """A client of an emptied Redis (single or cluster)."""
    await flush(redis_backend)
    client = connect_redis(redis_backend)
    yield client
    await client.aclose()


@pytest.fixture(scope="module")
def shared_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two workers, for tests that do not harm the fleet."""
    fleet = launch(tmp_path_factory.mktemp("fleet"))
    yield fleet
    stop_and_check(fleet)


@pytest.fixture
def own_fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Two workers, for tests that kill or stop something."""
    fleet = launch(tmp_path)
    yield fleet
    stop_and_check(fleet)


def client_of(fleet: Fleet, timeout_s: float = 60.0) -> openai.AsyncOpenAI:
    """An OpenAI client of the fleet's ingress that never retries: a test sees every error."""
    return openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)


async def until_status(fleet: Fleet, holds: Callable[[BalancerStatus], bool], timeout_s: float = 10.0,
                       query: BalancerStatusRequest | None = None) -> None:
    """Until a balancer's status (in answer to `query`) satisfies `holds` (polled, bounded by `timeout_s`)."""
    request = msgspec.msgpack.encode(query or BalancerStatusRequest())
    nc = await nats.connect(fleet.config.nats.url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = await nc.request(subjects.BALANCER_STATUS, request, timeout=5)
            status = msgspec.msgpack.decode(msg.data, type=BalancerStatusReply)
            if isinstance(status, BalancerStatus) and holds(status):
                return
            assert time.monotonic() < deadline, f"the balancer never reached the state: {status}"
            await asyncio.sleep(0.02)
    finally:
        await nc.close()


async def run_leased(fleet: Fleet, ledger: BlockLedger, workers: list[str], requests: int, prompt: str) -> None:
    """`requests` requests of 30 tokens at once: a KV lease is seen in `ledger` while they run, and each is served whole."""
    api = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(i: int) -> int:
        reply = await api.completions.create(model=MODEL, prompt=f"{prompt} {i}", max_tokens=30)
        return reply.usage.completion_tokens

    running = asyncio.gather(*(one(i) for i in range(requests)))

    async def leased() -> bool:
        return any(count for _, _, count in (await ledger.usage(workers)).values())

    await until(leased, 30, "no KV lease taken")
    assert await running == [30] * requests


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The tests' clients run on uvloop, as kvlane's services and load generators do.

    On asyncio's own loop, after the fault tests had run in the same loop,
    200 streams opened at once lost a few of their sockets' read
    registrations: the transport still read, the loop no longer polled the
    descriptor, and the whole answer sat in the socket until the read timeout.
    """
    return {"uvloop": uvloop.new_event_loop}


def start_kvlane_up(config: Path, port: int, log_dir: Path, *options: str) -> subprocess.Popen:
    """`kvlane up --config config --port port --log-dir log_dir *options`, its output (text) on `stdout`."""
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "kvlane"), "up", "--config", str(config), "--port", str(port),
         "--log-dir", str(log_dir), *options],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"},
    )


def stop_kvlane_up(up: subprocess.Popen) -> None:
    """Stop `kvlane up` as Ctrl-C does; killed if it has not stopped within a minute."""
    up.send_signal(signal.SIGINT)
    try:
        up.wait(60)
    except subprocess.TimeoutExpired:
        up.kill()
