"""Slot reservations asked for together go to Redis in one pipeline: each stays atomic, none over-commits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis
from redis.exceptions import ResponseError

from services.balancer.slot_store import RedisSlotStore
from shared.config import RedisSettings
from shared.state import connect_redis
from tests.integration.test_balancer_replicas import flush

pytestmark = pytest.mark.integration

FAR = 4_000_000_000.0  # an expiry far in the future


@pytest.fixture
async def client(redis_backend: RedisSettings) -> AsyncIterator[redis.Redis]:
    """A client of an emptied Redis (single or cluster)."""
    await flush(redis_backend)
    client = connect_redis(redis_backend)
    yield client
    await client.aclose()


async def test_a_burst_of_reservations_takes_exactly_the_free_slots(client: redis.Redis) -> None:
    store = RedisSlotStore(client)
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


async def test_a_failed_call_fails_only_its_caller_and_lost_scripts_are_loaded_again(client: redis.Redis) -> None:
    store = RedisSlotStore(client)
    assert (await store.reserve("r0", "w0@1", 3, FAR))[0]
    await client.script_flush()  # as after a Redis restart
    outcomes = await asyncio.gather(
        store.reserve("r1", "w0@1", 3, FAR),
        store.reserve("r2", "w0@1", "not a number", FAR),  # type: ignore[arg-type]
        store.reserve("r3", "w0@1", 3, FAR),
        return_exceptions=True,
    )
    assert outcomes[0] == (True, 2) and outcomes[2] == (True, 3)
    assert isinstance(outcomes[1], ResponseError)


async def test_a_release_on_a_known_chain_matches_one_that_reads_it(client: redis.Redis) -> None:
    store = RedisSlotStore(client)
    assert (await store.reserve("r1", "w0@1", 2, FAR))[0]
    assert (await store.reserve("r2", "w0@2", 2, FAR))[0]  # r2 is on the node's next chain (it restarted)
    released = await store.release_many(
        [("r1", "w0"), ("r2", "w0"), ("r1", "w0"), ("never", "w1")], ["w0@1", "w0@1", "w0@1", None])
    # r2's known chain is out of date: its key on the node names the one it holds, and that slot is freed.
    assert released == [("w0@1", 0), ("w0@2", 0), None, None]
    assert await store.usage(["w0@1", "w0@2"], 0.0) == {"w0@1": 0, "w0@2": 0}
