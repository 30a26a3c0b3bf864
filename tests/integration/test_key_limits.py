"""The per-key limiter's Lua scripts (services/ingress/key_limits.py) against a real redis-server.

Time is a fake clock passed to the scripts (milliseconds), so a window of
60 s is crossed without waiting; one test runs on Redis's own clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as redis

from launch.launcher import Launcher, free_port
from shared.api_keys import ApiKeyStore, KeyRecord, make_record, record_key
from services.ingress.key_limits import KeyLimiter, Verdict, limit_keys

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    launcher = Launcher(Path(tmp_path_factory.mktemp("redis")))
    port = free_port()
    launcher.start_redis(port)
    yield port
    launcher.stop_all()


@pytest.fixture
async def client(redis_port: int) -> AsyncIterator[redis.Redis]:
    client = redis.Redis(port=redis_port)
    await client.flushdb()
    yield client
    await client.aclose()


class Clock:
    def __init__(self) -> None:
        self.ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.ms


def record(**limits: int) -> KeyRecord:
    return make_record("acme", **limits)[0]


async def admit_all(limiter: KeyLimiter, key: KeyRecord, count: int, cost: int = 1, ttl_s: float = 30.0,
                    prefix: str = "r") -> list[Verdict]:
    return [await limiter.admit(key, f"{prefix}{i}", cost, ttl_s) for i in range(count)]


async def test_requests_per_minute_is_a_sliding_window(client: redis.Redis) -> None:
    clock = Clock()
    limiter, key = KeyLimiter(client, clock_ms=clock), record(rpm=3)
    assert [v.admitted for v in await admit_all(limiter, key, 2)] == [True, True]
    clock.ms += 20_000
    assert (await limiter.admit(key, "r2", 1, 30)).admitted
    refused = await limiter.admit(key, "r3", 1, 30)
    # The oldest admission (20 s ago) leaves the window 40 s from now.
    assert refused == Verdict(False, "rpm", 40.0)
    clock.ms += 39_999
    assert not (await limiter.admit(key, "r4", 1, 30)).admitted
    clock.ms += 1
    # Both admissions of the first instant aged out together: two places.
    assert [v.admitted for v in await admit_all(limiter, key, 3, prefix="s")] == [True, True, False]


async def test_tokens_per_minute_reserve_then_correct(client: redis.Redis) -> None:
    clock = Clock()
    limiter, key = KeyLimiter(client, clock_ms=clock), record(tpm=100)
    assert (await limiter.admit(key, "a", 60, 30)).admitted
    clock.ms += 10_000
    assert (await limiter.admit(key, "b", 30, 30)).admitted
    # 90 counted: 20 more do not fit; they will when "a" (60 tokens) leaves the window, 50 s from now.
    assert await limiter.admit(key, "c", 20, 30) == Verdict(False, "tpm", 50.0)
    # 75 would need "b" gone too: 60 s from now.
    assert await limiter.admit(key, "c", 75, 30) == Verdict(False, "tpm", 60.0)
    # More than the whole limit can never fit: no Retry-After.
    assert await limiter.admit(key, "huge", 101, 30) == Verdict(False, "too_large", None)
    # "a" reserved 60 but used 25: corrected, 35 tokens are free again.
    await limiter.settle(key.id, "a", 25)
    assert (await limiter.admit(key, "c", 45, 30)).admitted
    assert int(await client.get(limit_keys(key.id)[2])) == 25 + 30 + 45
    # A settle for a request no longer in the window changes nothing.
    await limiter.settle(key.id, "gone", 1)
    assert int(await client.get(limit_keys(key.id)[2])) == 100
    clock.ms += 60_000
    assert (await limiter.admit(key, "d", 100, 30)).admitted  # "a" and "b" aged out, "c" too
    assert int(await client.get(limit_keys(key.id)[2])) == 100
    assert await client.hkeys(limit_keys(key.id)[1]) == [b"d"]


async def test_concurrency_slots_are_released_by_settle_or_expire(client: redis.Redis) -> None:
    clock = Clock()
    limiter, key = KeyLimiter(client, clock_ms=clock), record(max_concurrency=2)
    assert [v.admitted for v in await admit_all(limiter, key, 2, ttl_s=10)] == [True, True]
    assert await limiter.admit(key, "x", 1, 10) == Verdict(False, "concurrency", 1.0)
    await limiter.settle(key.id, "r0", None)
    assert (await limiter.admit(key, "x", 1, 10)).admitted
    assert not (await limiter.admit(key, "y", 1, 10)).admitted
    # "r1" is renewed by its ingress; "x" belongs to one that crashed: only "x" expires.
    clock.ms += 6_000
    await limiter.renew({key.id: ["r1"]}, 10)
    clock.ms += 4_000
    assert (await limiter.admit(key, "y", 1, 10)).admitted
    assert sorted(await client.zrange(limit_keys(key.id)[3], 0, -1)) == [b"r1", b"y"]
    # Renewing a request already settled does not bring its slot back.
    await limiter.settle(key.id, "y", None)
    await limiter.renew({key.id: ["y"]}, 10)
    assert await client.zrange(limit_keys(key.id)[3], 0, -1) == [b"r1"]


async def test_a_refusal_counts_nothing(client: redis.Redis) -> None:
    clock = Clock()
    limiter, key = KeyLimiter(client, clock_ms=clock), record(rpm=10, tpm=50, max_concurrency=1)
    assert (await limiter.admit(key, "a", 40, 30)).admitted
    assert (await limiter.admit(key, "b", 5, 30)).reason == "concurrency"
    await limiter.settle(key.id, "a", None)
    assert (await limiter.admit(key, "b", 20, 30)).reason == "tpm"
    window, tokens, total, inflight = limit_keys(key.id)
    assert await client.zcard(window) == 1 and int(await client.get(total)) == 40 and await client.zcard(inflight) == 0


async def test_every_key_expires_when_idle(client: redis.Redis) -> None:
    limiter, key = KeyLimiter(client), record(rpm=5, tpm=500, max_concurrency=2)
    assert (await limiter.admit(key, "a", 10, 5)).admitted
    ttls = [await client.pttl(name) for name in limit_keys(key.id)]
    assert all(0 < ttl <= 61_000 for ttl in ttls[:3]) and 0 < ttls[3] <= 6_000


async def test_replicas_admitting_at_once_never_exceed_the_limits(client: redis.Redis, redis_port: int) -> None:
    """Two clients (as two ingress replicas) race for one key: the script's check-and-count is atomic."""
    other = redis.Redis(port=redis_port)
    try:
        replicas = [KeyLimiter(client), KeyLimiter(other)]  # Redis's own clock
        key = record(rpm=25, tpm=10_000, max_concurrency=40)
        verdicts = await asyncio.gather(*(replicas[i % 2].admit(key, f"r{i}", 10, 30) for i in range(60)))
        assert sum(v.admitted for v in verdicts) == 25
        assert {v.reason for v in verdicts if not v.admitted} == {"rpm"}
        assert all(55 <= v.retry_after_s <= 60 for v in verdicts if not v.admitted)
        tight = record(max_concurrency=7)
        verdicts = await asyncio.gather(*(replicas[i % 2].admit(tight, f"c{i}", 1, 30) for i in range(50)))
        assert sum(v.admitted for v in verdicts) == 7
    finally:
        await other.aclose()


async def test_the_key_store(client: redis.Redis) -> None:
    store = ApiKeyStore(client)
    first, key = make_record("acme", rpm=5, models=["m"])
    second, _ = make_record("beta")
    assert await store.add(first) and await store.add(second)
    assert not await store.add(first)  # ids are unique
    assert await store.get(first.id) == first
    assert [r.id for r in await store.list()] == sorted([first.id, second.id])
    raw = await client.get(record_key(first.id))
    assert key.encode() not in raw and key[17:].encode() not in raw
    assert await store.revoke(first.id) and not await store.revoke(first.id)
    assert await store.get(first.id) is None and [r.id for r in await store.list()] == [second.id]
