"""A node restarted under its id is a new process: the ingress resumes what the old one ran, and may resume it there.

The ingress (`Dispatcher`) and two worker processes in turn (`WorkerService` on the sim engine, both `w0`) talk
through the loopback bus of test_deadlines_across_hosts. The first is killed mid-stream: from then on it sends
nothing, as after SIGKILL, and the second heartbeats under the same id with a later start before the first's last
heartbeat would have expired.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from contracts import subjects
from contracts.health import NodeFeedback
from contracts.messages import RouteDecision, RouteRequest, SamplingParams, TokenChunk, WorkerRegistration
from services.ingress.dispatch import Dispatcher
from services.ingress.errors import ApiError
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


async def run_on_a_node_that_dies_at(kills: tuple[int, ...], settings: IngressSettings) -> tuple[list[int], list[RouteRequest]]:
    """A request on w0, whose process dies (and a new one starts under its id) as each of `kills` tokens is reached,
    as if the request crashed every engine it ran on: the client's token counts, and the route requests."""
    bus = LoopbackBus()
    routes, streams = await a_fleet_without_workers(bus)
    live = {"start": time.time() - 60}
    dispatcher = Dispatcher(bus, streams, settings, live_start=lambda worker_id: live["start"],  # type: ignore[arg-type]
                            max_queue_wait_s=1.0)
    connections = [KillableBus(bus)]
    first = await start_worker(connections[0], live["start"])
    replacements: list[asyncio.Task] = []
    tokens: list[int] = []
    pending = list(kills)

    def kill_and_restart(count: int) -> None:
        tokens.append(count)
        # At or past: a frame may carry more than one token.
        if pending and count >= pending[0]:
            pending.pop(0)
            connections[-1].killed = True
            live["start"] += 10
            connections.append(KillableBus(bus))
            replacements.append(bus.spawn(start_worker(connections[-1], live["start"])))

    try:
        await stream_tokens(dispatcher, "poison", kill_and_restart)
    finally:
        await first.drain(0.0)
        for started in replacements:
            await (await started).drain(0.0)
    return tokens, routes


async def test_a_request_whose_node_dies_under_it_twice_fails_rather_than_take_down_a_third() -> None:
    with pytest.raises(ApiError) as failed:
        await run_on_a_node_that_dies_at((3, 6), IngressSettings())
    assert failed.value.status == 502 and failed.value.code == "stream_interrupted"
    assert "2 nodes died while running it" in failed.value.message


async def test_a_request_whose_node_died_once_is_resumed_and_with_a_higher_bound_twice() -> None:
    tokens, routes = await run_on_a_node_that_dies_at((3,), IngressSettings())
    assert tokens[-1] == MAX_TOKENS and len(routes) == 2
    tokens, routes = await run_on_a_node_that_dies_at((3, 6), IngressSettings(node_loss_resumes=2))
    assert tokens[-1] == MAX_TOKENS and len(routes) == 3
