"""HTTP hardening of the ingress: slow clients, oversized heads, too many connections or streams.

aiohttp enforces the sizes (`max_line_size`, `max_field_size`, `max_headers`)
and closes idle keep-alive connections (`keepalive_timeout`). The rest is
here, around aiohttp's own server:

* **head timeout** (slowloris): a request head must arrive whole within
  `header_timeout_s` of its first byte, or of the connection's opening for
  the first request, else the client gets 408 and the connection closes.
  aiohttp's keep-alive timer alone would wait up to `keepalive_timeout_s`
  (75 s) for a trickled head, and reset on nothing.
* **body timeout**: the body must arrive within `body_timeout_s` of the
  head (the middleware reads it under a deadline): 408, connection closed.
* **connection caps**, in all and per client address: a connection over a
  cap is still accepted (refusing at `accept` would leave the client a
  reset, not an answer) and its first request is answered 429 with
  `Retry-After`, then it is closed; it never counts against the caps.
* **stream cap**: completions in flight per client address (streamed or
  not: each holds a worker's token stream); one more is 429.
* **errors aiohttp answers itself** (a malformed or oversized head) come in
  the OpenAI error shape and never quote the request: aiohttp's own answer
  and log line would quote up to 100 bytes of the offending header, an
  `Authorization` header's token included.

`ClientLimits` is the pure bookkeeping; `GuardedHandler`/`GuardedServer`/
`GuardedRunner` put it and the timers into aiohttp's server; `HttpGuard`
holds the settings and the middleware.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Collection
from http import HTTPStatus
from typing import Any

import msgspec
import structlog
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from services.ingress.errors import ApiError
from shared.config import IngressSettings

log = structlog.get_logger("kvlane.ingress")
_ENCODER = msgspec.json.Encoder()
RETRY_AFTER_S = 1.0
# What a request line looks like when aiohttp reports it too long (the C parser gives the
# target, the Python parser the whole line): anything else too long is a header line.
_REQUEST_LINE = re.compile(rb"^(/|\*|https?:|[A-Z]+ )")


class ClientLimits:
    """Open connections, in all and per client address, and completions in flight per address (0: no limit)."""

    def __init__(self, max_connections: int, max_connections_per_client: int, max_streams_per_client: int) -> None:
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.max_streams_per_client = max_streams_per_client
        self.connections: Counter[str] = Counter()
        self.streams: Counter[str] = Counter()

    @property
    def open_connections(self) -> int:
        return sum(self.connections.values())

    def open(self, client: str) -> ApiError | None:
        """Count a new connection from `client`; or, over a cap, the error to answer it with (and count nothing)."""
        if self.max_connections and self.open_connections >= self.max_connections:
            return ApiError(429, f"too many open connections (at most {self.max_connections})",
                            code="too_many_connections", retry_after_s=RETRY_AFTER_S)
        if self.max_connections_per_client and self.connections[client] >= self.max_connections_per_client:
            return ApiError(429, f"too many open connections from this client (at most {self.max_connections_per_client})",
                            code="too_many_connections_per_client", retry_after_s=RETRY_AFTER_S)
        self.connections[client] += 1
        return None

    def close(self, client: str) -> None:
        _decrement(self.connections, client)

    def start_stream(self, client: str) -> ApiError | None:
        """Count a completion `client` starts; or, over its cap, the error to answer it with."""
        if self.max_streams_per_client and self.streams[client] >= self.max_streams_per_client:
            return ApiError(429, f"too many concurrent completions from this client (at most {self.max_streams_per_client})",
                            code="too_many_streams_per_client", retry_after_s=RETRY_AFTER_S)
        self.streams[client] += 1
        return None

    def end_stream(self, client: str) -> None:
        _decrement(self.streams, client)


def _decrement(counter: Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


def http_error(status: int, exc: BaseException | None) -> ApiError:
    """The answer to a request aiohttp could not take, in the OpenAI shape, quoting nothing of the request."""
    if isinstance(exc, LineTooLong):
        line = exc.args[0] if exc.args and isinstance(exc.args[0], (bytes, bytearray)) else b""
        if _REQUEST_LINE.match(bytes(line)):
            return ApiError(414, "request line too long", code="uri_too_long")
        return ApiError(431, "request header fields too large", code="request_header_fields_too_large")
    if isinstance(exc, BadHttpMessage) and "too many headers" in exc.message.lower():
        return ApiError(431, "too many request header fields", code="request_header_fields_too_large")
    if status == 400:
        return ApiError(400, "malformed HTTP request", code="bad_http_request")
    if status == 500:
        return ApiError(500, "internal error", code="internal_error")
    try:
        phrase = HTTPStatus(status).phrase.lower()
    except ValueError:
        phrase = "error"
    return ApiError(status, phrase, code=phrase.replace(" ", "_"))


def raw_response(error: ApiError) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for when no request object exists."""
    body = _ENCODER.encode(error.body())
    reason = HTTPStatus(error.status).phrase
    head = (f"HTTP/1.1 {error.status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


def client_address(transport: asyncio.BaseTransport | None) -> str:
    peer = None if transport is None else transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "local"


class GuardedHandler(RequestHandler):
    """aiohttp's per-connection protocol, with the head timeout, the cap verdict and errors that quote nothing.

    It reads three of its base's private fields: `_request_count` (request
    heads parsed), `_request_in_progress` and `_messages` (parsed, not yet
    handled), and sets `_lingering_time`; tests/integration/test_http_hardening.py
    and tests/unit/test_dependency_internals.py fail if aiohttp changes them.
    """

    def __init__(self, manager: GuardedServer, *, guard: HttpGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.client = "local"
        # The answer to this connection's first request when it is over a cap (it is then not counted).
        self.refusal: ApiError | None = None
        self.counted = False
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:  # a head (or a malformed one) is whole
            self._disarm_head_timer()
        elif data and not self._request_in_progress and not self._messages:
            self._arm_head_timer()  # the first byte of the next head

    def _arm_head_timer(self) -> None:
        if self._head_timer is None and self.transport is not None:
            self._head_timer = self._loop.call_later(self.guard.settings.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._request_in_progress or self._messages or self.transport is None:
            return
        log.info("request_head_timeout", client=self.client, timeout_s=self.guard.settings.header_timeout_s)
        error = ApiError(408, f"request head not received within {self.guard.settings.header_timeout_s:g}s",
                         code="request_timeout")
        self.transport.write(raw_response(error))
        self.force_close()  # the transport sends what it holds, then closes

    def stop_lingering(self) -> None:
        """Close right after the response instead of reading on what the client still sends (a slow body)."""
        self._lingering_time = 0.0

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        # aiohttp's own would log the exception with its message and answer with it: both quote the request.
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        error = http_error(status, exc)
        if error.status >= 500:
            log.error("http_error", status=error.status, error=type(exc).__name__ if exc else None, client=self.client)
        else:
            log.warning("bad_http_request", status=error.status, code=error.code,
                        error=type(exc).__name__ if exc else None, client=self.client)
        response = error.response()
        response.force_close()
        return response


class GuardedServer(web.Server):
    """aiohttp's protocol factory, making `GuardedHandler`s and counting their connections."""

    def __init__(self, guard: HttpGuard, handler: Any, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.guard = guard

    def __call__(self) -> GuardedHandler:
        return GuardedHandler(self, loop=self._loop, guard=self.guard, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if isinstance(handler, GuardedHandler):
            handler.client = client_address(transport)
            handler.refusal = self.guard.limits.open(handler.client)
            handler.counted = handler.refusal is None
            if handler.refusal is not None:
                log.warning("connection_refused", client=handler.client, code=handler.refusal.code)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        if isinstance(handler, GuardedHandler) and handler.counted:
            handler.counted = False
            self.guard.limits.close(handler.client)
        super().connection_lost(handler, exc)


class GuardedRunner(web.AppRunner):
    """`web.AppRunner` whose server is a `GuardedServer`."""

    def __init__(self, app: web.Application, guard: HttpGuard, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._guard = guard

    async def _make_server(self) -> web.Server:
        # aiohttp internals (this method, the server's `_loop` and `_kwargs`): tests/unit/test_dependency_internals.py.
        plain = await super()._make_server()
        return GuardedServer(
            self._guard, plain.request_handler, request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation, loop=plain._loop, **plain._kwargs,
        )


class HttpGuard:
    """The ingress HTTP server's limits: a runner that applies them, and the middleware for the per-request ones."""

    def __init__(self, settings: IngressSettings, counted_paths: Collection[str]) -> None:
        self.settings = settings
        self.limits = ClientLimits(settings.max_connections, settings.max_connections_per_client,
                                   settings.max_streams_per_client)
        # POSTs to these paths count as streams (the completion endpoints).
        self._counted_paths = frozenset(counted_paths)

    def server_kwargs(self) -> dict[str, Any]:
        """aiohttp's own limits (`web.AppRunner` passes them to each connection's handler)."""
        s = self.settings
        return {"max_line_size": s.max_line_size, "max_field_size": s.max_field_size, "max_headers": s.max_headers,
                "keepalive_timeout": s.keepalive_timeout_s}

    def runner(self, app: web.Application, **kwargs: Any) -> GuardedRunner:
        return GuardedRunner(app, self, **self.server_kwargs(), **kwargs)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        protocol = request.protocol
        guarded = protocol if isinstance(protocol, GuardedHandler) else None
        if guarded is not None and guarded.refusal is not None:
            return _closing(guarded.refusal)
        # A body that came whole with its head (nearly every one) needs no timer.
        if request.body_exists and request.can_read_body and not request.content.is_eof():
            try:
                async with asyncio.timeout(self.settings.body_timeout_s):
                    await request.read()  # kept by aiohttp: the handler's own read() returns it
            except TimeoutError:
                log.info("request_body_timeout", client=guarded.client if guarded else request.remote,
                         timeout_s=self.settings.body_timeout_s)
                if guarded is not None:
                    guarded.stop_lingering()
                return _closing(ApiError(408, f"request body not received within {self.settings.body_timeout_s:g}s",
                                         code="request_timeout"))
        if request.method != "POST" or request.path not in self._counted_paths:
            return await handler(request)
        client = guarded.client if guarded is not None else (request.remote or "local")
        if (refusal := self.limits.start_stream(client)) is not None:
            return refusal.response()
        try:
            return await handler(request)
        finally:
            self.limits.end_stream(client)


def _closing(error: ApiError) -> web.Response:
    response = error.response()
    response.force_close()
    return response
