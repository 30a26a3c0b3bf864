"""Deadlines cross hosts as time left, so a sender whose wall clock is off gives its request the same time.

An ingress (the `Dispatcher`) and a worker (a `WorkerService` on the sim engine) talk through a loopback
bus that passes every message as msgpack bytes, as NATS would; only the ingress's wall clock is skewed.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import types
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest

from contracts import subjects
from contracts.messages import (
    GenerateRequest,
    KvRef,
    RouteDecision,
    RouteRequest,
    SamplingParams,
    WorkerRegistration,
    WorkerRequest,
)
from services.ingress import dispatch as dispatch_module
from services.ingress.dispatch import Dispatcher
from services.ingress.errors import ApiError
from services.ingress.prompts import PreparedRequest
from services.worker.engines.base import KvPullFailed
from services.worker.engines.sim import SimEngine
from services.worker.handoff import KvHolds, KvPuller
from services.worker.service import WorkerService
from shared.bus import StreamReceiver
from shared.config import ClusterSettings, IngressSettings, SimSettings, WorkerSettings
from shared.tokenizer import SimTokenizer

REQUEST_TIMEOUT_S = 0.6
MODEL = "m"
WORKER = "w0"
HOUR = 3600.0

Handler = Callable[[Any, Any], Awaitable[Any]]


class LoopbackBus:
    """NATS within one process: each message crosses as msgpack bytes, and every one sent is kept."""

    def __init__(self) -> None:
        self.reconnected_at: float | None = None
        self.sent: list[tuple[str, bytes]] = []
        self._handlers: dict[str, tuple[msgspec.msgpack.Decoder, Handler]] = {}
        self._tasks: set[asyncio.Task] = set()

    async def subscribe(self, subject: str, message_type: Any, handler: Handler, **_: object) -> None:
        self._handlers[subject] = (msgspec.msgpack.Decoder(message_type), handler)

    async def request(self, subject: str, message: msgspec.Struct, reply_type: Any, timeout: float, **_: object) -> Any:
        reply = await self._deliver(subject, message)
        return msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=reply_type)

    async def publish(self, subject: str, message: msgspec.Struct, **_: object) -> None:
        await self._deliver(subject, message)

    async def reply_slot(self) -> types.SimpleNamespace:
        """Where a worker would answer a request the balancer sent on; this test's balancer never does."""
        return types.SimpleNamespace(subject="_INBOX.loopback", close=lambda: None)

    async def _deliver(self, subject: str, message: msgspec.Struct) -> Any:
        data = msgspec.msgpack.encode(message)
        self.sent.append((subject, data))
        for pattern, (decoder, handler) in self._handlers.items():
            if pattern == subject or (pattern.endswith(".*") and subject.rsplit(".", 1)[0] == pattern[:-2]):
                handled = handler(decoder.decode(data), types.SimpleNamespace(subject=subject))
                return await handled if inspect.isawaitable(handled) else handled  # an `at_once` handler returns None
        return None  # nobody listens (heartbeats, finished events)

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def flush(self, timeout: float = 2.0) -> None:
        pass


class NoState:
    """The worker's Redis, which this test does not need."""

    async def put_heartbeat(self, heartbeat: object) -> None:
        pass

    async def remove_node(self, worker_id: str) -> None:
        pass


def skewed_clock(offset_s: float) -> types.SimpleNamespace:
    """A `time` module whose wall clock is `offset_s` off (its monotonic clock is the host's own)."""
    return types.SimpleNamespace(time=lambda: time.time() + offset_s, monotonic=time.monotonic, perf_counter=time.perf_counter)


async def a_balancer(route: RouteRequest, msg: object) -> RouteDecision:
    return RouteDecision(route.request_id, WORKER, subjects.worker_inbox(WORKER), "test")


async def run_until_the_deadline(bus: LoopbackBus) -> tuple[ApiError, float]:
    """A request slower than its deadline, from the ingress to the worker: the error it ends with, and after how long."""
    # A token every 0.2 s: the request cannot finish within its deadline.
    engine = SimEngine(SimSettings(speed=0.01), SimTokenizer())
    registration = WorkerRegistration(worker_id=WORKER, role="aggregated", model=MODEL, engine="sim", inbox=subjects.worker_inbox(WORKER),
                                      block_size=16, max_model_len=4096, tokenizer="sim", started_at=time.time())
    worker = WorkerService(registration, engine, bus, NoState(), ClusterSettings(), WorkerSettings())  # type: ignore[arg-type]
    await worker.start()
    await bus.subscribe(subjects.ROUTE, RouteRequest, a_balancer)
    streams = StreamReceiver(bus, "ingress-test")  # type: ignore[arg-type]
    await streams.start()
    settings = IngressSettings(request_timeout_s=REQUEST_TIMEOUT_S)
    dispatcher = Dispatcher(bus, streams, settings, live_start=lambda worker_id: 0.0, max_queue_wait_s=1.0)  # type: ignore[arg-type]
    prepared = PreparedRequest(MODEL, [1, 2, 3, 4], [], SamplingParams(max_tokens=50), stream=True, include_usage=False)
    started = time.monotonic()
    try:
        with pytest.raises(ApiError) as raised:
            async for _ in dispatcher.run("r1", prepared):
                pass
        return raised.value, time.monotonic() - started
    finally:
        await worker.drain(0.0)


@pytest.mark.parametrize("skew_s", [-HOUR, 0.0, HOUR], ids=["sender-behind", "in-step", "sender-ahead"])
async def test_a_skewed_senders_request_gets_its_time_on_the_receivers_clock(skew_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch_module, "time", skewed_clock(skew_s))
    bus = LoopbackBus()
    error, elapsed = await run_until_the_deadline(bus)
    # Not refused at once (a sender behind), nor left running for an hour (a sender ahead): ended at its deadline.
    assert (error.status, error.code) == (504, "deadline_exceeded"), error
    assert REQUEST_TIMEOUT_S * 0.8 <= elapsed < REQUEST_TIMEOUT_S + 2.0


async def test_the_wire_carries_time_left_and_no_moment() -> None:
    bus = LoopbackBus()
    await run_until_the_deadline(bus)
    (route,) = [msgspec.msgpack.decode(data, type=RouteRequest) for subject, data in bus.sent if subject == subjects.ROUTE]
    to_workers = [msgspec.msgpack.decode(data, type=WorkerRequest) for subject, data in bus.sent if subject.endswith(".generate")]
    (generate,) = [message for message in to_workers if isinstance(message, GenerateRequest)]
    for message in (route, generate):
        assert "deadline" not in message.__struct_fields__ and 0 < message.timeout_s <= REQUEST_TIMEOUT_S
    # No field of either holds a moment (Unix epoch seconds, today about 1.7e9).
    assert not [value for value in floats_in(msgspec.to_builtins([route, generate])) if value > 1e6]


def floats_in(value: object) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [f for item in value for f in floats_in(item)] if isinstance(value, list) else []


async def test_a_kv_reference_goes_out_with_the_hold_left_and_lapses_on_the_pullers_clock() -> None:
    bus = LoopbackBus()
    holds = KvHolds(bus, "p0", release=lambda request_id: None)  # type: ignore[arg-type]
    await holds.start()
    ref = KvRef("p0", "p0", "r1", num_tokens=16, hold_s=30.0)
    holds.hold("r1", ref)
    # What the prefill node sends on is what is left of its hold, measured on its own clock.
    assert 29.0 < holds.time_left("r1") <= 30.0
    assert holds.time_left("never-held") == 0.0
    puller = KvPuller(bus, "d0", timeout_s=1.0)  # type: ignore[arg-type]
    await puller.pull("r1", ref, held_until=time.monotonic() + 29.0)  # granted: the source still holds it
    with pytest.raises(KvPullFailed, match="expired"):
        await puller.pull("r1", ref, held_until=time.monotonic() - 0.1)
