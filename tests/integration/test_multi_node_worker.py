"""One sim worker process hosting several nodes (`worker.nodes`), and heartbeats that carry the registration only now and then."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import nats
import pytest

from contracts import subjects
from contracts.messages import Heartbeat, HeartbeatMessage, LoadReport, RequestFinished
from launch.fleet import Fleet, with_overrides
from launch.launcher import servers_available
from shared.bus import Bus
from shared.cluster import ClusterView, ClusterWatcher
from shared.config import TracingSettings
from shared.state import ClusterState, connect_redis
from shared.telemetry import Telemetry
from tests.waiting import until
from tests.integration.conftest import MODEL, launch, stop_and_check

pytestmark = pytest.mark.skipif(not servers_available(), reason="nats-server or redis-server not installed")

NODES = 4
FULL_EVERY = 4


@pytest.fixture(scope="module")
def four_node_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One worker process with four nodes, routed round robin so that every node gets requests."""

    def tune(config):
        return with_overrides(config, worker={"nodes": NODES}, balancer={"policy": "round_robin"},
                              cluster={"full_heartbeat_every": FULL_EVERY})

    fleet = launch(tmp_path_factory.mktemp("nodes"), workers=1, tune=tune)
    yield fleet
    stop_and_check(fleet)


async def _collect(url: str, subject: str, decoder: msgspec.msgpack.Decoder, into: list) -> nats.NATS:
    nc = await nats.connect(url)

    async def on_message(msg) -> None:
        into.append(decoder.decode(msg.data))

    await nc.subscribe(subject, cb=on_message)
    await nc.flush()
    return nc


def test_one_process_registers_each_node_and_each_serves_a_routed_request(four_node_fleet: Fleet) -> None:
    fleet = four_node_fleet
    assert len(fleet.workers) == 1
    expected = {f"w0-{k}" for k in range(NODES)}

    async def scenario() -> tuple[set[str], set[str], set[str]]:
        finished: list[RequestFinished] = []
        nc = await _collect(fleet.config.nats.url, subjects.REQUEST_FINISHED, msgspec.msgpack.Decoder(RequestFinished), finished)
        redis_client = connect_redis(fleet.config.redis)
        try:
            state = ClusterState(redis_client, fleet.config.cluster.heartbeat_ttl_s)
            live: list = []

            async def all_live() -> bool:
                # A node whose heartbeat is late on a busy host drops out of Redis for a moment: wait for all four.
                live[:] = await state.live_heartbeats()
                return {item.heartbeat.registration.worker_id for item in live} >= expected

            await until(all_live, 30, lambda: f"live in Redis: {sorted(i.heartbeat.registration.worker_id for i in live)}")
            hosts = {item.heartbeat.registration.host for item in live}
            inboxes = {item.heartbeat.registration.inbox for item in live}
            body = {"model": MODEL, "prompt": "hello nodes", "max_tokens": 2}

            def served() -> set[str]:
                return {f.worker_id for f in finished if f.finish_reason == "length"}

            async with aiohttp.ClientSession() as session:
                # Round robin over four nodes: a handful of requests reaches each; more only if one was busy or
                # briefly out of routing (a late heartbeat).
                deadline = time.monotonic() + 30
                while not served() >= expected and time.monotonic() < deadline:
                    async with session.post(f"{fleet.base_url}/v1/completions", json=body) as response:
                        assert response.status == 200, await response.text()
            await until(lambda: served() >= expected, 5, lambda: f"finished on {sorted(served())}")
            return served(), hosts, inboxes
        finally:
            await nc.close()
            await redis_client.aclose()

    served, hosts, inboxes = asyncio.run(scenario())
    assert served == expected
    assert len(hosts) == 1, f"the nodes should share one process: {hosts}"
    assert inboxes == {subjects.worker_inbox(worker_id) for worker_id in expected}


def test_heartbeats_on_the_bus_carry_the_registration_every_nth_time(four_node_fleet: Fleet) -> None:
    fleet = four_node_fleet

    async def scenario() -> list[HeartbeatMessage]:
        beats: list[HeartbeatMessage] = []
        nc = await _collect(fleet.config.nats.url, subjects.HEARTBEAT_ALL, msgspec.msgpack.Decoder(HeartbeatMessage), beats)
        try:
            # Enough beats for two full heartbeats from each node.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                full = [b for b in beats if isinstance(b, Heartbeat)]
                if all(sum(b.worker_id == f"w0-{k}" for b in full) >= 2 for k in range(NODES)):
                    break
                await asyncio.sleep(0.05)
            return list(beats)
        finally:
            await nc.close()

    beats = asyncio.run(scenario())
    for k in range(NODES):
        mine = [b for b in beats if b.worker_id == f"w0-{k}"]
        full = [b for b in mine if isinstance(b, Heartbeat)]
        assert len(full) >= 2, f"w0-{k}: {len(full)} full heartbeats in {len(mine)}"
        loads = [b for b in mine if isinstance(b, LoadReport)]
        # Between two full heartbeats, FULL_EVERY - 1 load reports that name the same registration.
        between = [b for b in loads if full[0].seq < b.seq < full[1].seq]
        assert full[1].seq - full[0].seq == FULL_EVERY
        assert len(between) == FULL_EVERY - 1
        assert {b.registration_digest for b in between} == {full[0].registration_digest}


def test_a_watcher_that_starts_late_learns_every_registration_without_redis(four_node_fleet: Fleet) -> None:
    """No Redis resync here: only the periodic full heartbeat can teach it the registrations."""
    fleet = four_node_fleet

    async def scenario() -> ClusterView:
        view = ClusterView(fleet.config.cluster.heartbeat_ttl_s)
        nc = await nats.connect(fleet.config.nats.url)
        decoder = msgspec.msgpack.Decoder(HeartbeatMessage)
        learned = asyncio.Event()

        async def on_message(msg) -> None:
            heartbeat = view.assemble(decoder.decode(msg.data))
            if heartbeat is not None:
                view.observe(heartbeat, time.monotonic())
            if len(view.live(time.monotonic())) == NODES:
                learned.set()

        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_message)
        try:
            await asyncio.wait_for(learned.wait(), timeout=FULL_EVERY * fleet.config.cluster.heartbeat_interval_s * 4 + 5)
        finally:
            await nc.close()
        return view

    view = asyncio.run(scenario())
    live = view.live(time.monotonic())
    assert {hb.registration.worker_id for hb in live} == {f"w0-{k}" for k in range(NODES)}
    assert all(hb.registration.model == MODEL and hb.registration.block_size > 0 for hb in live)


def test_a_watcher_that_starts_late_learns_every_registration_from_redis_at_once(four_node_fleet: Fleet) -> None:
    fleet = four_node_fleet

    async def scenario() -> tuple[set[str], int]:
        telemetry = Telemetry(TracingSettings(), "test")
        bus = await Bus.connect(fleet.config.nats, "late-watcher", telemetry)
        redis_client = connect_redis(fleet.config.redis)
        view = ClusterView(fleet.config.cluster.heartbeat_ttl_s)
        # A resync interval far beyond the test: only the resync at start can have taught it.
        watcher = ClusterWatcher(bus, ClusterState(redis_client, fleet.config.cluster.heartbeat_ttl_s), view, 3600)
        try:
            await watcher.start()
            known = {hb.registration.worker_id for hb in view.live(time.monotonic())}
            seqs = {hb.registration.worker_id: hb.seq for hb in view.live(time.monotonic())}
            # Load reports now join those registrations: every node's view moves on without a full heartbeat.
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if all(hb.seq > seqs[hb.registration.worker_id] for hb in view.live(time.monotonic())):
                    break
                await asyncio.sleep(0.02)
            moved = sum(hb.seq > seqs[hb.registration.worker_id] for hb in view.live(time.monotonic()))
            return known, moved
        finally:
            await watcher.stop()
            await bus.close()
            await redis_client.aclose()

    known, moved = asyncio.run(scenario())
    assert known == {f"w0-{k}" for k in range(NODES)}
    assert moved == NODES


def test_a_vllm_worker_refuses_several_nodes(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "services.worker", "--engine", "vllm", "--nodes", "2"], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).resolve().parents[2],
                          env={"KVLANE__NATS__URL": "nats://127.0.0.1:1", "PATH": ""})
    assert done.returncode == 2
    assert "only the sim engine hosts several nodes" in done.stderr


def test_batched_heartbeats_reach_redis_in_one_round_trip_and_fail_loudly(tmp_path: Path) -> None:
    from contracts.messages import EngineStats, WorkerRegistration
    from launch.launcher import Launcher, free_port
    from services.worker.batched_state import BatchedClusterState
    from shared.config import RedisSettings

    def beat(worker_id: str, seq: int) -> Heartbeat:
        registration = WorkerRegistration(worker_id=worker_id, role="aggregated", model=MODEL, engine="sim", inbox=subjects.worker_inbox(worker_id),
                                          block_size=16, max_model_len=4096, tokenizer="sim", started_at=1.0)
        return Heartbeat(registration, EngineStats(running=seq), time.time(), seq)

    launcher = Launcher(tmp_path)
    port = free_port()
    redis_server = launcher.start_redis(port)

    async def scenario() -> tuple[dict[str, int], int, BaseException | None]:
        client = connect_redis(RedisSettings(url=f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.5))
        state = BatchedClusterState(client, ttl_s=3.0, window_s=0.05)
        sent = 0
        original = state.put_heartbeats

        async def counted(heartbeats: list[Heartbeat]) -> None:
            nonlocal sent
            sent += 1
            await original(heartbeats)

        state.put_heartbeats = counted  # type: ignore[method-assign]
        try:
            await asyncio.gather(state.put_heartbeat(beat("a", 1)), state.put_heartbeat(beat("b", 1)), state.put_heartbeat(beat("a", 2)))
            live = {item.heartbeat.registration.worker_id: item.heartbeat.seq for item in await state.live_heartbeats()}
            round_trips = sent
            redis_server.stop()
            failure = None
            try:
                await asyncio.wait_for(state.put_heartbeat(beat("a", 3)), 10)
            except Exception as exc:  # what the worker's heartbeat catches: RedisError or OSError
                failure = exc
            return live, round_trips, failure
        finally:
            await client.aclose()

    try:
        live, round_trips, failure = asyncio.run(scenario())
    finally:
        launcher.stop_all()
    assert live == {"a": 2, "b": 1}
    assert round_trips == 1
    from redis.exceptions import RedisError

    assert isinstance(failure, RedisError | OSError), repr(failure)
