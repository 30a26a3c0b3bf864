"""A balancer that hands a request over to a worker and then goes silent, against a real nats-server.

The ingress (`Dispatcher`) asks again after the route timeout. The worker the silent balancer chose runs the
request all the same; its reply and frames must not reach the client's stream, which is the second answer's
alone (mixed into it, they repeated tokens to the client), and once it says it took the request, it is told
to stop. When the second answer names the same worker, its second attempt takes the place of the first there:
answered "already running", the client got a 409.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from contracts import subjects
from contracts.messages import (
    AbortRequest, ErrorReply, GenerateAccepted, GenerateRequest, RequestFinished, RouteDecision, RouteRequest,
    SamplingParams, StreamEnd, TokenChunk, WorkerRegistration, WorkerReply,
)
from services.ingress.dispatch import Dispatcher
from services.ingress.prompts import PreparedRequest
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerService
from shared.bus import Bus, ReplyStream, StreamReceiver
from shared.config import ClusterSettings, IngressSettings, SimSettings, WorkerSettings
from shared.tokenizer import SimTokenizer
from tests.integration.test_bus import connect, nats_server  # noqa: F401 (a fixture)
from tests.unit.test_deadlines_across_hosts import NoState
from tests.waiting import until

pytestmark = pytest.mark.integration

MODEL = "m"
MAX_TOKENS = 16


async def start_worker(bus: Bus, worker_id: str, speed: float) -> WorkerService:
    registration = WorkerRegistration(worker_id=worker_id, role="aggregated", model=MODEL, engine="sim",
                                      inbox=subjects.worker_inbox(worker_id), block_size=16, max_model_len=4096,
                                      tokenizer="sim", started_at=time.time())
    worker = WorkerService(registration, SimEngine(SimSettings(speed=speed), SimTokenizer()), bus, NoState(),  # type: ignore[arg-type]
                           ClusterSettings(), WorkerSettings())
    await worker.start()
    return worker


async def tokens_of(dispatcher: Dispatcher, request_id: str) -> list[int]:
    prepared = PreparedRequest(MODEL, [5, 6, 7, 8], [], SamplingParams(max_tokens=MAX_TOKENS), stream=True, include_usage=False)
    return [token async for frame in dispatcher.run(request_id, prepared) if isinstance(frame, TokenChunk)
            for token in frame.token_ids]


@pytest.fixture
async def buses(nats_server) -> AsyncIterator[dict[str, Bus]]:  # noqa: F811
    _, port = nats_server
    connected = {name: (await connect(port, name))[0] for name in ("ingress", "balancer", "w0", "w1", "watch")}
    yield connected
    for bus in connected.values():
        await bus.close()


class SilentOnce:
    """A balancer that hands `request_id`'s first route request over to `hands_to` and never answers it (it hangs,
    or died just then); it answers the others with `decides`."""

    def __init__(self, bus: Bus, request_id: str, hands_to: str, decides: str) -> None:
        self.asks: list[RouteRequest] = []
        self.silence = asyncio.Event()
        self._bus, self._request_id, self._hands_to, self._decides = bus, request_id, hands_to, decides

    async def __call__(self, route: RouteRequest, msg: object) -> RouteDecision:
        self.asks.append(route)
        if route.request_id == self._request_id and [a.request_id for a in self.asks].count(self._request_id) == 1:
            assert route.hand_over is not None
            await self._bus.publish(subjects.worker_inbox(self._hands_to), route.hand_over,
                                    reply=await self._bus.relaying_to(route.hand_over.accept_to))
            await self.silence.wait()
        return RouteDecision(route.request_id, self._decides, subjects.worker_inbox(self._decides), "test")


async def finished_events(bus: Bus) -> list[RequestFinished]:
    finished: list[RequestFinished] = []

    async def on_finished(event: RequestFinished, msg: object) -> None:
        finished.append(event)

    await bus.subscribe(subjects.REQUEST_FINISHED, RequestFinished, on_finished)
    return finished


def ends(finished: list[RequestFinished], request_id: str) -> list[tuple[str, str, int]]:
    return [(e.worker_id, e.finish_reason, e.usage.completion_tokens) for e in finished if e.request_id == request_id]


@pytest.mark.parametrize("second_answer", ["w1", "w0"])
async def test_a_silent_balancers_hand_over_is_stopped_and_kept_off_the_stream_of_the_second_ask(
    buses: dict[str, Bus], second_answer: str,
) -> None:
    # w0 slower than w1: its frames would still be coming when w1's begin, and it is still running when told to stop.
    workers = [await start_worker(buses["w0"], "w0", 0.05), await start_worker(buses["w1"], "w1", 0.2)]
    finished = await finished_events(buses["watch"])
    balancer = SilentOnce(buses["balancer"], "r1", hands_to="w0", decides=second_answer)
    await buses["balancer"].subscribe(subjects.ROUTE, RouteRequest, balancer, concurrent=True)
    streams = StreamReceiver(buses["ingress"], "ingress-test")
    await streams.start()
    dispatcher = Dispatcher(buses["ingress"], streams, IngressSettings(route_timeout_s=0.5),
                            live_start=lambda worker_id: 0.0, max_queue_wait_s=0.1)
    try:
        reference = await tokens_of(dispatcher, "reference")
        balancer.asks.clear()
        tokens = await tokens_of(dispatcher, "r1")
        await until(lambda: ("length" in [end[1] for end in ends(finished, "r1")]), 30,
                    lambda: f"r1 ending whole ({ends(finished, 'r1')})")
    finally:
        balancer.silence.set()
        for worker in workers:
            await worker.drain(0.0)
    assert len(reference) == MAX_TOKENS and tokens == reference
    # Asked twice, and only twice: a third ask would be a resumption after frames out of sequence.
    assert [(a.request_id, a.exclude_workers) for a in balancer.asks] == [("r1", []), ("r1", [])]
    # The silent balancer's hand-over did reach w0, which stopped it early; the second answer ran it whole. On w0
    # itself the first run ends told to stop (and says so), or superseded by the second (and says nothing).
    *stopped, whole = ends(finished, "r1")
    assert whole == (second_answer, "length", MAX_TOKENS)
    assert all(end[:2] == ("w0", "abort") and end[2] < MAX_TOKENS for end in stopped)
    if second_answer != "w0":
        assert len(stopped) == 1


async def frames_of(stream: ReplyStream) -> list[object]:
    frames: list[object] = []
    while not frames or not isinstance(frames[-1], (StreamEnd, ErrorReply)):
        frames.append(await stream.next(10))
    return frames


async def test_a_worker_runs_one_attempt_of_a_request_at_a_time(buses: dict[str, Bus]) -> None:
    """Requests with one id: for another stream each takes the place of the one before (and starts once every
    earlier one has ended, or their tokens would mix); for the same stream one is refused as already running.
    An abort naming an attempt's stream stops that attempt only."""
    worker = await start_worker(buses["w0"], "w0", 0.05)
    finished = await finished_events(buses["watch"])
    ingress = buses["ingress"]
    streams = StreamReceiver(ingress, "ingress-test")
    await streams.start()
    inbox = subjects.worker_inbox("w0")

    def attempt(stream: ReplyStream) -> GenerateRequest:
        return GenerateRequest("r1", MODEL, [5, 6, 7, 8], SamplingParams(max_tokens=MAX_TOKENS), stream.subject, 30.0)

    def tokens(frames: list[object]) -> list[int]:
        return [token for frame in frames if isinstance(frame, TokenChunk) for token in frame.token_ids]

    try:
        with streams.open("reference-0") as alone:
            await ingress.request(inbox, msgspec.structs.replace(attempt(alone), request_id="reference"), WorkerReply, 5)
            reference = tokens(await frames_of(alone))
        with streams.open("r1-0") as first, streams.open("r1-1") as second, streams.open("r1-2") as third:
            assert isinstance(await ingress.request(inbox, attempt(first), WorkerReply, 5), GenerateAccepted)
            assert isinstance(await first.next(10), TokenChunk)  # running
            again = await ingress.request(inbox, attempt(first), WorkerReply, 5)
            assert isinstance(again, ErrorReply) and (again.code, again.status) == ("duplicate_request", 409)
            # Two more at once: the third comes while the second still waits for the first to end.
            accepted = await asyncio.gather(ingress.request(inbox, attempt(second), WorkerReply, 5),
                                            ingress.request(inbox, attempt(third), WorkerReply, 5))
            assert all(isinstance(reply, GenerateAccepted) for reply in accepted)
            for superseded in (first, second):
                end = (await frames_of(superseded))[-1]
                assert isinstance(end, ErrorReply) and end.code == "superseded"
            # The first attempt's abort, late, leaves the third running.
            await ingress.publish(inbox, AbortRequest("r1", "route_unanswered", stream_to=first.subject))
            third_frames = await frames_of(third)
        assert isinstance(third_frames[-1], StreamEnd) and third_frames[-1].finish_reason == "length"
        assert len(reference) == MAX_TOKENS and tokens(third_frames) == reference
        await until(lambda: ends(finished, "r1"), 10, lambda: "r1 ending")
        # The superseded runs said nothing: the request went on here, under the same slot and lease.
        assert [e[:2] for e in ends(finished, "r1")] == [("w0", "length")]
        # An abort naming the stream of the attempt that runs stops it.
        with streams.open("r2-0") as only:
            request = msgspec.structs.replace(attempt(only), request_id="r2")
            assert isinstance(await ingress.request(inbox, request, WorkerReply, 5), GenerateAccepted)
            await ingress.publish(inbox, AbortRequest("r2", "client_disconnected", stream_to=only.subject))
            aborted = (await frames_of(only))[-1]
        assert isinstance(aborted, ErrorReply) and aborted.code == "client_disconnected"
    finally:
        await worker.drain(0.0)
