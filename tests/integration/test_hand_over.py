"""The balancer sends the worker its request as it decides (`RouteRequest.hand_over`), on a real fleet.

The worker then answers the ingress at the hand-over's `accept_to`: one NATS round trip fewer
before the first token. Here the bus is watched as requests go through the HTTP API, and a test
client speaks the route contract itself to reach the cases an ingress never sends: a hand-over
for another request, one with no `accept_to` or with a KV reference, an `accept_to` with a
wildcard, a client that leaves once its request was handed over, and a worker that died while
its heartbeat still counts (NATS's *no responders*, passed on by the balancer).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from contracts import subjects
from contracts.messages import (
    ErrorReply,
    GenerateAccepted,
    GenerateRequest,
    KvRef,
    RequestFinished,
    RouteDecision,
    RouteRequest,
    RouteWithdrawn,
    SamplingParams,
    StreamMessage,
    WorkerRequest,
)
from launch.fleet import Fleet, with_overrides
from shared.bus import addressed_frames, is_final
from shared.config import IngressSettings
from tests.integration.conftest import MODEL, launch, stop_and_check
from tests.waiting import until

pytestmark = pytest.mark.integration

_replies = msgspec.msgpack.Decoder(RouteDecision | GenerateAccepted | ErrorReply)
_encoder = msgspec.msgpack.Encoder()


class Watch:
    """Route requests, the replies on every inbox, and the worker requests, as they cross NATS."""

    def __init__(self) -> None:
        self.routes: list[RouteRequest] = []
        self.replies: list[object] = []
        self.worker_requests: list[object] = []


@asynccontextmanager
async def watching(fleet: Fleet) -> AsyncIterator[Watch]:
    nc = await nats.connect(fleet.config.nats.url)
    watch = Watch()
    routes, requests = msgspec.msgpack.Decoder(RouteRequest), msgspec.msgpack.Decoder(WorkerRequest)

    async def on_reply(msg) -> None:
        try:
            watch.replies.append(_replies.decode(msg.data))
        except msgspec.DecodeError:
            pass  # another kind of reply (status, registration...)

    async def on_route(msg) -> None:
        watch.routes.append(routes.decode(msg.data))

    async def on_worker_request(msg) -> None:
        watch.worker_requests.append(requests.decode(msg.data))

    await nc.subscribe(subjects.ROUTE, cb=on_route)
    await nc.subscribe(subjects.balancer_route("*"), cb=on_route)  # where an ingress asks the replicas it hears
    await nc.subscribe("_INBOX.>", cb=on_reply)
    await nc.subscribe(f"{subjects.PREFIX}.worker.*.generate", cb=on_worker_request)
    await nc.flush()
    try:
        yield watch
    finally:
        await nc.close()


async def complete(fleet: Fleet, prompt: str, max_tokens: int) -> str:
    client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    response = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=1)
    assert response.usage.completion_tokens == max_tokens
    return response.id


def decisions(watch: Watch) -> list[RouteDecision]:
    return [reply for reply in watch.replies if isinstance(reply, RouteDecision)]


def client_requests(watch: Watch) -> list[str]:
    """The ids of the `GenerateRequest`s workers got, but for the health prober's probes (which may pass by too)."""
    return [r.request_id for r in watch.worker_requests if isinstance(r, GenerateRequest) and not r.request_id.startswith("probe-")]


def test_the_balancer_hands_the_request_over_and_the_worker_answers_the_ingress(shared_fleet: Fleet) -> None:
    async def scenario() -> Watch:
        async with watching(shared_fleet) as watch:
            await complete(shared_fleet, "handed over by the balancer", 4)
            await until(lambda: decisions(watch) and any(isinstance(r, GenerateAccepted) for r in watch.replies), timeout=10)
            return watch

    watch = asyncio.run(scenario())
    [route] = watch.routes
    assert route.hand_over is not None and route.hand_over.request_id == route.request_id and route.hand_over.accept_to
    [decision] = decisions(watch)
    assert decision.handed_over and decision.request_id == route.request_id
    # Sent once, by the balancer: the ingress did not send it again.
    assert client_requests(watch) == [route.request_id]
    [accepted] = [r for r in watch.replies if isinstance(r, GenerateAccepted) and r.request_id == route.request_id]
    assert accepted.worker_id == decision.worker_id and accepted.started_at > 0


def test_an_ingress_set_to_send_itself_does(tmp_path: Path) -> None:
    fleet = launch(tmp_path, workers=1, tune=lambda config: with_overrides(config, ingress={"balancer_hands_over": False}))
    try:
        async def scenario() -> Watch:
            async with watching(fleet) as watch:
                await complete(fleet, "sent by the ingress", 4)
                await until(lambda: decisions(watch), timeout=10)
                return watch

        watch = asyncio.run(scenario())
        [route] = watch.routes
        assert route.hand_over is None
        assert not decisions(watch)[0].handed_over
        assert client_requests(watch) == [route.request_id]
    finally:
        stop_and_check(fleet)


# --- the route contract, spoken directly ------------------------------------------------------


class RawIngress:
    """A test client in the ingress's place: route requests with a hand-over, and what comes back."""

    def __init__(self, nc: nats.NATS) -> None:
        self.nc = nc
        self.owner = f"raw{uuid.uuid4().hex[:8]}"
        self.frames: dict[str, list[object]] = {}
        self.answers: dict[str, list[object]] = {}

    async def start(self) -> None:
        frames = msgspec.msgpack.Decoder(StreamMessage)

        async def on_frame(msg) -> None:
            for request_id, frame in addressed_frames(msg.subject, frames.decode(msg.data)):
                self.frames.setdefault(request_id, []).append(frame)

        async def on_answer(msg) -> None:
            # NATS's no-responders status has no body: kept as its headers.
            answer = _replies.decode(msg.data) if msg.data else msg.headers
            self.answers.setdefault(msg.subject.rsplit(".", 1)[-1], []).append(answer)

        await self.nc.subscribe(subjects.stream_inbox(self.owner), cb=on_frame)
        await self.nc.subscribe(f"{self.owner}.answers.*", cb=on_answer)
        await self.nc.flush()

    def route(self, request_id: str, max_tokens: int, **changes: object) -> RouteRequest:
        hand_over = GenerateRequest(request_id=request_id, model=MODEL, prompt_token_ids=[5, 6, 7, 8],
                                    sampling=SamplingParams(max_tokens=max_tokens, seed=1),
                                    stream_to=subjects.stream_subject(self.owner, request_id), timeout_s=30.0,
                                    accept_to=f"{self.owner}.answers.{request_id}")
        route = RouteRequest(request_id=request_id, model=MODEL, prompt_tokens=4, max_tokens=max_tokens, timeout_s=30.0,
                             hand_over=hand_over)
        return msgspec.structs.replace(route, **changes)

    async def ask(self, route: RouteRequest | bytes) -> RouteDecision | ErrorReply:
        data = route if isinstance(route, bytes) else _encoder.encode(route)
        reply = await self.nc.request(subjects.ROUTE, data, timeout=10)
        return _replies.decode(reply.data)


@asynccontextmanager
async def raw_ingress(fleet: Fleet) -> AsyncIterator[RawIngress]:
    nc = await nats.connect(fleet.config.nats.url)
    try:
        client = RawIngress(nc)
        await client.start()
        yield client
    finally:
        await nc.close()


def test_bad_hand_overs_are_refused_and_the_balancer_serves_on(shared_fleet: Fleet) -> None:
    async def scenario() -> None:
        async with raw_ingress(shared_fleet) as client:
            good = client.route("raw-good", 3)
            assert good.hand_over is not None
            for bad, says in [
                (client.route("raw-a", 3, hand_over=msgspec.structs.replace(good.hand_over, request_id="raw-b")), "another request"),
                (client.route("raw-a", 3, hand_over=msgspec.structs.replace(good.hand_over, model="other")), "another request"),
                (client.route("raw-a", 3, hand_over=msgspec.structs.replace(good.hand_over, request_id="raw-a", accept_to="")),
                 "needs an accept_to"),
                (client.route("raw-a", 3, hand_over=msgspec.structs.replace(
                    good.hand_over, request_id="raw-a", kv_ref=KvRef(source_worker_id="w0", engine_id="e", request_id="raw-a", num_tokens=4, hold_s=5.0))), "no kv_ref"),
            ]:
                reply = await client.ask(bad)
                assert isinstance(reply, ErrorReply) and (reply.code, reply.status) == ("bad_request", 400), reply
                assert says in reply.message
            # An `accept_to` with a wildcard never decodes: the contract refuses it.
            wildcard = _encoder.encode(good).replace(f"{client.owner}.answers.raw-good".encode(), f"{client.owner}.answers.*-good".encode())
            reply = await client.ask(wildcard)
            assert isinstance(reply, ErrorReply) and reply.status == 400, reply

            decision = await client.ask(good)
            assert isinstance(decision, RouteDecision) and decision.handed_over, decision
            await until(lambda: any(is_final(f) for f in client.frames.get("raw-good", [])), timeout=10)
            [accepted] = client.answers["raw-good"]
            assert isinstance(accepted, GenerateAccepted) and (accepted.request_id, accepted.worker_id) == ("raw-good", decision.worker_id)
            assert accepted.started_at > 0  # the accepting process's start, which tells a restarted node from it
            assert [type(f).__name__ for f in client.frames["raw-good"]][-1] == "StreamEnd"

    asyncio.run(scenario())


def test_a_handed_over_request_whose_client_left_is_aborted_on_its_worker(shared_fleet: Fleet) -> None:
    """The client withdraws after the balancer handed its request over: the balancer that placed it aborts it there."""

    async def scenario() -> RequestFinished:
        async with raw_ingress(shared_fleet) as client:
            finished: list[RequestFinished] = []
            decoder = msgspec.msgpack.Decoder(RequestFinished)

            async def on_finished(msg) -> None:
                event = decoder.decode(msg.data)
                if event.request_id == "raw-left":
                    finished.append(event)

            await client.nc.subscribe(subjects.REQUEST_FINISHED, cb=on_finished)
            decision = await client.ask(client.route("raw-left", 2000))
            assert isinstance(decision, RouteDecision) and decision.handed_over, decision
            await until(lambda: client.answers.get("raw-left"), timeout=10)
            await client.nc.publish(subjects.ROUTE_WITHDRAWN, _encoder.encode(RouteWithdrawn("raw-left")))
            await until(lambda: finished, timeout=10)
            return finished[0]

    event = asyncio.run(scenario())
    assert event.finish_reason == "abort" and event.usage.completion_tokens < 2000


def test_a_worker_gone_from_nats_is_known_at_once_not_at_the_accept_timeout(tmp_path: Path) -> None:
    """SIGKILL: NATS drops the worker's subscription at once, while its heartbeat counts for 5 s more. The
    balancer still routes there; NATS tells the balancer nobody listens, and the balancer tells the client."""
    fleet = launch(tmp_path, workers=1, tune=lambda config: with_overrides(config, cluster={"heartbeat_ttl_s": 5.0}))
    try:
        async def scenario() -> tuple[RouteDecision | ErrorReply, object, float]:
            async with raw_ingress(fleet) as client:
                [worker] = fleet.workers
                worker.signal(signal.SIGKILL)
                worker.wait_exit(5)
                started = time.monotonic()
                decision = await client.ask(client.route("raw-dead", 3))
                await until(lambda: client.answers.get("raw-dead"), timeout=5)
                return decision, client.answers["raw-dead"][0], time.monotonic() - started

        decision, answer, waited = asyncio.run(scenario())
        assert isinstance(decision, RouteDecision) and decision.handed_over, decision
        assert isinstance(answer, dict) and answer.get("Status") == "503", answer
        assert waited < IngressSettings().accept_timeout_s, f"known after {waited:.2f}s"
    finally:
        fleet.stop()
