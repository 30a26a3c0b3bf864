"""The central queue end to end: one sim worker with one slot, real ingress and balancer."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterator

import aiohttp
import msgspec
import pytest

from contracts import subjects
from contracts.balancer import BalancerStatus, BalancerStatusReply, BalancerStatusRequest
from launch.fleet import Fleet, with_overrides
from launch.launcher import wait_services_ready
from tests.integration.conftest import MODEL, launch, stop_and_check, until_status

pytestmark = pytest.mark.integration

QUEUE_WAIT_S = 1.5


@pytest.fixture(scope="module")
def one_slot_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One worker, one slot, 22 ms per generated token, queue limit 1.5 s."""

    def tune(config):
        return with_overrides(config, **{"balancer.slots": {"max_per_chain": 1}, "balancer.queue": {"max_wait_s": QUEUE_WAIT_S}})

    fleet = launch(tmp_path_factory.mktemp("one-slot"), workers=1, tune=tune, speed=0.1)
    wait_services_ready(fleet.balancers)
    yield fleet
    stop_and_check(fleet)


async def complete(session: aiohttp.ClientSession, fleet: Fleet, prompt: str, max_tokens: int) -> tuple[int, dict, float]:
    started = time.monotonic()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    async with session.post(f"{fleet.base_url}/v1/completions", json=body) as response:
        payload = await response.json()
        return response.status, {"payload": payload, "retry_after": response.headers.get("Retry-After")}, time.monotonic() - started


async def test_a_queued_request_is_served_when_the_slot_frees(one_slot_fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(complete(session, one_slot_fleet, "first", 20))
        await asyncio.sleep(0.15)
        second = asyncio.create_task(complete(session, one_slot_fleet, "second", 5))
        (status_1, reply_1, took_1), (status_2, reply_2, took_2) = await asyncio.gather(first, second)
    assert (status_1, status_2) == (200, 200), (reply_1, reply_2)
    assert reply_2["payload"]["usage"]["completion_tokens"] == 5
    # The second could only start once the first (about 0.45 s of tokens) ended.
    assert took_2 + 0.15 >= took_1 - 0.05, (took_1, took_2)
    # The balancer told ingress how long it queued, and ingress exports it as vLLM's queue time.
    async with aiohttp.ClientSession() as session, session.get(f"{one_slot_fleet.base_url}/metrics") as response:
        exposition = await response.text()
    queued_s = float(re.search(r'^vllm:request_queue_time_seconds_sum\{model_name="kvlane-sim"\} (\S+)$', exposition, re.M)[1])
    assert 0 < queued_s <= took_2, (queued_s, took_2)  # only the second waited, and not longer than it took


async def test_a_request_past_its_queue_deadline_gets_503_with_retry_after(one_slot_fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        long = asyncio.create_task(complete(session, one_slot_fleet, "long", 150))  # about 3.3 s
        await asyncio.sleep(0.3)
        status, reply, took = await complete(session, one_slot_fleet, "impatient", 5)
        assert status == 503, reply
        assert reply["payload"]["error"]["code"] == "queue_timeout"
        assert reply["retry_after"] is not None and int(reply["retry_after"]) >= 1
        assert QUEUE_WAIT_S - 0.2 <= took <= QUEUE_WAIT_S + 1.5
        assert (await long)[0] == 200


async def test_status_subject_reports_slots_queue_and_bounds(one_slot_fleet: Fleet) -> None:
    import nats

    nc = await nats.connect(one_slot_fleet.config.nats.url)
    try:
        msg = await nc.request(subjects.BALANCER_STATUS, msgspec.msgpack.encode(BalancerStatusRequest()), timeout=5)
        status = msgspec.msgpack.decode(msg.data, type=BalancerStatusReply)
        assert isinstance(status, BalancerStatus)
        assert status.policy == "jffc_per_request" and status.slot_store == "redis"
        assert [(c.worker_id, c.slots_total) for c in status.chains] == [("w0", 1)]
        # Garbage gets an error reply, and the balancer keeps serving.
        bad = msgspec.msgpack.decode((await nc.request(subjects.BALANCER_STATUS, b"\xff", timeout=5)).data, type=BalancerStatusReply)
        assert not isinstance(bad, BalancerStatus) and bad.status == 400
    finally:
        await nc.close()
    from kvlane.status import fetch_statuses, render_status
    from rich.console import Console

    statuses = await fetch_statuses(one_slot_fleet.config.nats.url)
    console = Console(record=True, width=160)
    render_status(statuses, console)
    text = console.export_text()
    assert "w0" in text and "jffc_per_request" in text and "recommended slots" in text


async def test_status_watch_refreshes_in_place(one_slot_fleet: Fleet) -> None:
    import io

    from kvlane.status import watch_status
    from rich.console import Console

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=160)
    watching = asyncio.create_task(watch_status(one_slot_fleet.config.nats.url, "", 5.0, 0.05, console))
    try:
        deadline = time.monotonic() + 10
        # Two refreshes: the tables, drawn again over themselves (the cursor moves up).
        while screen.getvalue().count("kvlane nodes") < 2 or "\x1b[" not in screen.getvalue():
            assert time.monotonic() < deadline and not watching.done(), screen.getvalue()[-2000:]
            await asyncio.sleep(0.05)
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
    assert "w0" in screen.getvalue()




async def test_a_client_that_leaves_while_queued_gives_its_turn_to_the_next(one_slot_fleet: Fleet) -> None:
    """Its route is withdrawn: the slot that frees goes to the request behind it, not to nobody
    (a slot held for a gone client would stay reserved until that request's deadline)."""
    async with aiohttp.ClientSession() as session:
        holder = asyncio.create_task(complete(session, one_slot_fleet, "holder", 40))  # about 0.9 s
        await until_slot_taken(one_slot_fleet)
        body = {"model": MODEL, "prompt": "leaver", "max_tokens": 5}
        with pytest.raises(asyncio.TimeoutError):  # still queued when it gives up
            await session.post(f"{one_slot_fleet.base_url}/v1/completions", json=body,
                               timeout=aiohttp.ClientTimeout(total=0.3))
        status, reply, _ = await complete(session, one_slot_fleet, "follower", 5)
        assert (await holder)[0] == 200
    assert status == 200, reply
    assert reply["payload"]["usage"]["completion_tokens"] == 5


async def until_slot_taken(fleet: Fleet, timeout_s: float = 10.0) -> None:
    """Until the balancer reports the one slot in use."""
    await until_status(fleet, lambda status: any(chain.slots_used for chain in status.chains), timeout_s)
