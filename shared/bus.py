"""The NATS bus: typed publish, request/reply with a deadline, queue-group
subscriptions whose handlers cannot crash the service, and streamed replies.

Messages are msgspec Structs encoded as msgpack. Every publish and request
carries W3C `traceparent` in NATS headers; every handler runs inside a span
whose parent is the sender's, so one trace spans all services.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import msgspec
import nats
import nats.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from contracts import subjects
from contracts.messages import ErrorReply, StreamBatch, StreamEnd, StreamFrame, StreamMessage
from shared.config import NatsSettings
from shared.credentials import nats_options
from shared.telemetry import Telemetry

T = TypeVar("T")
Handler = Callable[[T, Msg], Awaitable[msgspec.Struct | None]]
# A handler run in the connection's read loop itself (`Bus.subscribe(at_once=True)`): it must not block or await.
ImmediateHandler = Callable[[T, Msg], None]

log = structlog.get_logger("kvlane.bus")

# The status header NATS puts on the reply to a request nobody subscribes to.
_STATUS_HEADER = "Status"
_NO_RESPONDERS = "503"
# After a connection's reply prefix: what comes there is passed on to the rest of the subject (`Bus.relaying_to`).
_RELAY = "relay."
# msgspec raises UnicodeDecodeError, not DecodeError, for some malformed strings (a string's length header that
# does not match its bytes): either is a message that cannot be decoded.
_UNDECODABLE = (msgspec.DecodeError, UnicodeDecodeError)


class BusError(Exception):
    """A request that got no usable answer."""


class NoResponders(BusError):
    """Nobody listens on the subject (for example the worker is gone)."""


class RequestTimeout(BusError):
    pass


class Bus:
    def __init__(self, nc: NatsClient, telemetry: Telemetry) -> None:
        self._nc = nc
        self._telemetry = telemetry
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders: dict[Any, msgspec.msgpack.Decoder] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        # Set while the connection is lost (not closed): goodbyes on the way out stop waiting for a server that is gone.
        self._connection_lost = asyncio.Event()
        # Tracing off here: a message that brings no trace context gets no span either.
        self._tracing = not isinstance(telemetry.tracer, trace.NoOpTracer)
        # Replies to this connection's requests: one wildcard inbox, a future per request by its token.
        self._reply_prefix = ""
        self._reply_inbox_ready: asyncio.Future[str] | None = None
        self._awaited_replies: dict[str, asyncio.Future[Msg | None]] = {}
        self._reply_tokens = map(str, itertools.count())
        # Monotonic time of the last reconnect: messages in flight around it
        # may be lost, so streams that go quiet after it should not wait long.
        self.reconnected_at: float | None = None

    @classmethod
    async def connect(cls, settings: NatsSettings, name: str, telemetry: Telemetry) -> Bus:
        """Connect, retrying with capped exponential backoff until it works.

        After the first connection nats-py reconnects by itself (for ever by
        default), so a NATS restart costs a pause, not the service.
        """
        delay = settings.reconnect_wait_s
        bus = cls(NatsClient(), telemetry)
        while True:
            try:
                await bus._nc.connect(
                    **nats_options(settings),
                    name=name,
                    connect_timeout=settings.connect_timeout_s,
                    reconnect_time_wait=settings.reconnect_wait_s,
                    max_reconnect_attempts=settings.max_reconnect_attempts,
                    ping_interval=settings.ping_interval_s,
                    max_outstanding_pings=settings.max_outstanding_pings,
                    drain_timeout=settings.drain_timeout_s,
                    error_cb=_on_error,
                    disconnected_cb=bus._on_disconnected,
                    reconnected_cb=bus._on_reconnected,
                )
                return bus
            except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
                log.warning("nats_connect_failed", url=settings.url, error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    @property
    def client(self) -> NatsClient:
        """The NATS connection itself, for what speaks plain NATS rather than typed messages (a `nats.micro` service)."""
        return self._nc

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    def _decoder(self, message_type: Any) -> msgspec.msgpack.Decoder:
        decoder = self._decoders.get(message_type)
        if decoder is None:
            decoder = self._decoders[message_type] = msgspec.msgpack.Decoder(message_type)
        return decoder

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    async def publish(
        self, subject: str, message: msgspec.Struct, *, traced: bool = True, context: Context | None = None, reply: str = "",
    ) -> None:
        """`context`: the trace the message belongs to (default: the current span's). `reply`: where its
        receiver answers (a `ReplySlot` of another connection)."""
        headers = self._telemetry.inject(context=context) if traced else None
        await self._nc.publish(subject, self._encoder.encode(message), reply=reply, headers=headers or None)

    def sender_context(self, msg: Msg) -> Context:
        """The trace a received message belongs to (for what its handler sends on in the sender's name)."""
        return self._telemetry.extract(msg.headers)

    async def request(
        self, subject: str, message: msgspec.Struct, reply_type: type[T] | Any, timeout: float, *, context: Context | None = None
    ) -> T:
        """Send and wait for one typed reply; raise `NoResponders` or `RequestTimeout`.

        `context`: the trace the request belongs to (default: the current span's).

        Not `NatsClient.request`: per call it draws random bytes from the OS
        for the reply token and waits through `asyncio.wait_for` (two more
        futures and a loop iteration). Here a reply is a counter's token on
        this connection's one reply inbox, resolved by its future directly.
        """
        headers = self._telemetry.inject(context=context)
        with await self.reply_slot() as slot:
            await self._nc.publish(subject, self._encoder.encode(message), reply=slot.subject, headers=headers or None)
            return await slot.wait(reply_type, timeout, subject)

    async def reply_slot(self) -> ReplySlot:
        """A place on this connection's reply inbox for one reply, to a request that someone else may send
        (`publish(..., reply=slot.subject)`). Close it (or use it as a context manager) when done."""
        prefix = self._reply_prefix or await self._reply_inbox()
        token = next(self._reply_tokens)
        waiting = self._awaited_replies[token] = asyncio.get_running_loop().create_future()
        return ReplySlot(prefix + token, waiting, lambda: self._awaited_replies.pop(token, None), self._decoder)

    async def _reply_inbox(self) -> str:
        """This connection's reply inbox prefix, subscribed on first use (concurrent first requests share it)."""
        if self._reply_inbox_ready is None:
            self._reply_inbox_ready = asyncio.get_running_loop().create_future()
            try:
                prefix = self._nc.new_inbox() + "."
                # Before the first request goes out: the SUB is queued ahead of its PUB on this connection.
                await self._nc.subscribe(prefix + "*", future=_AtOnce(self._on_reply))
                await self._nc.subscribe(prefix + _RELAY + ">", future=_AtOnce(self._on_relayed))
            except BaseException as exc:
                ready, self._reply_inbox_ready = self._reply_inbox_ready, None
                ready.set_exception(exc)
                ready.exception()  # retrieved: the next request tries again
                raise
            self._reply_prefix = prefix
            self._reply_inbox_ready.set_result(prefix)
        return await asyncio.shield(self._reply_inbox_ready)

    async def relaying_to(self, subject: str) -> str:
        """A reply subject of this connection that passes NATS's *no responders* status, and error replies,
        on to `subject`.

        For a message this connection sends in another's name, to be answered at `subject`. NATS
        tells only the sender's own subscriptions that nobody listened; passed on, it tells the one
        who waits, at once rather than at its timeout. So does an `ErrorReply` (the answerer could not
        decode the message, or failed handling it); any other answer stops here.
        """
        return (self._reply_prefix or await self._reply_inbox()) + _RELAY + subject

    def _on_relayed(self, msg: Msg) -> None:
        # Only NATS's own status and error replies pass, re-encoded here: whoever may answer this
        # connection could otherwise have it publish anything to any subject it may publish to.
        # An error is what a bus answers to a request it could not decode or handle; dropped, the
        # one who waits would wait for its timeout and blame the answerer's silence.
        target = msg.subject[len(self._reply_prefix) + len(_RELAY):]
        if _is_no_responders(msg):
            self.spawn(self._nc.publish(target, b"", headers={_STATUS_HEADER: _NO_RESPONDERS}))
            return
        try:
            error = self._decoder(ErrorReply).decode(msg.data)
        except _UNDECODABLE:
            log.debug("relay_dropped", subject=msg.subject, size=len(msg.data))
            return
        self.spawn(self._nc.publish(target, self._encoder.encode(error)))

    def _on_reply(self, msg: Msg) -> None:
        waiting = self._awaited_replies.get(msg.subject[len(self._reply_prefix):])
        if waiting is not None:
            _settle(waiting, msg)  # a late reply to a request that gave up finds nobody

    async def subscribe(
        self,
        subject: str,
        message_type: type[T] | Any,
        handler: Handler[T] | ImmediateHandler[T],
        *,
        queue: str = "",
        concurrent: bool = False,
        traced: bool = True,
        at_once: bool = False,
        span_name: str = "",
    ) -> Subscription:
        """Run `handler` for each message; its return value is the reply.

        Garbage gets an `ErrorReply` (when a reply is expected) or a log
        line, and a handler that raises answers `internal`: either way the
        subscription keeps serving. `concurrent` runs each message as its
        own task instead of one after another. `traced=False` skips the span
        (for high-rate frames such as streamed tokens). `at_once`: `handler`
        is a plain function, run in the connection's read loop as each
        message is parsed, with no span and no reply (for messages that only
        wake a waiting task, such as streamed frames). `span_name`: the
        subject the handler's span names, where not `subject` (one name for
        one kind of request, whichever subscription took it).
        """
        decoder = self._decoder(message_type)
        if at_once:
            if inspect.iscoroutinefunction(handler):
                raise TypeError(f"an at_once handler must be a plain function, not a coroutine function ({handler!r})")
            def deliver(msg: Msg) -> None:
                try:
                    message = decoder.decode(msg.data)
                except _UNDECODABLE as exc:
                    log.warning("bad_message", subject=msg.subject, error=str(exc), size=len(msg.data))
                    return
                handler(message, msg)

            subscription = await self._nc.subscribe(subject, queue=queue, future=_AtOnce(deliver))
            await self._nc.flush()
            await self._nc.flush()  # twice: see below
            return subscription

        async def serve(msg: Msg) -> None:
            try:
                message = decoder.decode(msg.data)
            except _UNDECODABLE as exc:
                log.warning("bad_message", subject=msg.subject, error=str(exc), size=len(msg.data))
                await self._reply(msg, ErrorReply(code="bad_request", message=f"undecodable message: {exc}", status=400))
                return
            if traced and (self._tracing or msg.headers):
                # With tracing off, a caller's trace context still passes through the handler to what it sends.
                context = self._telemetry.extract(msg.headers)
                with self._telemetry.tracer.start_as_current_span(f"handle {span_name or subject}", context=context,
                                                                  kind=SpanKind.CONSUMER):
                    await handle(message, msg)
            else:
                await handle(message, msg)

        async def handle(message: Any, msg: Msg) -> None:
            try:
                reply = await handler(message, msg)
            except Exception as exc:  # a handler bug must not end the subscription
                log.exception("handler_failed", subject=msg.subject)
                reply = ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}", status=500)
            if reply is not None:
                await self._reply(msg, reply)

        if concurrent:
            # Each message becomes its task as it is parsed, not after a wait in the subscription's queue and task.
            subscription = await self._nc.subscribe(subject, queue=queue, future=_AtOnce(lambda msg: self.spawn(serve(msg))))
        else:
            subscription = await self._nc.subscribe(subject, queue=queue, cb=serve)
        # Once subscribe returns, the server knows the interest: a request
        # sent right after from another connection finds a responder. Twice,
        # because nats-py writes a flush's PING straight to the socket, ahead
        # of the queued SUB: the first PONG can come back before the server
        # has seen the SUB, the second cannot.
        await self._nc.flush()
        await self._nc.flush()
        return subscription

    async def _reply(self, msg: Msg, reply: msgspec.Struct) -> None:
        if msg.reply:
            try:
                # Not `msg.respond`: it sends the request's headers back too, which no requester reads.
                await self._nc.publish(msg.reply, self._encoder.encode(reply))
            except nats.errors.Error as exc:
                log.warning("reply_failed", subject=msg.subject, error=str(exc))

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        """Run a task whose reference the bus keeps until it ends."""
        # `create_task` for a coroutine (every message of a concurrent subscription): `ensure_future` looks up the loop each time.
        task = asyncio.get_running_loop().create_task(coro) if asyncio.iscoroutine(coro) else asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def flush(self, timeout: float = 2.0) -> None:
        """Until what was published has reached the server (`unless_disconnected`: callers flush as they leave).
        What is not flushed waits in the client's buffer, and peers that miss it see the node's heartbeats stop."""
        try:
            await self.unless_disconnected(lambda: self._nc.flush(timeout=timeout), "flush")
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("flush_failed", error=str(exc))

    async def unless_disconnected(self, goodbye: Callable[[], Awaitable[Any]], what: str) -> bool:
        """Await `goodbye()` (a flush, a drain on the way out) unless the connection is or gets lost first: NATS
        gone (down with the fleet) would have it wait out nats-py's timeouts (10 s a flush) and hold the exit.
        Whether it finished; its errors are raised."""
        if not self._nc.is_connected:
            log.warning("skipped_while_disconnected", what=what)
            return False
        finishing = asyncio.ensure_future(goodbye())
        lost = asyncio.ensure_future(self._connection_lost.wait())
        try:
            await asyncio.wait([finishing, lost], return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if finishing.done():
            finishing.result()
            return True
        finishing.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await finishing
        log.warning("abandoned_while_disconnected", what=what)
        return False

    async def _on_reconnected(self) -> None:
        self._connection_lost.clear()
        self.reconnected_at = time.monotonic()
        log.info("nats_reconnected")

    async def _on_disconnected(self) -> None:
        if not self._nc.is_closed:  # lost, not closed on purpose (nats-py says both this way)
            self._connection_lost.set()
        # A disconnect while closing is the drain we asked for, not news.
        (log.debug if self._closing else log.warning)("nats_disconnected")

    async def close(self) -> None:
        self._closing = True
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        if not self._nc.is_closed:
            try:
                if await self.unless_disconnected(self._nc.drain, "drain"):
                    return
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                log.warning("drain_failed", error=str(exc))
            await self._nc.close()


async def _on_error(exc: Exception) -> None:
    log.warning("nats_error", error=str(exc))


def _is_no_responders(msg: Msg) -> bool:
    """NATS's own answer that nobody listened: a status header and no payload."""
    return not msg.data and bool(msg.headers) and msg.headers.get(_STATUS_HEADER) == _NO_RESPONDERS


def _settle(waiting: asyncio.Future, result: Any) -> None:
    if not waiting.done():
        waiting.set_result(result)


# nats-py internals (`Subscription._future`, what it asks of one): tests/unit/test_dependency_internals.py pins them.
class _AtOnce:
    """What nats-py takes for a request's reply future, handing it every message of a subscription instead.

    A subscription with a callback gets a task of its own from nats-py, and
    each message waits a loop iteration in its queue before the callback
    runs; a reply future is set in the read loop as the message is parsed.
    Replies and streamed frames only wake a waiting task, so they go the
    second way and the task wakes one iteration sooner. `deliver` runs
    inside nats-py's read loop: whatever it raises is logged here, never
    left to break the connection.
    """

    __slots__ = ("_deliver",)

    def __init__(self, deliver: Callable[[Msg], None]) -> None:
        self._deliver = deliver

    def cancelled(self) -> bool:
        return False

    def set_result(self, msg: Msg) -> None:
        try:
            self._deliver(msg)
        except Exception:
            log.exception("delivery_failed", subject=msg.subject)


class _GivenUp(NamedTuple):
    reason: str


class ReplySlot:
    """One reply awaited on a connection's reply inbox (`Bus.reply_slot`)."""

    def __init__(self, subject: str, waiting: asyncio.Future, release: Callable[[], object],
                 decoder: Callable[[Any], msgspec.msgpack.Decoder]) -> None:
        self.subject = subject
        self._waiting = waiting
        self._release = release
        self._decoder = decoder

    async def wait(self, reply_type: type[T] | Any, timeout: float, sent_to: str) -> T:
        """The typed reply; `NoResponders` when nobody listened on `sent_to`, `RequestTimeout` after `timeout`."""
        expiry = asyncio.get_running_loop().call_later(timeout, _settle, self._waiting, None)
        try:
            reply = await self._waiting
        finally:
            expiry.cancel()
        if reply is None:
            raise RequestTimeout(f"{sent_to}: no reply within {timeout:.1f}s")
        if isinstance(reply, _GivenUp):
            raise RequestTimeout(f"{sent_to}: {reply.reason}")
        if _is_no_responders(reply):
            raise NoResponders(sent_to)
        try:
            return self._decoder(reply_type).decode(reply.data)
        except _UNDECODABLE as exc:
            raise BusError(f"{sent_to}: undecodable reply: {exc}") from exc

    def give_up(self, reason: str) -> None:
        """End the wait now, as a `RequestTimeout` saying `reason` (the answerer is known to have gone silent)."""
        _settle(self._waiting, _GivenUp(reason))

    def close(self) -> None:
        self._release()

    def __enter__(self) -> ReplySlot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ReplyStream:
    """The frames of one streamed reply, in order, as they arrive.

    One timer per stream, not one per frame: a wait moves the stream's
    deadline, and the timer, when it fires early, sleeps on to the latest.
    """

    def __init__(self, request_id: str, subject: str, release: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.subject = subject
        self._frames: deque[StreamFrame] = deque()
        self._release = release
        # The reader's future while it waits: True when a frame came, False when the wait timed out.
        self._waiter: asyncio.Future[bool] | None = None
        self._deadline = 0.0  # loop time at which the current wait times out
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def put(self, frame: StreamFrame) -> None:
        self._frames.append(frame)
        if self._waiter is not None:
            _settle(self._waiter, True)

    async def next(self, timeout: float) -> StreamFrame:
        """The next frame; `RequestTimeout` if none comes within `timeout`.

        A plain future, not `asyncio.wait_for`: on Python 3.11 that swallows a
        cancellation that lands as a frame arrives, and a cancelled caller (a
        client that hung up) would then go on relaying a request nobody reads.
        """
        if self._frames:
            return self._frames.popleft()
        loop = asyncio.get_running_loop()
        self._deadline = deadline = loop.time() + timeout
        if self._timer is None or self._timer_at > deadline:
            self._arm(loop, deadline)
        self._waiter = waiter = loop.create_future()
        try:
            arrived = await waiter
        finally:
            self._waiter = None
        if not arrived:
            raise RequestTimeout(f"stream {self.request_id}: no frame within {timeout:.1f}s")
        return self._frames.popleft()

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = loop.call_at(at, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return  # nobody waits: the next wait arms it again
        if loop.time() >= self._deadline:
            _settle(self._waiter, False)
        else:
            self._arm(loop, self._deadline)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._release(self.request_id)

    def __enter__(self) -> ReplyStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamReceiver:
    """One wildcard subscription that fans streamed replies out by request id.

    One subscription per process (not per request) keeps NATS interest
    updates off the hot path.
    """

    def __init__(self, bus: Bus, owner_id: str) -> None:
        self._bus = bus
        self._owner_id = owner_id
        self._open: dict[str, ReplyStream] = {}
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        self._subscription = await self._bus.subscribe(
            subjects.stream_inbox(self._owner_id), StreamMessage, self._dispatch, traced=False, at_once=True
        )

    def _dispatch(self, message: StreamMessage, msg: Msg) -> None:
        for request_id, frame in addressed_frames(msg.subject, message):
            stream = self._open.get(request_id)
            if stream is None:
                # Late frames of a request the caller already gave up on.
                log.debug("stream_frame_dropped", request_id=request_id, frame=type(frame).__name__)
                continue
            stream.put(frame)

    def open(self, request_id: str) -> ReplyStream:
        if request_id in self._open:
            raise ValueError(f"stream {request_id} is already open")
        stream = ReplyStream(request_id, subjects.stream_subject(self._owner_id, request_id), self._open.pop)
        self._open[request_id] = stream
        return stream

    @property
    def open_count(self) -> int:
        return len(self._open)


def addressed_frames(subject: str, message: StreamMessage) -> list[tuple[str, StreamFrame]]:
    """(stream, frame) pairs of one message on a stream subject: a batch's frames, or one frame for the subject's stream."""
    if isinstance(message, StreamBatch):
        return [(addressed.stream, addressed.frame) for addressed in message.frames]
    return [(subject.rsplit(".", 1)[-1], message)]


def is_final(frame: StreamFrame) -> bool:
    return isinstance(frame, (StreamEnd, ErrorReply))
