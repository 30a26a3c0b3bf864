"""The OpenAI API over NATS request/reply, served through `nats.micro`.

Every ingress serves the `kvlane` micro service in one queue group, so any
one of them answers each request and `$SRV.PING/INFO/STATS` discover them
all. Completions take the code path HTTP takes (`Completions`); only the
framing differs:

* a reply is the OpenAI JSON response body; an error is the OpenAI error
  body with `Nats-Service-Error-Code: <HTTP status>` and
  `Nats-Service-Error: <message>`;
* with `"stream": true` each chunk is one message to the reply subject,
  headed `Kvlane-Seq: <n>`, and an empty message headed `Kvlane-Stream: end`
  closes the stream. Chunks are published with a reply subject of the
  ingress's own: when nobody listens on the caller's inbox any more, the
  server answers there with a no-responders status, and the request is
  aborted as an HTTP disconnect would abort it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import Awaitable, Callable

import nats.errors
import structlog
from nats import micro
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request
from nats.micro.service import Endpoint, Service

from contracts import subjects
from services.ingress.anthropic import AnthropicMessages
from services.ingress.completions import CHAT, TEXT_COMPLETION, CallerGone, Completions, Served, error_json
from services.ingress.errors import ApiError
from services.ingress.responses import Responses
from services.ingress.tokenization import Tokenization
from shared.bus import Bus

log = structlog.get_logger("kvlane.ingress")

_NO_RESPONDERS = "503"
# What starts an endpoint's answer: (request body, whether its caller has gone, headers) -> the answer.
Starter = Callable[[bytes, Callable[[], bool], dict[str, str]], Awaitable[Served]]


def error_headers(error: ApiError) -> dict[str, str]:
    headers = {ERROR_CODE_HEADER: str(error.status), ERROR_HEADER: error.message}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
    return headers


class NatsApi:
    def __init__(self, bus: Bus, completions: Completions, ingress_id: str, version: str,
                 responses: Responses | None = None) -> None:
        self._bus = bus
        self._nc = nc = bus.client
        self._completions = completions
        self._anthropic = AnthropicMessages(completions)
        self._responses = responses
        self._ingress_id = ingress_id
        self._version = version
        self._service: Service | None = None
        self._tasks: set[asyncio.Task] = set()
        # Streams being published, and those whose caller's inbox has lost its listener.
        self._probe_prefix = nc.new_inbox()
        self._streaming: set[str] = set()
        self._departed: set[str] = set()

    async def start(self) -> None:
        await self._nc.subscribe(f"{self._probe_prefix}.*", cb=self._on_probe_reply)
        self._service = await micro.add_service(
            self._nc, name=subjects.API_SERVICE, version=self._version, queue_group=subjects.API_QUEUE_GROUP,
            description="OpenAI-compatible API of kvlane", metadata={"ingress_id": self._ingress_id},
        )
        starters: list[tuple[str, str, Starter]] = [
            ("chat_completions", subjects.API_CHAT_COMPLETIONS, functools.partial(self._completions.start, CHAT)),
            ("completions", subjects.API_COMPLETIONS, functools.partial(self._completions.start, TEXT_COMPLETION)),
            # Anthropic's Messages (and OpenAI's Responses) run as chats, answered in their own shapes and errors.
            ("messages", subjects.API_MESSAGES, self._anthropic.start),
        ]
        if self._responses is not None:
            starters.append(("responses", subjects.API_RESPONSES, self._responses.start))
        for name, subject, start in starters:
            await self._service.add_endpoint(name=name, subject=subject, handler=self._spawning(name, start))
        await self._service.add_endpoint(name="models", subject=subjects.API_MODELS,
                                         handler=self._answering(lambda body, headers: self._completions.models(headers)))
        tokenization = Tokenization(self._completions)
        for name, subject, serve in (("tokenize", subjects.API_TOKENIZE, tokenization.tokenize),
                                     ("detokenize", subjects.API_DETOKENIZE, tokenization.detokenize)):
            await self._service.add_endpoint(name=name, subject=subject, handler=self._answering(serve))

    async def stop(self, grace_s: float) -> None:
        """Stop taking requests, then let those in flight finish for up to `grace_s`."""
        if self._service is not None:
            # Its subscriptions drain with a flush; with NATS gone no request reaches them, and they end with the
            # connection.
            try:
                await self._bus.unless_disconnected(self._service.stop, "nats_api_stop")
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("nats_api_stop_failed", error=str(exc))
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def _answering(self, serve: Callable[[bytes, dict[str, str]], Awaitable[bytes]]) -> Callable[[Request], Awaitable[None]]:
        """A handler that answers one reply body (or an error) computed from the request's body and headers."""
        async def handler(request: Request) -> None:
            try:
                body = await serve(request.data, dict(request.headers or {}))
            except ApiError as exc:
                await self._reply_error(request, exc)
                return
            await request.respond(body)

        return handler

    def _spawning(self, name: str, start: Starter) -> Callable[[Request], Awaitable[None]]:
        # nats.micro awaits each handler before the next message of its subscription:
        # a completion runs in its own task so that requests are served concurrently.
        async def handler(request: Request) -> None:
            task = asyncio.create_task(self._complete(self._endpoint(name), start, request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return handler

    def _endpoint(self, name: str) -> Endpoint:
        assert self._service is not None
        # nats.micro internals (`Service._endpoints`, `Endpoint._name`): tests/unit/test_dependency_internals.py pins them.
        return next(endpoint for endpoint in self._service._endpoints if endpoint._name == name)

    async def _complete(self, endpoint: Endpoint, start: Starter, request: Request) -> None:
        started = time.perf_counter_ns()
        failure: ApiError | None = None
        try:
            # A micro `Request` shows its reply subject only on its private `_msg`: tests/unit/test_dependency_internals.py.
            if not request._msg.reply:
                raise ApiError(400, "a request needs a reply subject", code="missing_reply_subject")
            failure = await self._serve(start, request)
        except ApiError as exc:
            failure = exc
            await self._reply_error(request, exc)
        except CallerGone:
            log.info("caller_gone")
        except Exception:
            log.exception("unhandled_error", subject=request.subject)
            failure = ApiError(500, "internal error", code="internal_error")
            await self._reply_error(request, failure)
        finally:
            _account(endpoint, time.perf_counter_ns() - started, failure)

    async def _serve(self, start: Starter, request: Request) -> ApiError | None:
        """Serve one request; returns the error a stream ended with, if any."""
        stream_id = uuid.uuid4().hex
        call = await start(request.data, lambda: stream_id in self._departed, dict(request.headers or {}))
        async with call:
            if not call.stream:
                body = await call.body()
                if len(body) > self._nc.max_payload:
                    # One NATS message cannot carry it (many choices, logprobs): a stream can, a chunk at a time.
                    raise ApiError(400, f"the answer ({len(body)} bytes) is larger than a NATS message may be "
                                   f"({self._nc.max_payload}): ask for it with \"stream\": true, or for less",
                                   code="response_too_large")
                await request.respond(body, headers=call.degraded_header() or None)
                return None
            reply, probe = request._msg.reply, f"{self._probe_prefix}.{stream_id}"
            self._streaming.add(stream_id)
            seq = 0
            failure: ApiError | None = None
            try:
                try:
                    async for chunk in call.chunks():
                        headers = {subjects.API_SEQ_HEADER: str(seq), **call.degraded_header()}
                        await self._nc.publish(reply, chunk, reply=probe, headers=headers)
                        seq += 1
                except ApiError as exc:
                    log.warning("stream_failed", code=exc.code, error=exc.message)
                    failure = exc
                    await self._nc.publish(reply, error_json(exc), headers={subjects.API_SEQ_HEADER: str(seq), **error_headers(exc)})
                    seq += 1
                await self._nc.publish(reply, b"", headers={subjects.API_SEQ_HEADER: str(seq),
                                                            subjects.API_STREAM_HEADER: subjects.API_STREAM_END})
            finally:
                self._streaming.discard(stream_id)
                self._departed.discard(stream_id)
            return failure

    async def _on_probe_reply(self, msg: Msg) -> None:
        stream_id = msg.subject.rpartition(".")[2]
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS and stream_id in self._streaming:
            self._departed.add(stream_id)

    async def _reply_error(self, request: Request, error: ApiError) -> None:
        if not request._msg.reply:
            return
        with contextlib.suppress(Exception):  # the caller may be gone, or NATS down: nothing more to tell
            await request.respond(error_json(error), headers=error_headers(error))


def _account(endpoint: Endpoint, elapsed_ns: int, failure: ApiError | None) -> None:
    """Add a request's own time and outcome to its endpoint's `$SRV.STATS`.

    nats.micro times only the handler, which here just starts the request's
    task; the task reports when the request is done.
    """
    # nats.micro's private statistics fields: tests/unit/test_dependency_internals.py pins them.
    endpoint._processing_time += elapsed_ns
    endpoint._average_processing_time = int(endpoint._processing_time / max(1, endpoint._num_requests))
    if failure is not None:
        endpoint._num_errors += 1
        endpoint._last_error = f"{failure.status}:{failure.message}"
