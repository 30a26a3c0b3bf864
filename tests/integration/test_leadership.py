"""One replica at a time leads a job (services/cache_manager/leadership.py), against a real redis-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.launcher import Launcher, free_port
from shared.config import RedisSettings
from services.cache_manager.leadership import Leadership
from shared.state import connect_redis

pytestmark = pytest.mark.integration
TTL_S = 0.6


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[tuple[Launcher, int]]:
    launcher = Launcher(tmp_path)
    port = free_port()
    launcher.start_redis(port)
    yield launcher, port
    launcher.stop_all()


async def until_leading(leadership: Leadership, timeout_s: float) -> float:
    started = time.monotonic()
    while not await leadership.leading():
        assert time.monotonic() - started < timeout_s, "never took the lead"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_one_leads_while_it_renews_and_another_takes_over_once_it_stops(redis_server) -> None:
    _, port = redis_server
    client = connect_redis(RedisSettings(url=f"redis://127.0.0.1:{port}/0"))
    first, second = (Leadership(client, "job", holder, TTL_S) for holder in ("c-1", "c-2"))
    try:
        assert await first.leading() and not await second.leading()
        # Renewed twice per TTL, for several TTLs: it keeps the lead.
        for _ in range(8):
            await asyncio.sleep(TTL_S / 3)
            assert await first.leading() and not await second.leading()
        # The leader stalls (asks no more): the other takes over after the TTL, not before.
        stalled = time.monotonic()
        await until_leading(second, 5 * TTL_S)
        assert time.monotonic() - stalled >= TTL_S * 0.8
        assert not await first.leading()  # back from its stall, it has lost the lock and knows it
        # A clean stop hands over at once.
        await second.resign()
        assert await first.leading()
    finally:
        await client.aclose()


async def test_nobody_leads_without_redis_and_one_leads_again_when_it_returns(redis_server) -> None:
    launcher, port = redis_server
    client = connect_redis(RedisSettings(url=f"redis://127.0.0.1:{port}/0"))
    first, second = (Leadership(client, "job", holder, TTL_S) for holder in ("c-1", "c-2"))
    try:
        assert await first.leading()
        next(p for p in launcher.processes if p.name == "redis-server").stop()
        assert not await first.leading() and not await second.leading()
        launcher.start_redis(port)
        await until_leading(second, 10)
        assert not await first.leading()
    finally:
        await client.aclose()


def test_a_lock_needs_a_positive_ttl() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        Leadership(None, "job", "c-1", 0.0)  # type: ignore[arg-type]
