"""Several workers: load spreading, a killed worker, a draining worker, garbage on the bus."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections import Counter

import msgspec
import nats
import openai
import pytest

from contracts import subjects
from contracts.messages import (
    ErrorReply,
    GenerateRequest,
    RouteReply,
    SamplingParams,
    WorkerReply,
)
from launch.fleet import Fleet
from tests.integration.conftest import FAST_HEARTBEATS, MODEL, client_of, until_status
from tests.waiting import until
from tests.integration.finished_log import watch_finished

pytestmark = pytest.mark.integration
TTL_S = FAST_HEARTBEATS["heartbeat_ttl_s"]


async def stream_tokens(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, started: asyncio.Event | None = None) -> tuple[int, str]:
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True)
    tokens, finish = 0, ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            tokens += 1
            if started is not None:
                started.set()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return tokens, finish


def live_workers(fleet: Fleet) -> int:
    with urllib.request.urlopen(f"{fleet.base_url}/ready", timeout=5) as response:
        return json.loads(response.read())["workers"]


async def test_fifty_concurrent_streams_use_both_workers(shared_fleet: Fleet) -> None:
    async with watch_finished(shared_fleet) as finished:
        client = client_of(shared_fleet)
        results = await asyncio.gather(*(stream_tokens(client, f"request {i}", 30) for i in range(50)))
        assert results == [(30, "length")] * 50
        await asyncio.sleep(0.2)
        workers = finished.workers()
        assert set(workers) == {"w0", "w1"}
        assert sum(workers.values()) == 50
        # Least-loaded over a burst: neither worker gets everything.
        assert min(workers.values()) >= 15, workers


async def test_killed_worker_leaves_routing_within_ttl(own_fleet: Fleet) -> None:
    async with watch_finished(own_fleet) as finished:
        client = client_of(own_fleet)
        victim = next(p for p in own_fleet.workers if p.name == "worker-w0")
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        # Requests sent at once still succeed: a dead worker has no responders,
        # so ingress routes the request again without it.
        early = await asyncio.gather(*(stream_tokens(client, f"early {i}", 5) for i in range(6)))
        assert early == [(5, "length")] * 6
        while live_workers(own_fleet) != 1:
            assert time.monotonic() - killed_at < TTL_S + 1.0, "dead worker still listed after the TTL"
            await asyncio.sleep(0.05)
        gone_after = time.monotonic() - killed_at
        finished.events.clear()
        late = await asyncio.gather(*(stream_tokens(client, f"late {i}", 5) for i in range(10)))
        assert late == [(5, "length")] * 10
        await asyncio.sleep(0.2)
        assert finished.workers() == Counter({"w1": 10})
        assert gone_after <= TTL_S + 1.0


async def test_sigterm_drains_in_flight_requests_and_takes_no_new_ones(own_fleet: Fleet) -> None:
    async with watch_finished(own_fleet) as finished:
        client = client_of(own_fleet)
        started = [asyncio.Event() for _ in range(8)]
        long_streams = [asyncio.create_task(stream_tokens(client, f"long {i}", 400, started[i])) for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        assert all(not t.done() for t in long_streams), "streams too short to observe a drain"
        draining = next(p for p in own_fleet.workers if p.name == "worker-w0")
        draining.signal(signal.SIGTERM)
        await until_status(own_fleet, lambda status: all(chain.worker_id != "w0" for chain in status.chains))
        new = await asyncio.gather(*(stream_tokens(client, f"new {i}", 5) for i in range(6)))
        assert new == [(5, "length")] * 6

        def new_ones() -> Counter[str]:  # the long streams (400 tokens) may end meanwhile, on w0
            return Counter(e.worker_id for e in finished.events if e.usage.completion_tokens == 5)

        await until(lambda: sum(new_ones().values()) >= 6, 10, lambda: f"finished: {new_ones()}")
        assert new_ones() == Counter({"w1": 6})
        assert await asyncio.gather(*long_streams) == [(400, "length")] * 8
        assert await asyncio.to_thread(draining.wait_exit, 20) == 0, draining.log_tail()


async def test_garbage_on_balancer_and_worker_subjects_gets_error_replies(shared_fleet: Fleet) -> None:
    nc = await nats.connect(shared_fleet.config.nats.url)
    try:
        route_reply = msgspec.msgpack.Decoder(RouteReply)
        worker_reply = msgspec.msgpack.Decoder(WorkerReply)
        inbox = subjects.worker_inbox("w0")
        for payload in (b"\x00\xffgarbage", b"", msgspec.msgpack.encode({"type": "route", "model": 5})):
            reply = route_reply.decode((await nc.request(subjects.ROUTE, payload, timeout=5)).data)
            assert isinstance(reply, ErrorReply) and reply.code == "bad_request" and reply.status == 400
            reply = worker_reply.decode((await nc.request(inbox, payload, timeout=5)).data)
            assert isinstance(reply, ErrorReply) and reply.code == "bad_request"
        # Well-formed but impossible: the worker refuses with a reason.
        impossible = GenerateRequest(
            request_id="r1", model=MODEL, prompt_token_ids=[5] * 5000, sampling=SamplingParams(max_tokens=10),
            stream_to="kvlane.v1.stream.test.r1", timeout_s=30.0,
        )
        reply = worker_reply.decode((await nc.request(inbox, msgspec.msgpack.encode(impossible), timeout=5)).data)
        assert isinstance(reply, ErrorReply) and reply.status == 400 and "context length" in reply.message
        wrong_model = msgspec.structs.replace(impossible, model="other", prompt_token_ids=[5])
        reply = worker_reply.decode((await nc.request(inbox, msgspec.msgpack.encode(wrong_model), timeout=5)).data)
        assert isinstance(reply, ErrorReply) and reply.status == 404
        # Published without a reply subject: logged and dropped.
        await nc.publish(inbox, b"junk")
        await nc.publish(subjects.ROUTE, b"junk")
        await nc.flush()
    finally:
        await nc.close()
    # Both services kept serving.
    reply = await client_of(shared_fleet).completions.create(model=MODEL, prompt="after garbage", max_tokens=4)
    assert reply.usage.completion_tokens == 4
    assert all(p.alive() for p in shared_fleet.services())


async def test_prefix_blocks_are_published_as_kv_events(shared_fleet: Fleet) -> None:
    from contracts.messages import KvEvents
    from shared.kv.block_hash import chained_block_hashes
    from shared.tokenizer import SimTokenizer

    prompt = "a long shared system prompt that fills several kv blocks " * 6
    expected = chained_block_hashes(SimTokenizer().encode(prompt), shared_fleet.config.worker.sim.block_size)
    assert len(expected) >= 3
    nc = await nats.connect(shared_fleet.config.nats.url)
    stored: dict[str, set[int]] = {}
    decoder = msgspec.msgpack.Decoder(KvEvents)

    async def on_events(msg) -> None:
        events = decoder.decode(msg.data)
        stored.setdefault(events.worker_id, set()).update(events.stored)

    await nc.subscribe(subjects.KV_EVENTS_ALL, cb=on_events)
    await nc.flush()
    try:
        await client_of(shared_fleet).completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        # KV events go out every 50 ms; a loaded machine may take a while.
        for _ in range(200):
            if any(set(expected) <= hashes for hashes in stored.values()):
                break
            await asyncio.sleep(0.05)
        assert any(set(expected) <= hashes for hashes in stored.values()), stored
    finally:
        await nc.close()
