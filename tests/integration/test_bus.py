"""The NATS bus against a real nats-server: replies, deadlines, streams, traces, restarts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from contracts.messages import (
    ErrorReply, RouteDecision, RouteReply, RouteRequest, StreamBatch, StreamEnd, StreamMessage, Timings, TokenChunk, Usage,
)
from launch.launcher import Launcher, free_port
from shared.bus import Bus, NoResponders, RequestTimeout, StreamReceiver, is_final
from shared.config import NatsSettings, TracingSettings
from shared.stream_outbox import StreamOutbox
from shared.telemetry import Telemetry
from tests.waiting import until

pytestmark = pytest.mark.integration


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[tuple[Launcher, int]]:
    launcher = Launcher(tmp_path)
    port = free_port()
    launcher.start_nats(port)
    yield launcher, port
    launcher.stop_all()


async def connect(port: int, name: str, exporter: InMemorySpanExporter | None = None) -> tuple[Bus, Telemetry]:
    telemetry = Telemetry(TracingSettings(), name, exporter)
    settings = NatsSettings(url=f"nats://127.0.0.1:{port}", reconnect_wait_s=0.1)
    return await Bus.connect(settings, name, telemetry), telemetry


def route(request_id: str = "r1") -> RouteRequest:
    return RouteRequest(request_id=request_id, model="m", prompt_tokens=3, max_tokens=4, timeout_s=30.0)


async def decide(request: RouteRequest, msg) -> RouteDecision:
    return RouteDecision(request.request_id, "w0", "inbox", "test")


async def test_request_reply_and_handler_failure(nats_server) -> None:
    _, port = nats_server
    server, _ = await connect(port, "server")
    client, _ = await connect(port, "client")

    async def handle(request: RouteRequest, msg) -> RouteDecision:
        if request.request_id == "boom":
            raise RuntimeError("handler bug")
        return await decide(request, msg)

    await server.subscribe("t.route", RouteRequest, handle, queue="q")
    assert await client.request("t.route", route(), RouteReply, 2) == RouteDecision("r1", "w0", "inbox", "test")
    failed = await client.request("t.route", route("boom"), RouteReply, 2)
    assert isinstance(failed, ErrorReply) and failed.code == "internal" and "handler bug" in failed.message
    # Still serving after the failure.
    assert isinstance(await client.request("t.route", route("r2"), RouteReply, 2), RouteDecision)
    with pytest.raises(NoResponders):
        await client.request("t.nobody", route(), RouteReply, 2)

    async def slow(request: RouteRequest, msg) -> None:
        await asyncio.sleep(5)

    await server.subscribe("t.slow", RouteRequest, slow, concurrent=True)
    with pytest.raises(RequestTimeout):
        await client.request("t.slow", route(), RouteReply, 0.2)
    await client.close()
    await server.close()


async def test_a_reply_slot_takes_the_answer_to_a_request_another_connection_sent(nats_server) -> None:
    """The balancer's hand-over: the client listens, a middle connection sends, the server answers the client."""
    _, port = nats_server
    server, _ = await connect(port, "server")
    middle, _ = await connect(port, "middle")
    client, _ = await connect(port, "client")
    await server.subscribe("t.route", RouteRequest, decide)

    with await client.reply_slot() as slot:
        await middle.publish("t.route", route("sent-on"), reply=slot.subject)
        assert await slot.wait(RouteReply, 2, "t.route") == RouteDecision("sent-on", "w0", "inbox", "test")
    with await client.reply_slot() as slot:
        # NATS tells only the sender that nobody listens: the middle's relay passes that on.
        await middle.publish("t.nobody", route(), reply=await middle.relaying_to(slot.subject))
        with pytest.raises(NoResponders):
            await slot.wait(RouteReply, 2, "t.nobody")
    with await client.reply_slot() as slot:
        # Nor an error reply: a message the server cannot decode is refused at once, not at the client's timeout.
        await middle.client.publish("t.route", b"\x93garbage", reply=await middle.relaying_to(slot.subject))
        refused = await slot.wait(RouteReply, 2, "t.route")
        assert isinstance(refused, ErrorReply) and refused.code == "bad_request" and refused.status == 400
    with await client.reply_slot() as slot:
        # Nothing else: an answer sent to the relay stops there.
        await middle.publish("t.route", route("relayed"), reply=await middle.relaying_to(slot.subject))
        with pytest.raises(RequestTimeout):
            await slot.wait(RouteReply, 0.5, "t.route")
    with await client.reply_slot() as slot:
        await middle.publish("t.nobody", route(), reply=slot.subject)
        with pytest.raises(RequestTimeout):  # not relayed: the no-responders status went nowhere
            await slot.wait(RouteReply, 0.5, "t.nobody")
    # A closed slot is forgotten: an answer that comes later finds nobody, and requests go on.
    slot = await client.reply_slot()
    slot.close()
    await middle.publish("t.route", route("late"), reply=slot.subject)
    assert await client.request("t.route", route("r2"), RouteReply, 2) == RouteDecision("r2", "w0", "inbox", "test")
    for bus in (client, middle, server):
        await bus.close()


async def test_concurrent_requests_each_get_their_own_reply(nats_server) -> None:
    """Replies share one inbox per connection: requests racing its first subscription, and a reply that comes
    after its request gave up, reach only the request they answer."""
    _, port = nats_server
    server, _ = await connect(port, "server")
    client, _ = await connect(port, "client")
    release_late = asyncio.Event()

    async def handle(request: RouteRequest, msg) -> RouteDecision:
        if request.request_id == "late":
            await release_late.wait()
        return RouteDecision(request.request_id, "w0", "inbox", "test")

    await server.subscribe("t.route", RouteRequest, handle, concurrent=True)
    ids = [f"r{n}" for n in range(200)]
    replies = await asyncio.gather(*(client.request("t.route", route(i), RouteReply, 5) for i in ids))
    assert [reply.request_id for reply in replies] == ids
    with pytest.raises(RequestTimeout):
        await client.request("t.route", route("late"), RouteReply, 0.2)
    release_late.set()
    assert (await client.request("t.route", route("after"), RouteReply, 5)).request_id == "after"
    await client.close()
    await server.close()


async def test_a_subscription_is_live_once_subscribe_returns(nats_server) -> None:
    """A request sent from another connection right after `subscribe` finds its responder, every time."""
    _, port = nats_server
    server, _ = await connect(port, "server")
    client, _ = await connect(port, "client")

    for attempt in range(300):
        await server.subscribe(f"t.fresh.{attempt}", RouteRequest, decide)
        assert isinstance(await client.request(f"t.fresh.{attempt}", route(), RouteReply, 2), RouteDecision), attempt
    await server.close()
    await client.close()


async def test_streamed_reply_arrives_in_order_and_ends(nats_server) -> None:
    _, port = nats_server
    bus, _ = await connect(port, "both")
    streams = StreamReceiver(bus, "owner1")
    await streams.start()
    with streams.open("req1") as stream:
        for seq in range(100):
            await bus.publish(stream.subject, TokenChunk("req1", seq, [seq], f"t{seq}"), traced=False)
        await bus.publish(stream.subject, StreamEnd("req1", 100, "length", Usage(1, 100), Timings(), "w0"))
        frames = []
        while not frames or not is_final(frames[-1]):
            frames.append(await stream.next(2))
    assert [f.seq for f in frames] == list(range(101))
    assert streams.open_count == 0
    with streams.open("req2") as stream, pytest.raises(RequestTimeout):
        await stream.next(0.1)
    await bus.close()


async def test_outbox_batches_one_steps_frames_per_receiver_in_order(nats_server) -> None:
    _, port = nats_server
    worker, _ = await connect(port, "worker")
    receiver_bus, _ = await connect(port, "receiver")
    receivers = [StreamReceiver(receiver_bus, f"owner{i}") for i in range(2)]
    for receiver in receivers:
        await receiver.start()
    batches: list[StreamBatch] = []

    async def count(message: StreamMessage, msg) -> None:
        batches.append(message)

    await receiver_bus.subscribe("kvlane.v1.stream.*.*", StreamMessage, count, traced=False)
    outbox = StreamOutbox(worker)
    # Three requests per receiver, ten engine steps: each step's frames leave together.
    opened = [receiver.open(f"req{r}-{i}") for r, receiver in enumerate(receivers) for i in range(3)]
    for seq in range(10):
        for stream in opened:
            outbox.put(stream.subject, TokenChunk(stream.request_id, seq, [seq], f"t{seq}"))
        await asyncio.sleep(0.01)  # the engine's next step
    for stream in opened:
        outbox.put(stream.subject, StreamEnd(stream.request_id, 10, "length", Usage(1, 10), Timings(), "w0"))
    outbox.put(opened[0].subject, TokenChunk("late", 11, [1], "after the end"))  # a frame nobody waits for is dropped
    await outbox.close()
    for stream in opened:
        with stream:
            frames = [await stream.next(2) for _ in range(11)]
            assert [f.seq for f in frames] == list(range(11)) and is_final(frames[-1])
            assert {f.request_id for f in frames} == {stream.request_id}
    async with asyncio.timeout(5):
        while sum(len(b.frames) for b in batches) < 67:
            await asyncio.sleep(0.01)
    # A step's frames for one receiver leave in one message (slow publishes may merge steps too).
    assert len(batches) <= 22 and all(isinstance(b, StreamBatch) for b in batches)
    assert all(len({f.stream.split("-")[0] for f in b.frames}) == 1 for b in batches)
    await worker.close()
    await receiver_bus.close()


async def test_an_at_once_handler_runs_in_the_read_loop_and_cannot_break_it(nats_server) -> None:
    """Frames reach an `at_once` handler as nats-py parses them; garbage and a failing handler cost their message only."""
    _, port = nats_server
    sender, _ = await connect(port, "sender")
    receiver, _ = await connect(port, "receiver")
    seen: list[tuple[int, asyncio.Task | None]] = []

    def handle(frame: StreamMessage, msg) -> None:
        if isinstance(frame, TokenChunk) and frame.seq == 1:
            raise RuntimeError("handler bug")
        seen.append((frame.seq, asyncio.current_task()))

    await receiver.subscribe("t.frames", StreamMessage, handle, traced=False, at_once=True)
    await sender.publish("t.frames", TokenChunk("r", 0, [0], "a"), traced=False)
    await sender.client.publish("t.frames", b"not msgpack")
    await sender.publish("t.frames", TokenChunk("r", 1, [1], "b"), traced=False)
    await sender.publish("t.frames", TokenChunk("r", 2, [2], "c"), traced=False)
    await until(lambda: len(seen) == 2, 5, lambda: f"frames 0 and 2, seen {seen}")
    assert [seq for seq, _ in seen] == [0, 2]
    # No task of the subscription's own: the connection's read loop ran the handler.
    assert all(task is receiver.client._reading_task for _, task in seen)
    # Replies go the same way, and the connection still serves them.
    await sender.subscribe("t.route", RouteRequest, decide)
    assert isinstance(await receiver.request("t.route", route(), RouteReply, 2), RouteDecision)

    async def waits(frame: StreamMessage, msg) -> None:
        pass

    # A coroutine function would never be awaited there: refused at once.
    with pytest.raises(TypeError, match="plain function"):
        await receiver.subscribe("t.other", StreamMessage, waits, traced=False, at_once=True)
    await sender.close()
    await receiver.close()


async def test_trace_context_crosses_the_bus(nats_server) -> None:
    _, port = nats_server
    spans = InMemorySpanExporter()
    server, server_telemetry = await connect(port, "server", spans)
    client, client_telemetry = await connect(port, "client", spans)

    await server.subscribe("t.traced", RouteRequest, decide)
    with client_telemetry.tracer.start_as_current_span("client-call") as parent:
        await client.request("t.traced", route(), RouteReply, 2)
    client_telemetry.flush()
    server_telemetry.flush()
    handled = next(s for s in spans.get_finished_spans() if s.name == "handle t.traced")
    assert handled.context.trace_id == parent.get_span_context().trace_id
    assert handled.parent.span_id == parent.get_span_context().span_id
    await client.close()
    await server.close()


async def test_subscriptions_survive_a_nats_restart(nats_server) -> None:
    launcher, port = nats_server
    server, _ = await connect(port, "server")
    client, _ = await connect(port, "client")

    await server.subscribe("t.restart", RouteRequest, decide)
    assert isinstance(await client.request("t.restart", route(), RouteReply, 2), RouteDecision)
    launcher.stop_all()
    launcher.start_nats(port)
    for _ in range(100):
        try:
            assert isinstance(await client.request("t.restart", route(), RouteReply, 1), RouteDecision)
            break
        except (NoResponders, RequestTimeout, Exception):
            await asyncio.sleep(0.1)
    else:
        pytest.fail("no reply within 10 s of the NATS restart")
    await client.close()
    await server.close()
