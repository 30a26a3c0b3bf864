"""The ingress HTTP API (aiohttp): OpenAI-compatible endpoints over the bus."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable

import msgspec
import structlog
from aiohttp import web

from contracts.openai_api import HealthStatus
from contracts.openapi import build_openapi
from services.ingress.anthropic import AnthropicMessages
from services.ingress.completions import CHAT, TEXT_COMPLETION, Completions, Served
from services.ingress.errors import ApiError
from services.ingress.http_guard import HttpGuard
from services.ingress.metrics import IngressMetrics
from services.ingress.readiness import Readiness
from services.ingress.responses import Responses
from services.ingress.tokenization import Tokenization
from shared.cluster import ClusterView

log = structlog.get_logger("kvlane.ingress")
_ENCODER = msgspec.json.Encoder()
# The endpoints whose requests run completions (counted per client by `HttpGuard`).
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


class IngressApp:
    def __init__(
        self,
        max_body_bytes: int,
        view: ClusterView,
        completions: Completions,
        metrics: IngressMetrics,
        is_connected: Callable[[], bool],
        readiness: Readiness | None = None,
        clock: Callable[[], float] = time.monotonic,
        guard: HttpGuard | None = None,
        responses: Responses | None = None,
    ) -> None:
        self._max_body_bytes = max_body_bytes
        self._view = view
        self._completions = completions
        self._metrics = metrics
        self._is_connected = is_connected
        self._readiness = readiness
        self._clock = clock
        self._guard = guard
        self._responses = responses
        self._tokenization = Tokenization(completions)
        self._anthropic = AnthropicMessages(completions)
        self._openapi = _ENCODER.encode(build_openapi())

    def build(self) -> web.Application:
        # The guard's refusals and timeouts go through `_errors` too (the metrics count them).
        middlewares = [self._errors] if self._guard is None else [self._errors, self._guard.middleware]
        app = web.Application(middlewares=middlewares, client_max_size=self._max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/messages", self.messages)
        if self._responses is not None:
            app.router.add_post("/v1/responses", self.responses)
            app.router.add_get("/v1/responses/{response_id}", self.retrieve_response)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            response = await handler(request)
        except ApiError as exc:
            response = exc.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = ApiError(exc.status, exc.reason if exc.status != 413 else "request body too large", code=exc.reason.lower().replace(" ", "_")).response()
        except Exception:
            log.exception("unhandled_error", path=request.path)
            response = ApiError(500, "internal error", code="internal_error").response()
        if request.path.startswith("/v1/"):
            self._metrics.http_request(_endpoint(request), response.status)
        return response

    # --- completions --------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, functools.partial(self._completions.start, CHAT))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, functools.partial(self._completions.start, TEXT_COMPLETION))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """The Anthropic Messages API; its errors (raised as `AnthropicApiError`) render in Anthropic's shape."""
        return await self._serve(request, self._anthropic.start)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """The OpenAI Responses API: run as a chat completion, streamed as named events."""
        assert self._responses is not None
        return await self._serve(request, self._responses.start)

    async def _serve(self, request: web.Request, start: Callable[..., Awaitable[Served]]) -> web.StreamResponse:
        """One answer (`start` begins it from the body): a JSON body, or an SSE stream in the endpoint's framing."""
        call = await start(await request.read(), lambda: _hung_up(request), request.headers)
        headers = {"X-Request-Id": call.request_id, **call.degraded_header()}
        async with call:
            try:
                if not call.stream:
                    return web.Response(body=await call.body(), content_type="application/json", headers=headers)
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
                await response.prepare(request)
                async for event in call.sse():
                    await response.write(event)  # raises once the client is gone
                return response
            except ConnectionError:  # CallerGone included
                log.info("client_disconnected")
                return web.Response(status=499, reason="Client Closed Request")  # nobody reads it; the metrics count it
            except asyncio.CancelledError:
                log.info("client_disconnected")  # aiohttp cancels the handler of a client gone
                raise

    async def retrieve_response(self, request: web.Request) -> web.Response:
        assert self._responses is not None
        body = await self._responses.retrieve(request.match_info["response_id"], request.headers)
        return web.Response(body=body, content_type="application/json")

    # --- the rest -----------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.Response(body=await self._completions.models(request.headers), content_type="application/json")

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._tokenization.tokenize(await request.read(), request.headers)
        return web.Response(body=body, content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._tokenization.detokenize(await request.read(), request.headers)
        return web.Response(body=body, content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(body=_ENCODER.encode(HealthStatus("ok")), content_type="application/json")

    async def ready(self, request: web.Request) -> web.Response:
        live = [hb for hb in self._view.live(self._clock()) if not hb.draining]
        missing = [] if self._readiness is None else await self._readiness.missing()
        degraded = [] if self._readiness is None else await self._readiness.degraded()
        await self._completions.preload_tokenizers()
        missing += self._completions.tokenizers_missing()
        if not self._is_connected():
            missing.append("nats")
        # A fleet whose pools are at zero serves still: a request starts a worker (and waits for it).
        if not live and not self._completions.models_from_zero():
            missing.append("workers")
        ready = not missing
        status = HealthStatus("ok" if ready else "not_ready", len(live), sorted({hb.registration.model for hb in live}), missing,
                              degraded)
        return web.Response(status=200 if ready else 503, body=_ENCODER.encode(status), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.exposition(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")


def _endpoint(request: web.Request) -> str:
    """The metrics' endpoint label: the route's pattern, so that ids in paths (`/v1/responses/{response_id}`) add no series."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


def _hung_up(request: web.Request) -> bool:
    """Whether the client has closed its connection.

    Its handler is cancelled then too, but a library may swallow a
    cancellation (Python 3.11's `asyncio.wait_for` does when the awaited
    result lands at the same moment); checked per frame, a request nobody
    waits for ends within one frame even when there is nothing to write.
    """
    transport = request.transport
    return transport is None or transport.is_closing()
