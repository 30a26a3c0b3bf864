"""A request sent while no balancer runs is held until one starts, then served (`ingress.balancer_wait_s`)."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import aiohttp
import pytest

from launch.fleet import with_overrides
from launch.launcher import wait_services_ready
from tests.integration.conftest import MODEL, launch, stop_and_check
from tests.waiting import until

pytestmark = pytest.mark.integration

WAITS = re.compile(r"^kvlane_ingress_balancer_waits_total (\S+)$", re.MULTILINE)


async def balancer_waits(base_url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{base_url}/metrics") as response:
        found = WAITS.search(await response.text())
    return float(found.group(1)) if found else 0.0


async def test_a_request_sent_while_no_balancer_runs_completes_once_one_starts(tmp_path: Path) -> None:
    # Long enough for a balancer to start on a busy machine: the request must outwait it, not time out.
    fleet = launch(tmp_path, workers=1, tune=lambda c: with_overrides(c, ingress={"balancer_wait_s": 60.0}))
    try:
        (balancer,) = fleet.balancers
        balancer.signal(signal.SIGTERM)
        assert balancer.wait_exit(30) == 0
        fleet.balancers.clear()

        async def complete() -> tuple[int, str]:
            async with aiohttp.ClientSession() as session:
                body = {"model": MODEL, "prompt": "held until a balancer starts", "max_tokens": 4}
                async with session.post(f"{fleet.base_url}/v1/completions", json=body) as response:
                    return response.status, await response.text()

        sent = asyncio.create_task(complete())
        await until(lambda: balancer_waits(fleet.base_url), 30, "the request held for a balancer")
        assert not sent.done()
        await asyncio.to_thread(lambda: wait_services_ready([fleet.add_balancer()]))
        status, text = await asyncio.wait_for(sent, 60)
        assert status == 200, text
        assert await balancer_waits(fleet.base_url) >= 1
    finally:
        stop_and_check(fleet)
