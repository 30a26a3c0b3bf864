"""Three balancer replicas, one Redis (or Redis Cluster) and one NATS, concurrent load: no chain is ever oversubscribed."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import msgspec
import openai
import pytest
from rich.console import Console

from contracts import subjects
from contracts.messages import Heartbeat
from launch.fleet import with_overrides
from launch.launcher import free_port, wait_services_ready
from kvlane.status import fetch_statuses, render_status
from services.balancer.slot_store import RedisSlotStore
from shared.kv.block_ledger import BlockLedger
from shared.config import RedisSettings, to_env
from shared.state import connect_redis
from tests.integration.conftest import MODEL, flush, launch, stop_and_check
from tests.waiting import until

pytestmark = pytest.mark.integration

SLOTS = 2


def decisions(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(v) for v in re.findall(r'^kvlane_balancer_decisions_total\{[^}]*\} ([0-9.e+]+)$', text, re.M))


async def test_three_replicas_never_oversubscribe_a_chain(tmp_path: Path, redis_backend: RedisSettings) -> None:
    def tune(config):
        return with_overrides(config, **{"balancer.slots": {"max_per_chain": SLOTS}})

    await flush(redis_backend)
    fleet = launch(tmp_path, workers=2, tune=tune, speed=0.1, redis=redis_backend)
    try:
        ports = [free_port(), free_port()]
        for index, port in enumerate(ports, start=1):
            env = to_env(fleet.config) | {"KVLANE__BALANCER__METRICS_PORT": str(port)}
            fleet.balancers.append(fleet.launcher.start_service("balancer", env, name=f"balancer-{index}"))
        wait_services_ready(fleet.balancers)
        client = connect_redis(fleet.config.redis)
        worst_reserved: dict[str, int] = {}
        worst_running: dict[str, int] = {}
        done = asyncio.Event()

        async def sample() -> None:
            decoder = msgspec.json.Decoder(Heartbeat)
            while not done.is_set():
                async for key in client.scan_iter(match=f"{subjects.REDIS_PREFIX}:slots:*"):
                    count = await client.zcard(key)
                    worst_reserved[key.decode()] = max(worst_reserved.get(key.decode(), 0), count)
                for worker_id in ("w0", "w1"):
                    raw = await client.get(subjects.node_key(worker_id))
                    if raw:
                        running = decoder.decode(raw).stats.running
                        worst_running[worker_id] = max(worst_running.get(worker_id, 0), running)
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        api = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i: int) -> int:
            reply = await api.completions.create(model=MODEL, prompt=f"replica load {i}", max_tokens=12)
            return reply.usage.completion_tokens

        results = await asyncio.gather(*(one(i) for i in range(30)))
        done.set()
        await sampler
        assert results == [12] * 30
        assert worst_reserved and max(worst_reserved.values()) <= SLOTS, worst_reserved
        assert set(worst_running) == {"w0", "w1"} and max(worst_running.values()) <= SLOTS, worst_running
        # The slots were saturated (the test pushed against the limit) ...
        assert max(worst_reserved.values()) == SLOTS
        # ... and the replicas shared the work.
        assert sum(decisions(port) for port in ports) > 0
        # Every slot came back once the requests ended (the releases follow the replies, a batch at a time).
        leftover: dict[str, int] = {}

        async def slots_back() -> bool:
            async for key in client.scan_iter(match=f"{subjects.REDIS_PREFIX}:slots:*"):
                leftover[key.decode()] = await client.zcard(key)
            return sum(leftover.values()) == 0

        await until(slots_back, 5, lambda: f"slots still held: {leftover}")
        # And every KV lease, freed with its slot by the replicas, long before the leases would lapse.
        ledger = BlockLedger(client, fleet.config.cache_manager.lease_ttl_s)

        async def leases_back() -> bool:
            return set((await ledger.usage(["w0", "w1"])).values()) == {(0, 0, 0)}

        await until(leases_back, 5, "the leases were given back")
        await client.aclose()
        # `kvlane status` shows every replica, not the one a queue group picks.
        statuses = await fetch_statuses(fleet.config.nats.url)
        assert len({s.balancer_id for s in statuses}) == 3
        console = Console(record=True, width=200)
        render_status(statuses, console)
        text = console.export_text()
        assert "3 balancer replica(s)" in text and all(s.balancer_id in text for s in statuses)
    finally:
        stop_and_check(fleet)


async def test_slot_store_releases_a_batch_in_one_pipeline(redis_backend: RedisSettings) -> None:
    await flush(redis_backend)
    client = connect_redis(redis_backend)
    try:
        store = RedisSlotStore(client)
        far = 4_000_000_000.0
        for request_id, chain in (("r1", "w0@1"), ("r2", "w0@1"), ("r3", "w1@1")):
            assert (await store.reserve(request_id, chain, SLOTS, far))[0]
        assert not (await store.reserve("r4", "w0@1", SLOTS, far))[0]  # w0's two slots are taken
        await client.script_flush()  # as after a Redis restart: the batch loads its script again
        released = await store.release_many([("r1", "w0"), ("r3", "w9"), ("r2", "w0"), ("r1", "w0"), ("never", "w1")])
        # r3 is held on another worker's chain than the one that says it finished: kept.
        assert released == [("w0@1", 1), None, ("w0@1", 0), None, None]
        assert await store.usage(["w0@1", "w1@1"], 0.0) == {"w0@1": 0, "w1@1": 1}
    finally:
        await client.aclose()
