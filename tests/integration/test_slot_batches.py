"""Slot reservations asked for together go to Redis in one pipeline: each stays atomic, none over-commits."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import redis.asyncio as redis
import redis.exceptions
from redis.exceptions import ResponseError

from contracts.messages import RequestFinished, RouteDecision, Usage
from services.balancer.metrics import BalancerMetrics
from services.balancer.service import BalancerService
from services.balancer.slot_store import RedisSlotStore, ScriptBatch
from services.balancer.status import SlotRates
from shared.cluster import ClusterView
from shared.config import RedisSettings
from shared.state import connect_redis
from tests.integration.conftest import flush
from tests.waiting import until
from tests.unit.balancer_fixtures import heartbeat, request, router
from tests.unit.balancer_fixtures import settings as balancer_settings

pytestmark = pytest.mark.integration

FAR = 4_000_000_000.0  # an expiry far in the future


async def test_a_burst_of_reservations_takes_exactly_the_free_slots(redis_client: redis.Redis) -> None:
    store = RedisSlotStore(redis_client)
    assert (await store.reserve("warm-up", "w1@1", 1, FAR))[0]  # the script is loaded by now
    sent = 0
    original_send = store._batch._send

    async def counted(batch):
        nonlocal sent
        sent += 1
        return await original_send(batch)

    store._batch._send = counted  # type: ignore[method-assign]
    outcomes = await asyncio.gather(*(store.reserve(f"r{i}", "w0@1", 5, FAR) for i in range(40)))
    assert sum(taken for taken, _ in outcomes) == 5
    assert sorted(used for taken, used in outcomes if taken) == [1, 2, 3, 4, 5]
    assert all(used == 5 for taken, used in outcomes if not taken)
    assert sent == 1  # the whole burst in one pipeline
    assert await store.usage(["w0@1"], 0.0) == {"w0@1": 5}


async def test_a_failed_call_fails_only_its_caller_and_lost_scripts_are_loaded_again(redis_client: redis.Redis) -> None:
    store = RedisSlotStore(redis_client)
    assert (await store.reserve("r0", "w0@1", 3, FAR))[0]
    await redis_client.script_flush()  # as after a Redis restart
    outcomes = await asyncio.gather(
        store.reserve("r1", "w0@1", 3, FAR),
        store.reserve("r2", "w0@1", "not a number", FAR),  # type: ignore[arg-type]
        store.reserve("r3", "w0@1", 3, FAR),
        return_exceptions=True,
    )
    assert outcomes[0] == (True, 2) and outcomes[2] == (True, 3)
    assert isinstance(outcomes[1], ResponseError)


async def test_a_release_on_a_known_chain_matches_one_that_reads_it(redis_client: redis.Redis) -> None:
    store = RedisSlotStore(redis_client)
    assert (await store.reserve("r1", "w0@1", 2, FAR))[0]
    assert (await store.reserve("r2", "w0@2", 2, FAR))[0]  # r2 is on the node's next chain (it restarted)
    released = await store.release_many(
        [("r1", "w0"), ("r2", "w0"), ("r1", "w0"), ("never", "w1")], ["w0@1", "w0@1", "w0@1", None])
    # r2's known chain is out of date: its key on the node names the one it holds, and that slot is freed.
    assert released == [("w0@1", 0), ("w0@2", 0), None, None]
    assert await store.usage(["w0@1", "w0@2"], 0.0) == {"w0@1": 0, "w0@2": 0}


async def test_a_batch_cut_short_by_the_timeout_leaves_no_reply_for_the_next(redis_backend: RedisSettings) -> None:
    """A batch that outlasts the socket timeout fails its callers; the late replies must not answer the next batch."""
    await flush(redis_backend)
    redis_client = connect_redis(msgspec.structs.replace(redis_backend, socket_timeout_s=0.3))
    try:
        batch = ScriptBatch(redis_client)
        slow = redis_client.register_script(
            "local t0 = redis.call('TIME') local t = t0"
            " while (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) < 600000 do t = redis.call('TIME') end return ARGV[1]")
        echo = redis_client.register_script("return ARGV[1]")
        with pytest.raises((TimeoutError, redis.exceptions.TimeoutError)):
            await batch.call(slow, ["{k}a"], ["late"])
        # Answered once the slow script is over (by a redis_client that waits long enough): its reply is written by now.
        patient = connect_redis(redis_backend)
        await patient.get("{k}a")
        await patient.aclose()
        replies = await asyncio.gather(*(batch.call(echo, ["{k}b"], [f"reply {i}"]) for i in range(5)))
        assert replies == [f"reply {i}".encode() for i in range(5)]
    finally:
        await redis_client.aclose()


async def test_queued_requests_that_slots_free_for_together_are_confirmed_in_one_batch(redis_client: redis.Redis) -> None:
    """A burst of finishes on a full fleet lets as many queued requests out, and their reservations go to the store
    together, not one round trip after another."""
    now = time.time()
    workers = ["a", "b", "c", "d"]
    view, core = ClusterView(60.0), router("round_robin", max_per_chain=1)
    for worker_id in workers:
        hb = heartbeat(worker_id, sent_at=now)
        view.observe(hb, time.monotonic())
        core.observe(hb)
    store = RedisSlotStore(redis_client)
    settings = balancer_settings("round_robin", max_per_chain=1)
    balancer = BalancerService(None, view, core, store, settings, BalancerMetrics(), SlotRates(settings.slots))  # type: ignore[arg-type]
    placed = [await balancer.route(request(f"p{i}", blocks=0)) for i in range(len(workers))]
    assert sorted(reply.worker_id for reply in placed if isinstance(reply, RouteDecision)) == workers
    waiting = [asyncio.create_task(balancer.route(request(f"q{i}", blocks=0))) for i in range(len(workers))]
    await until(lambda: len(balancer.router.queue) == len(workers), 5.0, "every request queued")
    batches = []
    original_send = store._batch._send

    async def counted(batch):
        batches.append(len(batch))
        return await original_send(batch)

    store._batch._send = counted  # type: ignore[method-assign]
    for reply in placed:
        balancer._on_finished(RequestFinished(reply.request_id, reply.worker_id, "stop", Usage(1, 1), 0.1), None)  # type: ignore[arg-type,union-attr]
    replies = await asyncio.wait_for(asyncio.gather(*waiting), 5.0)
    assert sorted(reply.worker_id for reply in replies if isinstance(reply, RouteDecision)) == workers
    # The releases, with the tenants' fair-share charges and settlements made since riding along; then the queued
    # requests' reservations (their charges wait for the next batch or usage read).
    assert len(batches) == 2 and batches[0] >= len(workers) and batches[1] == len(workers), batches
    await balancer.stop()
