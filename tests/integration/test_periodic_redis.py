"""Housekeeping loops that talk to a real Redis stop when told, wherever the stop lands.

redis-py's asyncio client can lose a CancelledError that arrives mid-command
(the command returns normally). A loop stopped by cancellation alone then ran
for ever, and its service hung at SIGTERM until it was killed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.launcher import Launcher, free_port
from shared.config import RedisSettings
from shared.periodic import Periodic
from shared.state import ClusterState, connect_redis

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    launcher = Launcher(Path(tmp_path_factory.mktemp("redis")))
    port = free_port()
    launcher.start_redis(port)
    yield f"redis://127.0.0.1:{port}/0"
    launcher.stop_all()


async def test_a_redis_housekeeping_loop_stops_within_a_second_every_time(redis_url: str) -> None:
    client = connect_redis(RedisSettings(url=redis_url))
    state = ClusterState(client, ttl_s=3.0)
    rounds = 0

    async def resync() -> None:
        nonlocal rounds
        rounds += 1
        await state.live_heartbeats()

    rng = random.Random(7)
    for _ in range(150):
        # A zero interval keeps a Redis command in flight nearly all the time.
        periodic = Periodic("resync", 0.0, resync, immediately=True)
        periodic.start()
        await asyncio.sleep(rng.random() * 0.004)
        await asyncio.wait_for(periodic.stop(), 1.0)  # TimeoutError: this stop hung
    assert rounds > 150  # the stops did land while commands ran
    await client.aclose()
