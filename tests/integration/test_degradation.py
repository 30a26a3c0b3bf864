"""Graceful degradation end to end: one sim worker with one slot, a short queue, real ingress and balancer.

Under overload a low-priority request that must queue is answered with
fewer tokens and says so (`kvlane.degraded`, `X-Kvlane-Degraded`); a full
queue gives a low-priority request's place to a higher one, and the
low-priority one gets 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator

import aiohttp
import pytest

from contracts.balancer import BalancerStatus
from launch.fleet import Fleet, with_overrides
from launch.launcher import wait_services_ready
from tests.integration.conftest import MODEL, launch, stop_and_check, until_status

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    def tune(config):
        return with_overrides(config, **{
            "balancer.slots": {"max_per_chain": 1},
            "balancer.queue": {"max_length": 2, "max_wait_s": 20.0},
            # Any wait is overload here: every queued request below priority 1 is degraded.
            "balancer.degradation": {"reduce_max_tokens": True, "ttft_target_s": 0.001, "max_tokens_factor": 0.5,
                                     "min_max_tokens": 4},
        })

    fleet = launch(tmp_path_factory.mktemp("degradation"), workers=1, tune=tune, speed=0.1)  # ~22 ms per token
    wait_services_ready(fleet.balancers)
    yield fleet
    stop_and_check(fleet)


async def complete(session: aiohttp.ClientSession, fleet: Fleet, prompt: str, max_tokens: int, priority: int) -> tuple[int, dict, dict]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "priority": priority, "ignore_eos": True}
    async with session.post(f"{fleet.base_url}/v1/completions", json=body) as response:
        return response.status, await response.json(), dict(response.headers)


def slot_taken(status: BalancerStatus) -> bool:
    return any(chain.slots_used for chain in status.chains)


def queued(n: int) -> Callable[[BalancerStatus], bool]:
    return lambda status: status.queue_length == n


async def test_under_overload_a_low_priority_request_gets_a_shorter_answer_and_is_told(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        holder = asyncio.create_task(complete(session, fleet, "holder", 40, priority=1))
        await until_status(fleet, slot_taken)
        low = asyncio.create_task(complete(session, fleet, "low", 40, priority=0))
        await until_status(fleet, queued(1))
        high = asyncio.create_task(complete(session, fleet, "high", 40, priority=1))
        (_, held, _), (low_status, low_body, low_headers), (high_status, high_body, high_headers) = await asyncio.gather(holder, low, high)
    assert held["usage"]["completion_tokens"] == 40
    assert low_status == 200 and low_body["usage"]["completion_tokens"] == 20 and low_body["choices"][0]["finish_reason"] == "length"
    assert low_body["kvlane"] == {"degraded": {"reason": "overload", "max_tokens": 20, "requested_max_tokens": 40}}
    assert low_headers["X-Kvlane-Degraded"] == "reason=overload; max_tokens=20; requested_max_tokens=40"
    # Priority 1 is not below the threshold: it waited for its whole answer, and nothing says otherwise.
    assert high_status == 200 and high_body["usage"]["completion_tokens"] == 40
    assert "kvlane" not in high_body and "X-Kvlane-Degraded" not in high_headers


async def test_a_streamed_answer_says_so_in_its_closing_chunk(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        holder = asyncio.create_task(complete(session, fleet, "holder", 30, priority=1))
        await until_status(fleet, slot_taken)
        body = {"model": MODEL, "prompt": "low", "max_tokens": 12, "stream": True, "ignore_eos": True}
        async with session.post(f"{fleet.base_url}/v1/completions", json=body) as response:
            header = response.headers.get("X-Kvlane-Degraded")
            events = [line for line in (await response.text()).split("\n\n") if line.startswith("data: {")]
        await holder
    chunks = [json.loads(event.removeprefix("data: ")) for event in events]
    closing = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert closing["kvlane"]["degraded"]["max_tokens"] == 6 and header.startswith("reason=overload")
    assert all("kvlane" not in c for c in chunks if c is not closing)
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) == 6


async def test_a_full_queue_gives_the_newest_low_priority_place_to_a_higher_one(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        holder = asyncio.create_task(complete(session, fleet, "holder", 40, priority=1))
        await until_status(fleet, slot_taken)
        older = asyncio.create_task(complete(session, fleet, "older", 8, priority=0))
        await until_status(fleet, queued(1))
        newer = asyncio.create_task(complete(session, fleet, "newer", 8, priority=0))
        await until_status(fleet, queued(2))  # full
        vip = asyncio.create_task(complete(session, fleet, "vip", 8, priority=2))
        (_, _, _), older_reply, newer_reply, vip_reply = await asyncio.gather(holder, older, newer, vip)
    status, body, headers = newer_reply
    assert status == 429 and body["error"]["code"] == "overloaded" and body["error"]["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1
    assert vip_reply[0] == 200 and older_reply[0] == 200
