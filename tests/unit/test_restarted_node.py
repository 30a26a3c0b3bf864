"""A node restarted under its id is a new process: the ingress resumes what the old one ran, and may resume it there.

The ingress (`Dispatcher`) and two worker processes in turn (`WorkerService` on the sim engine, both `w0`) talk
through the loopback bus of test_deadlines_across_hosts. The first is killed mid-stream: from then on it sends
nothing, as after SIGKILL, and the second heartbeats under the same id with a later start before the first's last
heartbeat would have expired.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from contracts import subjects
from contracts.health import NodeFeedback
from contracts.messages import RouteDecision, RouteRequest, SamplingParams, TokenChunk, WorkerRegistration
from services.ingress.dispatch import Dispatcher
from services.ingress.prompts import PreparedRequest
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerService
from shared.bus import StreamReceiver
from shared.config import ClusterSettings, IngressSettings, SimSettings, WorkerSettings
from shared.tokenizer import SimTokenizer
from tests.unit.test_deadlines_across_hosts import MODEL, WORKER, LoopbackBus, NoState

MAX_TOKENS = 24


class KillableBus:
    """One process's connection to the loopback bus: once killed, whatever it sends is lost."""

    def __init__(self, bus: LoopbackBus) -> None:
        self._bus = bus
        self.killed = False

    async def subscribe(self, *args: Any, **kwargs: Any) -> None:
        await self._bus.subscribe(*args, **kwargs)

    async def publish(self, subject: str, message: msgspec.Struct, **kwargs: Any) -> None:
        if not self.killed:
            await self._bus.publish(subject, message, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)


async def start_worker(bus: Any, started_at: float) -> WorkerService:
    registration = WorkerRegistration(worker_id=WORKER, role="aggregated", model=MODEL, engine="sim",
                                      inbox=subjects.worker_inbox(WORKER), block_size=16, max_model_len=4096,
                                      tokenizer="sim", started_at=started_at)
    worker = WorkerService(registration, SimEngine(SimSettings(speed=0.2), SimTokenizer()), bus, NoState(),  # type: ignore[arg-type]
                           ClusterSettings(), WorkerSettings())
    await worker.start()
    return worker


async def a_fleet_without_workers(bus: LoopbackBus) -> tuple[list[RouteRequest], StreamReceiver]:
    """A balancer that routes everything to w0 (the route requests it got), and the ingress's stream receiver."""
    routes: list[RouteRequest] = []

    async def balancer(route: RouteRequest, msg: object) -> RouteDecision:
        routes.append(route)
        return RouteDecision(route.request_id, WORKER, subjects.worker_inbox(WORKER), "test")

    await bus.subscribe(subjects.ROUTE, RouteRequest, balancer)
    streams = StreamReceiver(bus, "ingress-test")  # type: ignore[arg-type]
    await streams.start()
    return routes, streams


async def stream_tokens(dispatcher: Dispatcher, request_id: str, on_token=lambda count: None) -> list[int]:
    prepared = PreparedRequest(MODEL, [5, 6, 7, 8], [], SamplingParams(max_tokens=MAX_TOKENS), stream=True, include_usage=False)
    tokens: list[int] = []
    async for frame in dispatcher.run(request_id, prepared):
        if isinstance(frame, TokenChunk):
            tokens.extend(frame.token_ids)
            on_token(len(tokens))
    return tokens


async def test_a_request_on_a_node_that_restarted_is_resumed_there_and_the_old_process_is_blamed() -> None:
    bus = LoopbackBus()
    routes, streams = await a_fleet_without_workers(bus)
    feedback: list[NodeFeedback] = []

    async def prober(message: NodeFeedback, msg: object) -> None:
        feedback.append(message)

    await bus.subscribe(subjects.FEEDBACK, NodeFeedback, prober)
    first_start = time.time() - 60
    live = {"start": first_start}  # what the ingress's view of the cluster says w0's process is
    dispatcher = Dispatcher(bus, streams, IngressSettings(), live_start=lambda worker_id: live["start"],  # type: ignore[arg-type]
                            max_queue_wait_s=1.0)

    old_connection = KillableBus(bus)
    old = await start_worker(old_connection, first_start)
    reference = await stream_tokens(dispatcher, "uninterrupted")
    assert len(reference) == MAX_TOKENS and routes[-1].exclude_workers == []
    routes.clear()
    replacement: list[WorkerService] = []

    def kill_and_restart(count: int) -> None:
        if count == 3 and not old_connection.killed:
            old_connection.killed = True  # SIGKILL: the old process sends nothing more
            live["start"] = first_start + 30  # the new one heartbeats (its own start) before the old one expires
            replacement.append(bus.spawn(start_worker(bus, live["start"])))

    try:
        resumed = await stream_tokens(dispatcher, "r1", kill_and_restart)
    finally:
        await old.drain(0.0)
        for started in replacement:
            await (await started).drain(0.0)
    # Resumed as soon as the new start was seen, not after the 30 s stall timeout; on the restarted node itself.
    assert resumed == reference
    assert [route.exclude_workers for route in routes] == [[], []]
    assert routes[1].prompt_tokens == 4 + 3 and routes[1].max_tokens == MAX_TOKENS - 3
    # The complaint names the killed process, so the prober does not hold it against the new one.
    assert [(f.worker_id, f.kind, f.started_at) for f in feedback] == [(WORKER, "timeout", first_start)]


async def test_a_view_that_has_not_yet_heard_the_accepting_process_does_not_take_it_for_a_restart() -> None:
    # The balancer heard the new process first and routed there; this ingress still holds the old one's heartbeat.
    bus = LoopbackBus()
    routes, streams = await a_fleet_without_workers(bus)
    started_at = time.time()
    # Checked between nearly every two frames.
    settings = IngressSettings(liveness_check_s=0.005)
    dispatcher = Dispatcher(bus, streams, settings, live_start=lambda worker_id: started_at - 30,  # type: ignore[arg-type]
                            max_queue_wait_s=1.0)
    worker = await start_worker(bus, started_at)
    try:
        tokens = await stream_tokens(dispatcher, "r1")
    finally:
        await worker.drain(0.0)
    assert len(tokens) == MAX_TOKENS and len(routes) == 1
