"""The cache-manager service: replicas against one Redis, lease expiry, bad input."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import defaultdict
from pathlib import Path

import aiohttp
import msgspec
import nats
import pytest
import redis.asyncio as redis

from contracts import subjects
from contracts.cache import (
    AllocateRequest,
    Allocation,
    CacheReply,
    CacheStatus,
    CacheStatusRequest,
    LookupReply,
    LookupRequest,
    PrefixesRouted,
    RoutedPrefix,
)
from contracts.messages import ErrorReply, GenerateRequest, KvEvents, SamplingParams, WorkerRequest
from launch.launcher import wait_services_ready
from shared.kv.block_ledger import BlockLedger, lease_key
from tests.integration.conftest import MODEL, launch
from tests.waiting import until

pytestmark = pytest.mark.integration
NUM_BLOCKS = 64
ENCODE = msgspec.msgpack.encode
REPLY = msgspec.msgpack.Decoder(CacheReply)


def short_leases(config):
    return msgspec.structs.replace(
        config,
        cluster=msgspec.structs.replace(config.cluster, lease_renew_interval_s=0.3),
        cache_manager=msgspec.structs.replace(config.cache_manager, lease_ttl_s=1.5),
    )


async def ask(nc: nats.NATS, request) -> object:
    return REPLY.decode((await nc.request(subjects.CACHE_REQUEST, ENCODE(request), timeout=10)).data)


async def wait_for_managers(nc: nats.NATS, workers: int) -> CacheStatus:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            status = await ask(nc, CacheStatusRequest())
            if isinstance(status, CacheStatus) and len(status.nodes) == workers:
                return status
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("cache-manager not ready")


async def test_three_replicas_never_overcommit_under_1000_concurrent_allocations(tmp_path: Path) -> None:
    fleet = launch(tmp_path, workers=3, num_blocks=NUM_BLOCKS)
    try:
        for _ in range(2):  # the fleet starts one
            fleet.add_cache_manager()
        nc = await nats.connect(fleet.config.nats.url)
        await wait_for_managers(nc, 3)
        rng = random.Random(7)
        requests = [
            AllocateRequest(f"r{i}", MODEL, prompt_tokens=rng.randint(1, 120), max_tokens=rng.randint(1, 40), may_preempt=False)
            for i in range(1000)
        ]
        replies = await asyncio.gather(*(ask(nc, r) for r in requests))
        granted: dict[str, int] = defaultdict(int)
        for reply in replies:
            assert isinstance(reply, Allocation | ErrorReply)
            if isinstance(reply, Allocation):
                granted[reply.worker_id] += reply.blocks
            else:
                assert reply.code == "no_capacity" and reply.status == 503
        client = redis.Redis.from_url(fleet.config.redis.url)
        usage = await BlockLedger(client, 10).usage(["w0", "w1", "w2"])
        await client.aclose()
        short_pool = int(NUM_BLOCKS * fleet.config.cache_manager.short_pool_share)
        for worker_id, (general, short, _) in usage.items():
            assert general <= NUM_BLOCKS - short_pool and short <= short_pool
            assert general + short == granted[worker_id]
        # The fleet was filled, not merely touched.
        assert sum(granted.values()) >= 3 * (NUM_BLOCKS - 10)
        assert sum(isinstance(r, ErrorReply) for r in replies) > 0
        await nc.close()
    finally:
        fleet.stop()


async def test_killed_workers_lease_returns_after_ttl_while_a_live_ones_is_renewed(tmp_path: Path) -> None:
    fleet = launch(tmp_path, workers=2, tune=short_leases)
    try:
        nc = await nats.connect(fleet.config.nats.url)
        await wait_for_managers(nc, 2)
        client = redis.Redis.from_url(fleet.config.redis.url)
        for worker_id in ("w0", "w1"):
            rid = f"long-{worker_id}"
            allocation = await ask(nc, AllocateRequest(rid, MODEL, prompt_tokens=40, max_tokens=4000, worker_id=worker_id))
            assert isinstance(allocation, Allocation) and allocation.worker_id == worker_id
            run = GenerateRequest(rid, MODEL, [20] * 40, SamplingParams(max_tokens=4000), f"kvlane.v1.stream.test.{rid}", 60.0)
            await nc.request(subjects.worker_inbox(worker_id), ENCODE(run), timeout=5)
        await asyncio.sleep(2.5)  # past the TTL: both alive thanks to renewals
        assert await client.exists(lease_key("w0", "long-w0"), lease_key("w1", "long-w1")) == 2
        next(p for p in fleet.workers if p.name == "worker-w0").signal(signal.SIGKILL)
        killed = time.monotonic()
        while await client.exists(lease_key("w0", "long-w0")):
            assert time.monotonic() - killed < 1.5 + 2.0, "lease outlived its TTL"
            await asyncio.sleep(0.1)
        usage = await BlockLedger(client, 10).usage(["w0", "w1"])
        assert usage["w0"] == (0, 0, 0) and usage["w1"][2] == 1
        await client.aclose()
        await nc.close()
    finally:
        fleet.stop()


async def test_bad_input_gets_error_replies_and_the_service_keeps_serving(tmp_path: Path) -> None:
    fleet = launch(tmp_path, workers=1)
    try:
        nc = await nats.connect(fleet.config.nats.url)
        await wait_for_managers(nc, 1)
        bad_payloads = [
            b"\xc1garbage",
            ENCODE({"type": "allocate", "request_id": "x", "model": MODEL, "prompt_tokens": -5, "max_tokens": 4}),
            ENCODE({"type": "allocate", "request_id": "x", "model": MODEL, "prompt_tokens": 5, "max_tokens": 0}),
            ENCODE({"type": "teleport"}),
        ]
        for payload in bad_payloads:
            reply = REPLY.decode((await nc.request(subjects.CACHE_REQUEST, payload, timeout=5)).data)
            assert isinstance(reply, ErrorReply) and reply.code == "bad_request" and reply.status == 400
        unknown = await ask(nc, AllocateRequest("y", MODEL, 10, 4, worker_id="no-such-node"))
        assert isinstance(unknown, ErrorReply) and unknown.code == "unknown_node" and unknown.status == 404
        no_model = await ask(nc, AllocateRequest("z", "other-model", 10, 4))
        assert isinstance(no_model, ErrorReply) and no_model.status == 503
        assert isinstance(await ask(nc, LookupRequest([1, 2, 3])), LookupReply)
        assert isinstance(await ask(nc, AllocateRequest("ok", MODEL, 10, 4)), Allocation)
        await nc.close()
        assert all(p.alive() for p in fleet.services())
    finally:
        fleet.stop()


async def test_the_balancer_leases_kv_itself_and_reports_what_it_placed(tmp_path: Path) -> None:
    """The chosen node has room: the lease comes from the ledger in the balancer's own round trip (the
    cache-manager is stopped meanwhile and need not answer), the balancer frees it when the request ends, and the
    placed prefix goes to the cache-manager for pre-warming."""
    fleet = launch(tmp_path, workers=1, speed=0.2)
    nc = await nats.connect(fleet.config.nats.url)
    client = redis.Redis.from_url(fleet.config.redis.url)
    routed: list[PrefixesRouted] = []
    heard = asyncio.Event()

    async def on_routed(msg) -> None:
        routed.append(msgspec.msgpack.decode(msg.data, type=PrefixesRouted))
        heard.set()

    await nc.subscribe(subjects.CACHE_ROUTED, cb=on_routed)
    await nc.flush()
    prompt = "a shared system prompt that fills a few kv blocks " * 8
    try:
        fleet.cache_managers[0].signal(signal.SIGSTOP)
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "stream": True}
            async with session.post(f"{fleet.base_url}/v1/completions", json=body) as response:
                assert response.status == 200
                request_id = response.headers["X-Request-Id"]
                # While it streams, its lease is in the ledger, on its node.
                lease = await client.hgetall(lease_key("w0", request_id))
                assert lease[b"worker_id"] == b"w0" and int(lease[b"blocks"]) > 0
                text = b"".join([chunk async for chunk in response.content.iter_any()])
        assert b"[DONE]" in text

        async def lease_freed() -> bool:
            return not await client.exists(lease_key("w0", request_id))

        # Well within the lease TTL, and with no cache-manager to reap it: the balancer's release.
        await until(lease_freed, 5, "the balancer freed the finished request's lease")
        await asyncio.wait_for(heard.wait(), timeout=10)
        (prefix,) = routed[0].prefixes
        assert prefix.model == MODEL and prefix.block_hashes and prefix.prefix_token_ids
    finally:
        fleet.cache_managers[0].signal(signal.SIGCONT)
        await client.aclose()
        await nc.close()
        fleet.stop()


async def test_two_replicas_prewarm_a_hot_prefix_once_not_once_each(tmp_path: Path) -> None:
    """Pre-warming sends work to a worker, so only the replica holding the leadership lock plans it."""
    def eager_prewarm(config):
        return msgspec.structs.replace(config, cache_manager=msgspec.structs.replace(
            config.cache_manager, prewarm_min_hits=3, lease_ttl_s=60.0))

    fleet = launch(tmp_path, workers=2, tune=eager_prewarm, num_blocks=NUM_BLOCKS)
    try:
        wait_services_ready([fleet.add_cache_manager()])
        nc = await nats.connect(fleet.config.nats.url)
        await wait_for_managers(nc, 2)
        prewarms: list[str] = []
        first = asyncio.Event()

        async def on_inbox(msg) -> None:
            request_id = msgspec.msgpack.decode(msg.data, type=WorkerRequest).request_id
            if request_id.startswith("prewarm-"):
                prewarms.append(request_id)
                first.set()

        await nc.subscribe(subjects.worker_inbox("w1"), cb=on_inbox)
        await nc.flush()
        # w0 holds the prefix and is busy (past prewarm_high_load); w1 is idle: w1 should get one copy.
        settings = fleet.config.cache_manager
        short = int(NUM_BLOCKS * settings.short_pool_share)
        client = redis.Redis.from_url(fleet.config.redis.url)
        busy = await BlockLedger(client, 60).reserve("busy", "w0", 50, "general", NUM_BLOCKS - short, short, 1.0, 100)
        await client.aclose()
        assert busy.granted
        hashes, tokens = [11, 12, 13, 14], list(range(100, 164))
        await nc.publish(subjects.kv_events("w0"), ENCODE(KvEvents("w0", 1, 16, stored=hashes)))
        for _ in range(settings.prewarm_min_hits + 2):
            await nc.publish(subjects.CACHE_ROUTED, ENCODE(PrefixesRouted([RoutedPrefix(MODEL, hashes, tokens)])))
        await nc.flush()
        await asyncio.wait_for(first.wait(), 15)
        # Absence takes a window: three more maintenance rounds of every replica, each of which would
        # have sent its own copy by then.
        await asyncio.sleep(3 * min(1.0, settings.lease_ttl_s / 4))
        assert len(prewarms) == 1, prewarms
        await nc.close()
    finally:
        fleet.stop()
