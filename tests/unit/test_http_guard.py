"""The ingress's HTTP guard: the pure caps, the error answers, and the guard in a real aiohttp server on a socket."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from hypothesis import given, settings
from hypothesis import strategies as st

from services.ingress.http_guard import ClientLimits, HttpGuard, http_error, raw_response
from shared.config import IngressSettings
from tests.raw_http import exchange
from tests.waiting import until

SECRET = "sk-guardtest-0123456789abcdef"


# --- the pure part ----------------------------------------------------------------------------


def test_connection_caps_per_client_then_in_all() -> None:
    limits = ClientLimits(max_connections=5, max_connections_per_client=3, max_streams_per_client=0)
    assert [limits.open("a") for _ in range(3)] == [None, None, None]
    refused = limits.open("a")
    assert refused is not None and refused.status == 429 and refused.code == "too_many_connections_per_client"
    assert refused.retry_after_s == 1.0
    assert limits.open("b") is None and limits.open("c") is None
    total = limits.open("d")
    assert total is not None and total.code == "too_many_connections"
    assert limits.open_connections == 5  # refused ones are not counted
    limits.close("a")
    assert limits.open("d") is None


def test_stream_cap_counts_per_client() -> None:
    limits = ClientLimits(0, 0, max_streams_per_client=2)
    assert limits.start_stream("a") is None and limits.start_stream("a") is None
    refused = limits.start_stream("a")
    assert refused is not None and refused.code == "too_many_streams_per_client" and refused.status == 429
    assert limits.start_stream("b") is None
    limits.end_stream("a")
    assert limits.start_stream("a") is None


def test_zero_means_no_limit() -> None:
    limits = ClientLimits(0, 0, 0)
    assert all(limits.open("a") is None and limits.start_stream("a") is None for _ in range(10_000))


@given(st.lists(st.tuples(st.booleans(), st.sampled_from("abc")), max_size=200), st.integers(0, 4), st.integers(0, 3))
@settings(derandomize=True, max_examples=200)
def test_caps_hold_and_counts_return_to_zero(ops: list[tuple[bool, str]], total: int, per_client: int) -> None:
    limits = ClientLimits(total, per_client, 0)
    held: list[str] = []
    for opening, client in ops:
        if opening:
            if limits.open(client) is None:
                held.append(client)
        elif client in held:
            held.remove(client)
            limits.close(client)
        assert not total or limits.open_connections <= total
        assert not per_client or all(n <= per_client for n in limits.connections.values())
        assert limits.open_connections == len(held)
    for client in held:
        limits.close(client)
    assert not limits.connections


def test_errors_for_bad_heads_quote_nothing_of_the_request() -> None:
    header = LineTooLong(b"Bearer " + SECRET.encode() + b"...", 8190)
    url = LineTooLong(bytearray(b"/v1/models?" + SECRET.encode()), 8190)
    too_many = BadHttpMessage("Too many headers received")
    invalid = BadHttpMessage(f"Invalid HTTP header: {SECRET}")
    answers = {exc: http_error(400, exc) for exc in (header, url, too_many, invalid)}
    assert [(e.status, e.code) for e in answers.values()] == [
        (431, "request_header_fields_too_large"), (414, "uri_too_long"), (431, "request_header_fields_too_large"),
        (400, "bad_http_request"),
    ]
    for error in answers.values():
        assert b"guardtest" not in msgspec.json.encode(error.body())
    assert http_error(500, RuntimeError(SECRET)).message == "internal error"


def test_raw_response_is_a_closing_http_response() -> None:
    raw = raw_response(http_error(408, None))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"Connection: close" in head and f"Content-Length: {len(body)}".encode() in head
    assert json.loads(body)["error"]["type"] == "timeout_error"


# --- the guard in a real aiohttp server -----------------------------------------------------------


async def _echo(request: web.Request) -> web.Response:
    return web.json_response({"bytes": len(await request.read())})


async def _slow(request: web.Request) -> web.Response:
    await asyncio.sleep(1.0)
    return web.json_response({"ok": True})


@pytest.fixture
async def guarded() -> object:
    settings = IngressSettings(header_timeout_s=0.5, body_timeout_s=0.5, max_field_size=1024, max_headers=20,
                               max_connections=4, max_connections_per_client=2, max_streams_per_client=1)
    guard = HttpGuard(settings, ["/slow"])
    app = web.Application(middlewares=[guard.middleware])
    app.router.add_route("*", "/echo", _echo)
    app.router.add_post("/slow", _slow)
    runner = guard.runner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield guard, port
    await runner.cleanup()


GET = b"GET /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"


async def _exchange(port: int, *parts: bytes, pause: float = 0.0, source: str | None = None) -> tuple[float, bytes]:
    return await exchange(port, *parts, pause=pause, source=source, timeout=5)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_slow_head_and_silent_connection_get_408_then_close(guarded: tuple[HttpGuard, int]) -> None:
    _, port = guarded
    elapsed, answer = await _exchange(port)  # connects, says nothing
    assert _status(answer) == 408 and b'"code":"request_timeout"' in answer and 0.4 < elapsed < 2.0
    # Half a head, then silence: cut off at the timeout counted from the connection's opening.
    elapsed, answer = await _exchange(port, b"GET /echo HTTP/1.1\r\nHost: t\r\n")
    assert _status(answer) == 408 and 0.4 < elapsed < 2.0
    assert _status((await _exchange(port, GET))[1]) == 200


async def test_slow_body_gets_408_and_the_connection_closes(guarded: tuple[HttpGuard, int]) -> None:
    _, port = guarded
    elapsed, answer = await _exchange(port, b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
    assert _status(answer) == 408 and b"request body not received" in answer and 0.4 < elapsed < 2.0
    assert _status((await _exchange(port, GET))[1]) == 200


async def test_oversized_heads_are_refused_without_echoing_them(guarded: tuple[HttpGuard, int]) -> None:
    _, port = guarded
    big = b"GET /echo HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + SECRET.encode() + b"x" * 2000 + b"\r\n\r\n"
    many = b"GET /echo HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(30)) + b"\r\n"
    long_url = b"GET /echo?" + b"q" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n"
    for request, status in ((big, 431), (many, 431), (long_url, 414)):
        _, answer = await _exchange(port, request)
        assert _status(answer) == status, answer[:200]
        assert SECRET.encode() not in answer and b"guardtest" not in answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"]
    assert _status((await _exchange(port, GET))[1]) == 200


async def test_connection_caps(guarded: tuple[HttpGuard, int]) -> None:
    guard, port = guarded
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    _, answer = await _exchange(port, GET)
    assert _status(answer) == 429 and b"Retry-After: 1" in answer and b"too_many_connections_per_client" in answer
    # Another address still gets in, up to the total.
    held += [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0)) for _ in range(2)]
    _, answer = await _exchange(port, GET, source="127.0.0.3")
    assert _status(answer) == 429 and b'"too_many_connections"' in answer
    assert guard.limits.open_connections == 4
    for _, writer in held:
        writer.close()
    await until(lambda: guard.limits.open_connections == 0, 5.0, "connections closed", every_s=0.005)
    assert _status((await _exchange(port, GET))[1]) == 200


async def test_stream_cap_per_client(guarded: tuple[HttpGuard, int]) -> None:
    guard, port = guarded
    post = b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    first = asyncio.create_task(_exchange(port, post))
    await until(lambda: bool(guard.limits.streams), 5.0, "the first stream", every_s=0.005)  # the first is in flight
    _, answer = await _exchange(port, post)
    assert _status(answer) == 429 and b"too_many_streams_per_client" in answer and b"Retry-After: 1" in answer
    _, other = await _exchange(port, post, source="127.0.0.2")  # another client has its own allowance
    assert _status(other) == 200
    assert _status((await first)[1]) == 200
    assert not guard.limits.streams
    assert _status((await _exchange(port, post))[1]) == 200
