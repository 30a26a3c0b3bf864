"""A balancer that hands a request over to a worker and then goes silent, against a real nats-server.

The ingress (`Dispatcher`) asks again after the route timeout. The worker the silent balancer chose runs the
request all the same; its reply and frames must not reach the client's stream, which is the second answer's
alone. Mixed into it, they repeated tokens to the client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from contracts import subjects
from contracts.messages import (
    RequestFinished, RouteDecision, RouteRequest, SamplingParams, TokenChunk, WorkerRegistration,
)
from services.ingress.dispatch import Dispatcher
from services.ingress.prompts import PreparedRequest
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerService
from shared.bus import Bus, StreamReceiver
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


async def test_a_silent_balancers_hand_over_does_not_reach_the_stream_of_the_second_ask(buses: dict[str, Bus]) -> None:
    # w0 slower than w1: its frames would still be coming when w1's begin.
    workers = [await start_worker(buses["w0"], "w0", 0.05), await start_worker(buses["w1"], "w1", 0.2)]
    asks: list[RouteRequest] = []
    silent = asyncio.Event()
    finished: list[tuple[str, str]] = []

    async def on_finished(event: RequestFinished, msg: object) -> None:
        finished.append((event.request_id, event.worker_id))

    await buses["watch"].subscribe(subjects.REQUEST_FINISHED, RequestFinished, on_finished)

    async def balancer(route: RouteRequest, msg: object) -> RouteDecision:
        asks.append(route)
        if route.request_id == "r1" and len([a for a in asks if a.request_id == "r1"]) == 1:
            # Sends the request on to w0, as a balancer does, then answers nobody (it hangs, or died just then).
            assert route.hand_over is not None
            await buses["balancer"].publish(subjects.worker_inbox("w0"), route.hand_over,
                                            reply=await buses["balancer"].relaying_to(route.hand_over.accept_to))
            await silent.wait()
        return RouteDecision(route.request_id, "w1", subjects.worker_inbox("w1"), "test")

    await buses["balancer"].subscribe(subjects.ROUTE, RouteRequest, balancer, concurrent=True)
    streams = StreamReceiver(buses["ingress"], "ingress-test")
    await streams.start()
    dispatcher = Dispatcher(buses["ingress"], streams, IngressSettings(route_timeout_s=0.5),
                            live_start=lambda worker_id: 0.0, max_queue_wait_s=0.1)
    try:
        reference = await tokens_of(dispatcher, "reference")
        asks.clear()
        tokens = await tokens_of(dispatcher, "r1")
        # w0 ran it too, for nobody: the silent balancer's hand-over did reach a worker.
        await until(lambda: ("r1", "w0") in finished, 30, lambda: f"w0 running r1 to its end ({finished})")
    finally:
        silent.set()
        for worker in workers:
            await worker.drain(0.0)
    assert len(reference) == MAX_TOKENS and tokens == reference
    # Asked twice, and only twice: a third ask would be a resumption after frames out of sequence.
    assert [(a.request_id, a.exclude_workers) for a in asks] == [("r1", []), ("r1", [])]
    assert ("r1", "w1") in finished
