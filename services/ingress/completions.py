"""The completion endpoints' one code path, whatever the transport.

HTTP (`app.py`) and the NATS API (`nats_api.py`) both hand the raw request
body here: decoding, validation, limits, defaults, priority, routing,
dispatch, rendering and every error are the same for both. A transport
only frames what comes out (SSE lines or NATS messages) and says when its
caller has gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec
import structlog

from contracts.messages import StreamEnd, TokenChunk, WorkerRegistration
from contracts.openai_api import ChatCompletionRequest, CompletionRequest, Model, ModelList
from services.ingress.dispatch import Dispatcher
from services.ingress.errors import ApiError, from_decode_error
from services.ingress.metrics import IngressMetrics
from services.ingress.prompts import PreparedRequest, prepare
from services.ingress.render import ChatRenderer, CompletionRenderer, Renderer
from shared.cluster import ClusterView
from shared.config import IngressSettings
from shared.tokenizer import Tokenizer, load_tokenizer

log = structlog.get_logger("kvlane.ingress")
_ENCODER = msgspec.json.Encoder()

Frames = AsyncIterator[TokenChunk | StreamEnd]


class CallerGone(ConnectionError):
    """Nobody waits for the request any more (an HTTP client hung up, a NATS caller's inbox is gone)."""


@dataclass(frozen=True)
class Operation:
    """One completion endpoint: how its body decodes and its answer renders."""

    name: Literal["chat", "text_completion"]  # gen_ai.operation.name
    request_type: type[ChatCompletionRequest] | type[CompletionRequest]
    id_prefix: str
    renderer: type[ChatRenderer] | type[CompletionRenderer]


CHAT = Operation("chat", ChatCompletionRequest, "chatcmpl", ChatRenderer)
TEXT_COMPLETION = Operation("text_completion", CompletionRequest, "cmpl", CompletionRenderer)


class Completions:
    def __init__(
        self,
        settings: IngressSettings,
        view: ClusterView,
        dispatcher: Dispatcher,
        metrics: IngressMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._view = view
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._clock = clock
        self._tokenizers: dict[str, asyncio.Future[Tokenizer]] = {}
        self._decoders = {op.name: msgspec.json.Decoder(op.request_type) for op in (CHAT, TEXT_COMPLETION)}

    async def start(
        self,
        operation: Operation,
        payload: bytes,
        caller_gone: Callable[[], bool],
        headers: Mapping[str, str] | None = None,
    ) -> CompletionCall:
        """Decode, check and dispatch a request, then wait for its first frame.

        Every error before the first output is raised here as an `ApiError`,
        so a transport can still answer with a proper status.
        """
        received = self._clock()
        if len(payload) > self._settings.max_body_bytes:
            raise ApiError(413, f"request body too large ({len(payload)} bytes, at most {self._settings.max_body_bytes})",
                           code="request_entity_too_large")
        try:
            body = self._decoders[operation.name].decode(payload)
        except msgspec.DecodeError as exc:
            raise from_decode_error(exc) from exc
        registration = self._model(body.model)
        tokenizer = await self._tokenizer(registration.tokenizer)
        prepared = prepare(body, registration, tokenizer, self._settings.max_tokens_default)
        request_id = uuid.uuid4().hex
        renderer = operation.renderer(f"{operation.id_prefix}-{request_id}", int(time.time()), body.model)
        call = CompletionCall(request_id, prepared, renderer, caller_gone, self._metrics, self._clock, received)
        await call.begin(self._dispatcher.run(request_id, prepared))
        return call

    def _model(self, name: str) -> WorkerRegistration:
        registration = self._view.models(self._clock()).get(name)
        if registration is None:
            raise ApiError(404, f"The model `{name}` does not exist or no live worker serves it.", code="model_not_found", param="model")
        return registration

    def models_body(self) -> bytes:
        """The `/v1/models` body: every model a live worker serves."""
        models = self._view.models(self._clock())
        data = [Model(id=name, created=int(reg.started_at), max_model_len=reg.max_model_len) for name, reg in sorted(models.items())]
        return _ENCODER.encode(ModelList(data))

    # --- tokenizers ---------------------------------------------------------------

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

    def tokenizers_missing(self) -> list[str]:
        """Models whose tokenizer is not loaded (yet): ingress cannot serve them."""
        def loaded(spec: str) -> bool:
            loading = self._tokenizers.get(spec)
            return loading is not None and loading.done() and loading.exception() is None

        models = self._view.models(self._clock())
        return [f"tokenizer:{name}" for name, registration in sorted(models.items()) if not loaded(registration.tokenizer)]


class CompletionCall:
    """One request from its first frame on; close it (`async with`) to end or abort it."""

    def __init__(
        self,
        request_id: str,
        prepared: PreparedRequest,
        renderer: Renderer,
        caller_gone: Callable[[], bool],
        metrics: IngressMetrics,
        clock: Callable[[], float],
        received: float,
    ) -> None:
        self.request_id = request_id
        self.stream = prepared.stream
        self._prepared = prepared
        self._renderer = renderer
        self._caller_gone = caller_gone
        self._metrics = metrics
        self._clock = clock
        self._received = received
        self._frames: Frames | None = None
        self._first: TokenChunk | StreamEnd | None = None
        self.end: StreamEnd | None = None

    async def begin(self, frames: Frames) -> None:
        structlog.contextvars.bind_contextvars(request_id=self.request_id)
        self._metrics.in_flight.inc()
        self._frames = self._timed(frames)
        try:
            self._first = await anext(self._frames)
        except StopAsyncIteration:
            await self.aclose()
            raise ApiError(502, "stream ended without a final frame", code="stream_incomplete") from None
        except BaseException:
            await self.aclose()
            raise

    async def _timed(self, frames: Frames) -> Frames:
        """Relays frames while recording TTFT, inter-token latency and totals."""
        model = self._prepared.model
        last: float | None = None
        async with contextlib.aclosing(frames):
            async for frame in frames:
                now = self._clock()
                if isinstance(frame, TokenChunk):
                    if last is None:
                        self._metrics.first_token(model, now - self._received)
                    else:
                        self._metrics.inter_token(model, now - last)
                    last = now
                else:
                    self.end = frame
                    self._metrics.finished(model, frame, now - self._received)
                yield frame

    async def _relayed(self) -> Frames:
        assert self._frames is not None and self._first is not None
        yield self._first
        async for frame in self._frames:
            if self._caller_gone():
                # Checked per frame: much output carries no text to write (special
                # tokens, partial characters, a non-streamed reply), so a failed
                # write alone would notice a departed caller only at the end.
                raise CallerGone("the caller has gone")
            yield frame

    async def body(self) -> bytes:
        """The whole response body (for `"stream": false`)."""
        pieces: list[str] = []
        async for frame in self._relayed():
            if isinstance(frame, TokenChunk):
                pieces.append(frame.text)
            else:
                return self._renderer.whole("".join(pieces), frame)
        raise ApiError(502, "stream ended without a final frame", code="stream_incomplete")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The JSON of each stream chunk, in order (for `"stream": true`); an error mid-stream raises `ApiError`."""
        if (opening := self._renderer.opening()) is not None:
            yield opening
        async for frame in self._relayed():
            if isinstance(frame, TokenChunk):
                if (chunk := self._renderer.delta(frame.text)) is not None:
                    yield chunk
                continue
            yield self._renderer.closing(frame)
            if self._prepared.include_usage:
                yield self._renderer.usage(frame)
            return
        raise ApiError(502, "stream ended without a final frame", code="stream_incomplete")

    async def aclose(self) -> None:
        """End the call; a request still running is aborted on its nodes."""
        frames, self._frames = self._frames, None
        if frames is None:
            return
        try:
            await frames.aclose()
        finally:
            self._metrics.in_flight.dec()
            structlog.contextvars.unbind_contextvars("request_id")

    async def __aenter__(self) -> CompletionCall:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def error_json(error: ApiError) -> bytes:
    return _ENCODER.encode(error.body())
