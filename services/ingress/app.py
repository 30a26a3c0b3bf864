"""The ingress HTTP API (aiohttp): OpenAI-compatible endpoints over the bus."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import structlog
from aiohttp import web

from contracts.messages import StreamEnd, TokenChunk, WorkerRegistration
from contracts.openai_api import ChatCompletionRequest, CompletionRequest, HealthStatus, Model, ModelList
from contracts.openapi import build_openapi
from services.ingress.dispatch import Dispatcher
from services.ingress.errors import ApiError, from_decode_error
from services.ingress.metrics import IngressMetrics
from services.ingress.prompts import PreparedRequest, prepare
from services.ingress.readiness import Readiness
from services.ingress.render import DONE, ChatRenderer, CompletionRenderer, Renderer, sse
from shared.cluster import ClusterView
from shared.config import IngressSettings
from shared.tokenizer import Tokenizer, load_tokenizer

log = structlog.get_logger("kvlane.ingress")
_ENCODER = msgspec.json.Encoder()

Frames = AsyncIterator[TokenChunk | StreamEnd]


class IngressApp:
    def __init__(
        self,
        settings: IngressSettings,
        view: ClusterView,
        dispatcher: Dispatcher,
        metrics: IngressMetrics,
        is_connected: Callable[[], bool],
        readiness: Readiness | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._view = view
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._is_connected = is_connected
        self._readiness = readiness
        self._clock = clock
        self._tokenizers: dict[str, asyncio.Future[Tokenizer]] = {}
        self._chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
        self._completion_decoder = msgspec.json.Decoder(CompletionRequest)
        self._openapi = _ENCODER.encode(build_openapi())

    def build(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self._settings.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
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
            self._metrics.requests.labels(request.path, str(response.status)).inc()
        return response

    # --- completions --------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, self._chat_decoder, "chatcmpl", ChatRenderer)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, self._completion_decoder, "cmpl", CompletionRenderer)

    async def _complete(self, request: web.Request, decoder: msgspec.json.Decoder, id_prefix: str, renderer_type) -> web.StreamResponse:
        received = self._clock()
        try:
            body = decoder.decode(await request.read())
        except msgspec.DecodeError as exc:
            raise from_decode_error(exc) from exc
        registration = self._model(body.model)
        tokenizer = await self._tokenizer(registration.tokenizer)
        prepared = prepare(body, registration, tokenizer, self._settings.max_tokens_default)
        request_id = uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        renderer: Renderer = renderer_type(f"{id_prefix}-{request_id}", int(time.time()), body.model)
        self._metrics.in_flight.inc()
        try:
            async with contextlib.aclosing(self._dispatcher.run(request_id, prepared)) as frames:
                timed = self._timed(frames, received)
                if prepared.stream:
                    return await self._stream(request, request_id, timed, renderer, prepared)
                return await self._whole(request, request_id, timed, renderer)
        except asyncio.CancelledError:
            log.info("client_disconnected", request_id=request_id)  # aiohttp cancels the handler of a client gone
            raise
        finally:
            self._metrics.in_flight.dec()
            structlog.contextvars.unbind_contextvars("request_id")

    async def _timed(self, frames: Frames, received: float) -> Frames:
        """Relays frames while recording TTFT, inter-token latency and totals."""
        last: float | None = None
        async for frame in frames:
            now = self._clock()
            if isinstance(frame, TokenChunk):
                if last is None:
                    self._metrics.ttft.observe(now - received)
                else:
                    self._metrics.itl.observe(now - last)
                last = now
            else:
                self._metrics.e2e.observe(now - received)
                self._metrics.prompt_tokens.inc(frame.usage.prompt_tokens)
                self._metrics.cached_tokens.inc(frame.usage.cached_tokens)
                self._metrics.generation_tokens.inc(frame.usage.completion_tokens)
            yield frame

    async def _whole(self, request: web.Request, request_id: str, frames: Frames, renderer: Renderer) -> web.Response:
        pieces: list[str] = []
        try:
            async for frame in frames:
                if isinstance(frame, TokenChunk):
                    _check_connected(request)
                    pieces.append(frame.text)
                else:
                    return web.Response(body=renderer.whole("".join(pieces), frame), content_type="application/json",
                                        headers={"X-Request-Id": request_id})
        except ConnectionError:
            log.info("client_disconnected", request_id=request_id)
            return web.Response(status=499, reason="Client Closed Request")  # nobody reads it; the metrics count it
        raise ApiError(502, "stream ended without a final frame", code="stream_incomplete")

    async def _stream(self, request: web.Request, request_id: str, frames: Frames, renderer: Renderer, prepared: PreparedRequest) -> web.StreamResponse:
        # Wait for the first frame before answering 200, so that failures to
        # route or dispatch still get a proper HTTP error status.
        first = await anext(frames)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": request_id}
        )
        await response.prepare(request)

        async def frames_from_first() -> Frames:
            yield first
            async for frame in frames:
                yield frame

        try:
            if (opening := renderer.opening()) is not None:
                await response.write(opening)
            async for frame in frames_from_first():
                if isinstance(frame, TokenChunk):
                    if (chunk := renderer.delta(frame.text)) is not None:
                        await response.write(chunk)  # raises once the client is gone
                    else:
                        _check_connected(request)
                    continue
                await response.write(renderer.closing(frame))
                if prepared.include_usage:
                    await response.write(renderer.usage(frame))
                await response.write(DONE)
        except ApiError as exc:
            log.warning("stream_failed", request_id=request_id, code=exc.code, error=exc.message)
            with contextlib.suppress(ConnectionError):
                await response.write(sse(exc.body()))
                await response.write(DONE)
        except ConnectionError:
            log.info("client_disconnected", request_id=request_id)
        return response

    def _model(self, name: str) -> WorkerRegistration:
        registration = self._view.models(self._clock()).get(name)
        if registration is None:
            raise ApiError(404, f"The model `{name}` does not exist or no live worker serves it.", code="model_not_found", param="model")
        return registration

    async def preload_tokenizers(self) -> None:
        """Start loading the tokenizer of each model a live worker serves, before its first request needs it."""
        for registration in self._view.models(self._clock()).values():
            if registration.tokenizer not in self._tokenizers:
                self._load(registration.tokenizer)

    def _load(self, spec: str) -> asyncio.Future[Tokenizer]:
        # Off the event loop, once, shared by concurrent requests.
        loading = self._tokenizers[spec] = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, spec))

        def report(done: asyncio.Future[Tokenizer]) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.error("tokenizer_unavailable", tokenizer=spec, error=str(done.exception()))

        loading.add_done_callback(report)
        return loading

    async def _tokenizer(self, spec: str) -> Tokenizer:
        loading = self._tokenizers.get(spec)
        if loading is None or (loading.done() and loading.exception() is not None):
            loading = self._load(spec)  # a request tries a failed one again
        try:
            return await asyncio.shield(loading)
        except ValueError as exc:
            raise ApiError(503, f"the model's tokenizer cannot be loaded here: {exc}", code="tokenizer_unavailable") from exc

    def _tokenizer_missing(self, models: dict[str, WorkerRegistration]) -> list[str]:
        """Models whose tokenizer is not loaded (yet): ingress cannot serve them."""
        def loaded(spec: str) -> bool:
            loading = self._tokenizers.get(spec)
            return loading is not None and loading.done() and loading.exception() is None

        return [f"tokenizer:{name}" for name, registration in sorted(models.items()) if not loaded(registration.tokenizer)]

    # --- the rest -----------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        models = self._view.models(self._clock())
        data = [Model(id=name, created=int(reg.started_at), max_model_len=reg.max_model_len) for name, reg in sorted(models.items())]
        return web.Response(body=_ENCODER.encode(ModelList(data)), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(body=_ENCODER.encode(HealthStatus("ok")), content_type="application/json")

    async def ready(self, request: web.Request) -> web.Response:
        live = [hb for hb in self._view.live(self._clock()) if not hb.draining]
        missing = [] if self._readiness is None else await self._readiness.missing()
        await self.preload_tokenizers()
        missing += self._tokenizer_missing(self._view.models(self._clock()))
        if not self._is_connected():
            missing.append("nats")
        if not live:
            missing.append("workers")
        ready = not missing
        status = HealthStatus("ok" if ready else "not_ready", len(live), sorted({hb.registration.model for hb in live}), missing)
        return web.Response(status=200 if ready else 503, body=_ENCODER.encode(status), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.exposition(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")


def _check_connected(request: web.Request) -> None:
    """Raise `ConnectionResetError` if the client has hung up.

    Its handler is cancelled then too, but a library may swallow a
    cancellation (Python 3.11's `asyncio.wait_for` does when the awaited
    result lands at the same moment); checked per frame, a request nobody
    waits for ends within one frame even when there is nothing to write.
    """
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client closed the connection")
