"""The ingress's HTTP limits against a real sim fleet, driven over raw sockets.

Slow heads and bodies (slowloris), oversized heads, connection caps (per
client address and in all) and the per-client stream cap: each gets its
exact status and the connection's fate checked, and after each the ingress
still serves a normal request. A recognisable bearer token sent every way a
client could send it appears in no response and nowhere in the ingress log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator

import nats
import pytest

from contracts import subjects
from launch.fleet import Fleet, with_overrides
from tests.integration.conftest import MODEL, launch, stop_and_check
from tests.raw_http import exchange as raw_exchange
from tests.waiting import until

pytestmark = pytest.mark.integration

HEAD_TIMEOUT_S = BODY_TIMEOUT_S = 1.0
PER_CLIENT, TOTAL, STREAMS = 6, 9, 2
# Shaped like a kvlane key (`kvl_<id>_<secret>`), recognisable anywhere it might surface.
SECRET = "S3cr3tF0rHardeningTest_abcdefghijklmnopqrstu"
TOKEN = f"kvl_0123456789ab_{SECRET}"
LAST_SOURCE = "127.0.0.9"  # the address of the last request of the log test, and of no other


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    ingress = {"header_timeout_s": HEAD_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S, "max_field_size": 2048, "max_headers": 32,
               "max_line_size": 2048, "max_connections": TOTAL, "max_connections_per_client": PER_CLIENT,
               "max_streams_per_client": STREAMS}
    # Debug level: whatever the ingress logs at all, this test sees.
    fleet = launch(tmp_path_factory.mktemp("hardening"), tune=lambda c: with_overrides(c, ingress=ingress, logging={"level": "debug"}))
    yield fleet
    stop_and_check(fleet)


def _port(fleet: Fleet) -> int:
    return fleet.config.ingress.port


async def _open(fleet: Fleet, source: str | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", _port(fleet), local_addr=(source, 0) if source else None)


async def exchange(fleet: Fleet, *parts: bytes, pause: float = 0.0, source: str | None = None) -> tuple[float, bytes]:
    """Send `parts` (`pause` apart) on a new connection, then read until the server closes it."""
    return await raw_exchange(_port(fleet), *parts, pause=pause, source=source)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
    """One response with a Content-Length off a keep-alive connection: (status, head, body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    return int(head.split(b" ", 2)[1]), head, await reader.readexactly(length)


async def read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything until the server closes (what came before a reset included)."""
    data = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            data += chunk
    return data


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def body_of(answer: bytes) -> dict:
    return json.loads(answer.partition(b"\r\n\r\n")[2])


def post(path: str, body: dict | bytes, *, close: bool = True, extra: bytes = b"") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            f"{'Connection: close' if close else 'Connection: keep-alive'}\r\n").encode() + extra + b"\r\n" + data


def chat(max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": max_tokens, "stream": stream}


async def assert_serves(fleet: Fleet, source: str | None = None) -> None:
    _, answer = await exchange(fleet, post("/v1/chat/completions", chat()), source=source)
    assert status_of(answer) == 200, answer[:300]
    assert body_of(answer)["usage"]["completion_tokens"] == 4


GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"  # keep-alive


async def until_admitted(fleet: Fleet, source: str | None = None, timeout_s: float = 10.0) -> None:
    """Until a connection from `source` is served rather than refused for too many connections."""
    deadline = time.monotonic() + timeout_s
    while status_of((await exchange(fleet, b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
                                    source=source))[1]) != 200:
        assert time.monotonic() < deadline, f"connections from {source or '127.0.0.1'} still refused"
        await asyncio.sleep(0.05)


# --- slow clients ---------------------------------------------------------------------------------


async def test_a_silent_connection_and_a_trickled_head_get_408_and_are_closed(fleet: Fleet) -> None:
    elapsed, answer = await exchange(fleet)  # connects, sends nothing
    assert status_of(answer) == 408 and body_of(answer)["error"]["code"] == "request_timeout", answer
    assert HEAD_TIMEOUT_S * 0.9 < elapsed < HEAD_TIMEOUT_S + 2
    # A head trickled a header line every 0.3 s never completes in time: cut off at the timeout.
    lines = [b"POST /v1/chat/completions HTTP/1.1\r\n", *(b"X-Slow-%d: 1\r\n" % i for i in range(12))]
    reader, writer = await _open(fleet)

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            for line in lines:
                writer.write(line)
                await writer.drain()
                await asyncio.sleep(0.3)

    sender = asyncio.create_task(trickle())
    started = time.monotonic()
    try:
        answer = await asyncio.wait_for(read_all(reader), HEAD_TIMEOUT_S + 5)
    finally:
        sender.cancel()
        writer.close()
    elapsed = time.monotonic() - started
    assert HEAD_TIMEOUT_S * 0.9 < elapsed < HEAD_TIMEOUT_S + 2, elapsed
    # The 408, unless the client's next line drew a reset first: closed either way.
    assert not answer or status_of(answer) == 408
    await assert_serves(fleet)


async def test_a_slow_body_gets_408_and_the_connection_is_closed(fleet: Fleet) -> None:
    request = post("/v1/chat/completions", chat())
    elapsed, answer = await exchange(fleet, request[:-10])  # all but the body's last 10 bytes, then nothing
    assert status_of(answer) == 408 and b"request body not received" in answer and b"Connection: close" in answer
    assert BODY_TIMEOUT_S * 0.9 < elapsed < BODY_TIMEOUT_S + 2
    await assert_serves(fleet)


# --- oversized heads ------------------------------------------------------------------------------


async def test_oversized_heads_are_refused_in_the_openai_shape(fleet: Fleet) -> None:
    huge_header = post("/v1/chat/completions", chat(), extra=b"X-Big: " + b"b" * 4096 + b"\r\n")
    many_headers = post("/v1/chat/completions", chat(), extra=b"".join(b"X-H%d: 1\r\n" % i for i in range(40)))
    long_url = b"GET /v1/models?" + b"q" * 4096 + b" HTTP/1.1\r\nHost: t\r\n\r\n"
    for request, status in ((huge_header, 431), (many_headers, 431), (long_url, 414)):
        _, answer = await exchange(fleet, request)
        assert status_of(answer) == status, answer[:300]
        error = body_of(answer)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    await assert_serves(fleet)


# --- connection and stream caps -------------------------------------------------------------------


async def hold_connections(fleet: Fleet, count: int, source: str | None = None, timeout_s: float = 10.0,
                           ) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """`count` admitted keep-alive connections from `source`, held open.

    Connections of earlier tests may still count until the server sees them
    closed: a refusal then closes what is held and starts again, until all
    `count` are admitted at once.
    """
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def all_admitted() -> bool:
        try:
            for _ in range(count):
                reader, writer = await _open(fleet, source)
                held.append((reader, writer))
                writer.write(GET_HEALTH)
                if (await read_response(reader))[0] != 200:
                    break
            else:
                return True
        except BaseException:
            for _, writer in held:
                writer.close()
            raise
        for _, writer in held:
            writer.close()
        held.clear()
        return False

    await until(all_admitted, timeout_s, f"{count} connections from {source or '127.0.0.1'} never admitted at once")
    return held


async def test_connection_caps_per_client_address_and_in_all(fleet: Fleet) -> None:
    held = await hold_connections(fleet, PER_CLIENT)
    try:
        _, answer = await exchange(fleet, GET_HEALTH)
        assert status_of(answer) == 429 and b"Retry-After: 1" in answer and b"Connection: close" in answer
        assert body_of(answer)["error"] == {"message": f"too many open connections from this client (at most {PER_CLIENT})",
                                            "type": "rate_limit_error", "param": None, "code": "too_many_connections_per_client"}
        # Another address has its own allowance, up to the total.
        held += await hold_connections(fleet, TOTAL - PER_CLIENT, "127.0.0.2")
        _, answer = await exchange(fleet, GET_HEALTH, source="127.0.0.3")
        assert status_of(answer) == 429 and body_of(answer)["error"]["code"] == "too_many_connections"
    finally:
        for _, writer in held:
            writer.close()
    # Once the server has seen the held connections close, both addresses are admitted again.
    for source in (None, "127.0.0.3"):
        await until_admitted(fleet, source)
        await assert_serves(fleet, source)


async def test_streams_per_client_address_are_capped(fleet: Fleet) -> None:
    held = []
    try:
        for _ in range(STREAMS):
            reader, writer = await _open(fleet)
            held.append(writer)
            writer.write(post("/v1/chat/completions", chat(max_tokens=3000, stream=True)))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
            assert b"data: " in await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)  # streaming (chunked), and left so
        _, answer = await exchange(fleet, post("/v1/chat/completions", chat()))
        assert status_of(answer) == 429 and b"Retry-After: 1" in answer
        assert body_of(answer)["error"]["code"] == "too_many_streams_per_client"
        _, answer = await exchange(fleet, post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}))
        assert status_of(answer) == 429  # both completion endpoints count
        await assert_serves(fleet, "127.0.0.2")  # another client is not held back
    finally:
        for writer in held:
            writer.close()  # hanging up ends the streams (the handler is cancelled)

    async def admitted() -> bool:
        return status_of((await exchange(fleet, post("/v1/chat/completions", chat())))[1]) != 429

    await until(admitted, 10, "the streams of a client that hung up still count against it")
    await assert_serves(fleet)


# --- no secret echoed ---------------------------------------------------------------------------------


async def test_a_bearer_token_is_echoed_in_no_response_and_no_log_line(fleet: Fleet) -> None:
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    requests = [
        post("/v1/chat/completions", chat(), extra=auth),
        post("/v1/chat/completions", b"{not json " + TOKEN.encode(), extra=auth),
        post("/v1/chat/completions", {**chat(), "api_key": TOKEN}, extra=auth),
        post("/v1/chat/completions", {**chat(), "model": "no-such-model", "user": TOKEN}, extra=auth),
        post("/v1/completions", {"model": MODEL, "prompt": f"my key is {TOKEN}", "max_tokens": 2}, extra=auth),
        post("/v1/chat/completions", chat(), extra=f"Authorization: Bearer {TOKEN}{'x' * 3000}\r\n".encode()),  # too long: 431
        post("/v1/chat/completions", chat(), extra=f"Authorization Bearer {TOKEN}\r\n".encode()),  # malformed header: 400
        f"GET /v1/models?api_key={TOKEN} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n".encode() + auth + b"\r\n",
    ]
    answers = [(await exchange(fleet, request))[1] for request in requests]
    statuses = [status_of(answer) for answer in answers]
    nc = await nats.connect(fleet.config.nats.url)
    try:
        for payload in (json.dumps(chat()).encode(), TOKEN.encode()):
            reply = await nc.request(subjects.API_CHAT_COMPLETIONS, payload, timeout=10, headers={"Authorization": f"Bearer {TOKEN}"})
            answers.append(reply.data + json.dumps(reply.headers or {}).encode())
    finally:
        await nc.close()
    # A malformed request from an address of its own is logged with that address: once its line is
    # in the log, so are the lines of everything before it.
    _, answer = await exchange(fleet, b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", source=LAST_SOURCE)
    assert status_of(answer) == 400
    assert fleet.ingress is not None
    log_path = fleet.ingress.log_path
    await until(lambda: LAST_SOURCE in log_path.read_text(errors="replace"), 10, "the ingress never logged the last request")
    log = log_path.read_text(errors="replace")
    leaks = [f"response: {answer[:300]!r}" for answer in answers if SECRET.encode() in answer]
    leaks += [f"log: {line[:300]}" for line in log.splitlines() if SECRET in line]
    assert not leaks, "\n".join(leaks)
    assert "bad_http_request" in log  # the refusals below were logged, without the token
    assert 431 in statuses and 400 in statuses  # aiohttp's own refusals were among them
    await assert_serves(fleet)
