"""The completion endpoints' one code path, whatever the transport.

HTTP (`app.py`) and the NATS API (`nats_api.py`) both hand the raw request
body here: decoding, validation, limits, defaults, priority, routing,
dispatch, rendering and every error are the same for both. A transport
only frames what comes out (SSE lines or NATS messages) and says when its
caller has gone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec
import structlog
from multidict import CIMultiDictProxy
from opentelemetry.context import Context

from contracts.autoscaler import RequestServed
from contracts.messages import StreamEnd, TokenChunk, WorkerRegistration
from contracts.model_files import AdapterRef
from contracts.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    Degraded,
    KvlaneNotes,
    Model,
    ModelList,
    NamedToolChoice,
)
from services.ingress.adapters import AdapterCatalog
from services.ingress.auth import Admission, Authenticator
from services.ingress.dispatch import Dispatcher
from services.ingress.errors import ApiError, from_decode_error
from services.ingress.metrics import IngressMetrics
from services.ingress.prompts import PreparedRequest, api_body, completion_prompts, prepare
from services.ingress.render import DONE, AnswerShape, ChatRenderer, CompletionRenderer, Renderer, sse
from services.ingress.request_trace import RequestTrace
from shared import genai
from shared.api_keys import KeyRecord
from shared.cluster import ClusterView
from shared.config import IngressSettings, TracingSettings
from shared.model_store import ModelFileCache, load_served_tokenizer
from shared.scale_from_zero import ModelsFromZero
from shared.telemetry import Telemetry
from shared.tokenizer import Tokenizer

log = structlog.get_logger("kvlane.ingress")
_ENCODER = msgspec.json.Encoder()

Frames = AsyncIterator[TokenChunk | StreamEnd]


# On a response kvlane degraded under overload (HTTP; the NATS API's replies carry it too).
DEGRADED_HEADER = "X-Kvlane-Degraded"


class CallerGone(ConnectionError):
    """Nobody waits for the request any more (an HTTP client hung up, a NATS caller's inbox is gone)."""


@dataclass(frozen=True)
class Operation:
    """One completion endpoint: how its body decodes and its answer's id begins."""

    name: Literal["chat", "text_completion"]  # gen_ai.operation.name
    request_type: type[ChatCompletionRequest] | type[CompletionRequest]
    id_prefix: str


CHAT = Operation("chat", ChatCompletionRequest, "chatcmpl")
TEXT_COMPLETION = Operation("text_completion", CompletionRequest, "cmpl")


class Completions:
    def __init__(
        self,
        settings: IngressSettings,
        view: ClusterView,
        dispatcher: Dispatcher,
        metrics: IngressMetrics,
        clock: Callable[[], float] = time.monotonic,
        telemetry: Telemetry | None = None,
        on_served: Callable[[RequestServed], None] = lambda served: None,
        auth: Authenticator | None = None,
        model_files: ModelFileCache | None = None,
        adapters: AdapterCatalog | None = None,
        from_zero: ModelsFromZero | None = None,
    ) -> None:
        self._settings = settings
        # Models whose pool may be at zero: their requests are taken as the last registration says, and wait in a
        # balancer while a worker starts.
        self._from_zero = from_zero or ModelsFromZero()
        # The LoRA adapters on the bus, which a request may name as its model.
        self._adapters = adapters or AdapterCatalog(None)
        # Tokenizer files fetched from the bus, for models whose directory this host lacks.
        self._model_files = model_files
        # API keys, their policy and limits (None, or not required: anyone may ask, as before).
        self._auth = auth if auth is not None and auth.required else None
        # Told of each request answered, with the latencies its client saw (the autoscaler's signal).
        self._on_served = on_served
        self._view = view
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._clock = clock
        # Each request's SERVER span, and the gen_ai.server.* metrics when they are exported.
        self._telemetry = telemetry or Telemetry(TracingSettings(), "ingress")
        meter = self._telemetry.meter
        self._genai = genai.GenAiServerMetrics(meter) if meter is not None else None
        # By (spec, files on the bus): what a worker's registration says of its tokenizer.
        self._tokenizers: dict[tuple[str, str], asyncio.Future[Tokenizer]] = {}
        self._decoders = {op.name: msgspec.json.Decoder(op.request_type) for op in (CHAT, TEXT_COMPLETION)}

    async def start(
        self,
        operation: Operation,
        payload: bytes,
        caller_gone: Callable[[], bool],
        headers: Mapping[str, str] | None = None,
    ) -> Answer:
        """Decode, check and dispatch a request, then wait for its first frame.

        Every error before the first output is raised here as an `ApiError`,
        so a transport can still answer with a proper status. The request's
        span continues the caller's `traceparent` (in `headers`), if any.
        A completion request with a batch of prompts runs one request per prompt, answered as one.
        """
        received = self._clock()
        span = RequestTrace(self._telemetry.tracer, self._genai, operation.name, self._caller_trace(headers), received)
        key = None
        try:
            # The key first: a caller without one learns nothing else (not even that its body is bad).
            key = await self._key(headers)
            if key is not None:
                span.caller(key.tenant, key.id)
            if len(payload) > self._settings.max_body_bytes:
                raise ApiError(413, f"request body too large ({len(payload)} bytes, at most {self._settings.max_body_bytes})",
                               code="request_entity_too_large")
            try:
                body = self._decoders[operation.name].decode(payload)
            except msgspec.DecodeError as exc:
                raise from_decode_error(exc) from exc
            span.model(body.model)
            Authenticator.check_model(key, body.model)
            registration, adapter = await self._served(body.model)
            tokenizer = await self._tokenizer(registration)
            engine_body = api_body(payload, always=registration.engine == "vllm")
            if isinstance(body, CompletionRequest):
                prompts = completion_prompts(body)
                asked = [prepare(body, registration, tokenizer, self._settings.max_tokens_default, engine_body, prompt, adapter)
                         for prompt in prompts]
            else:
                asked = [prepare(body, registration, tokenizer, self._settings.max_tokens_default, engine_body, adapter=adapter)]
            if key is None and (named := Authenticator.named_tenant(headers, self._settings.tenant_header,
                                                                    self._settings.tenant_weights)) is not None:
                asked = [msgspec.structs.replace(one, tenant=named[0], tenant_weight=named[1]) for one in asked]
        except BaseException as exc:
            span.end(self._clock(), None, exc)
            self._metrics.tenant_request(key.tenant if key is not None else "", status_of(exc))
            raise
        # As random as a uuid4's hex, without building the UUID; the answer's id names its first request.
        request_ids = [os.urandom(16).hex() for _ in asked]
        response_id = f"{operation.id_prefix}-{request_ids[0]}"
        created = int(time.time())
        shape = answer_shape(body, asked[0], registration)
        if isinstance(body, CompletionRequest):
            renderer: Renderer = CompletionRenderer(response_id, created, body.model, shape, len(asked), [p.echo_text for p in asked])
        else:
            renderer = ChatRenderer(response_id, created, body.model, shape)
        calls: list[CompletionCall] = []
        try:
            for i, one in enumerate(asked):
                # The first request carries the span already begun; each further prompt of a batch has its own.
                request_span = span if i == 0 else RequestTrace(self._telemetry.tracer, self._genai, operation.name,
                                                               self._caller_trace(headers), received)
                if i:
                    request_span.model(body.model)
                    if key is not None:
                        request_span.caller(key.tenant, key.id)
                calls.append(await self._start_call(one, request_ids[i], key, request_span,
                                                    response_id if i == 0 else f"{response_id}-{i}", caller_gone, received))
        except BaseException:
            for call in calls:
                await call.aclose()
            raise
        return Answer(calls, renderer, asked[0])

    async def _start_call(self, asked: PreparedRequest, request_id: str, key: KeyRecord | None, span: RequestTrace,
                          response_id: str, caller_gone: Callable[[], bool], received: float) -> CompletionCall:
        """Admit and dispatch one prepared request; wait for its first frame."""
        admission = None
        try:
            # The key's tenant rides along; a priority above the key's maximum is lowered to it.
            prepared = Authenticator.apply(key, asked)
            span.prepared(request_id, response_id, prepared, requested_priority=asked.priority)
            if key is not None:
                assert self._auth is not None
                admission = await self._auth.admit(key, request_id, prepared)
            call = CompletionCall(request_id, prepared, caller_gone, self._metrics, self._clock, received, span,
                                  self._on_served, admission)
        except BaseException as exc:
            if admission is not None:
                admission.settle(None)
            span.end(self._clock(), None, exc)
            self._metrics.tenant_request(key.tenant if key is not None else "", status_of(exc))
            raise
        await call.begin(self._dispatcher.run(request_id, prepared, span.context, on_capped=call.capped))
        return call

    def _caller_trace(self, headers: Mapping[str, str] | None) -> Context:
        """The trace of the caller's `traceparent`; empty without one (HTTP headers are looked up in any letter case)."""
        if not headers or (isinstance(headers, CIMultiDictProxy) and "traceparent" not in headers):
            return Context()
        return self._telemetry.extract(headers)

    async def resolve(self, name: str | None) -> tuple[WorkerRegistration, Tokenizer]:
        """A served model's registration and tokenizer (`name` None: the one model served, if only one is)."""
        if name is None:
            models = self._view.models(self._clock())
            if len(models) != 1:
                raise ApiError(400, "`model` is required when the fleet serves several models (or none)",
                               code="invalid_value", param="model")
            name = next(iter(models))
        registration, _ = await self._served(name)
        return registration, await self._tokenizer(registration)

    async def _key(self, headers: Mapping[str, str] | None) -> KeyRecord | None:
        """The caller's key, with auth required (else `ApiError`); None when anyone may ask."""
        return await self._auth.authenticate(headers) if self._auth is not None else None

    async def authenticate(self, headers: Mapping[str, str] | None, model: str | None) -> None:
        """With auth required: a caller's key that may use `model` (else `ApiError`)."""
        key = await self._key(headers)
        if model is not None:
            Authenticator.check_model(key, model)

    async def _served(self, name: str) -> tuple[WorkerRegistration, AdapterRef | None]:
        """The registration of the workers that serve model `name`, and the LoRA adapter it names, if it names one."""
        models = self._view.models(self._clock())
        registration = models.get(name) or self._from_zero.registration(name)
        if registration is not None:
            return registration, None
        adapter = await self._adapters.get(name)
        if adapter is None:
            raise ApiError(404, f"The model `{name}` does not exist or no live worker serves it.", code="model_not_found", param="model")
        base = models.get(adapter.base) or self._from_zero.registration(adapter.base)
        if base is None:
            raise ApiError(503, f"The adapter `{name}` adapts model `{adapter.base}`, which no live worker serves now.",
                           code="model_unavailable", param="model", retry_after_s=1.0)
        if not base.max_loras:
            raise ApiError(503, f"The adapter `{name}` adapts model `{adapter.base}`, whose workers serve no adapters "
                                "(worker.lora.max_loras = 0).", code="model_unavailable", param="model")
        return base, adapter.ref

    def models_from_zero(self) -> list[str]:
        """The models served from zero: requests for them are taken while no worker serves them."""
        return self._from_zero.models()

    async def models_body(self, visible: Callable[[str], bool] = lambda model: True) -> bytes:
        """The `/v1/models` body: every model a live worker serves and every adapter of one (that `visible` lets through)."""
        models = self._view.models(self._clock())
        data = [Model(id=name, created=int(reg.started_at), max_model_len=reg.max_model_len, root=name)
                for name, reg in sorted(models.items()) if visible(name)]
        data += [Model(id=adapter.name, created=adapter.created, max_model_len=models[adapter.base].max_model_len,
                       root=adapter.name, parent=adapter.base)
                 for adapter in await self._adapters.all()
                 if adapter.base in models and models[adapter.base].max_loras and visible(adapter.name)]
        return _ENCODER.encode(ModelList(data))

    async def models(self, headers: Mapping[str, str] | None = None) -> bytes:
        """`/v1/models` for this caller: with auth required, it needs a key and lists what the key may use (else `ApiError`)."""
        key = await self._key(headers)
        return await (self.models_body() if key is None else self.models_body(key.allows_model))

    # --- tokenizers ---------------------------------------------------------------

    async def preload_tokenizers(self) -> None:
        """Start loading the tokenizer of each model a live worker serves, before its first request needs it.

        One that failed is tried again: a fetch from the bus may fail for a
        moment, and /ready would otherwise leave the model out for good.
        """
        for registration in self._view.models(self._clock()).values():
            loading = self._tokenizers.get(_tokenizer_key(registration))
            if loading is None or (loading.done() and loading.exception() is not None):
                self._load(registration)

    def _load(self, registration: WorkerRegistration) -> asyncio.Future[Tokenizer]:
        # Off the event loop, once, shared by concurrent requests.
        spec, files = _tokenizer_key(registration)
        loading = self._tokenizers[spec, files] = asyncio.ensure_future(load_served_tokenizer(spec, files, self._model_files))

        def report(done: asyncio.Future[Tokenizer]) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.error("tokenizer_unavailable", tokenizer=spec, error=str(done.exception()))

        loading.add_done_callback(report)
        return loading

    async def _tokenizer(self, registration: WorkerRegistration) -> Tokenizer:
        loading = self._tokenizers.get(_tokenizer_key(registration))
        if loading is not None and loading.done() and loading.exception() is None:
            return loading.result()  # loaded: nothing to wait for (nearly every request)
        if loading is None or loading.done():
            loading = self._load(registration)  # a request tries a failed one again
        try:
            return await asyncio.shield(loading)
        except ValueError as exc:
            raise ApiError(503, f"the model's tokenizer cannot be loaded here: {exc}", code="tokenizer_unavailable") from exc

    def tokenizers_missing(self) -> list[str]:
        """Models whose tokenizer is not loaded (yet): ingress cannot serve them."""
        def loaded(registration: WorkerRegistration) -> bool:
            loading = self._tokenizers.get(_tokenizer_key(registration))
            return loading is not None and loading.done() and loading.exception() is None

        models = self._view.models(self._clock())
        return [f"tokenizer:{name}" for name, registration in sorted(models.items()) if not loaded(registration)]


def _tokenizer_key(registration: WorkerRegistration) -> tuple[str, str]:
    return registration.tokenizer, registration.tokenizer_files


class CompletionCall:
    """One request from its first frame on; close it (`async with`) to end or abort it."""

    def __init__(
        self,
        request_id: str,
        prepared: PreparedRequest,
        caller_gone: Callable[[], bool],
        metrics: IngressMetrics,
        clock: Callable[[], float],
        received: float,
        span: RequestTrace,
        on_served: Callable[[RequestServed], None],
        admission: Admission | None = None,
    ) -> None:
        self.request_id = request_id
        self.stream = prepared.stream
        self._prepared = prepared
        self._caller_gone = caller_gone
        self._metrics = metrics
        self._clock = clock
        self._received = received
        self._span = span
        self._on_served = on_served
        # The request's hold on its API key's limits, settled with the tokens it used when it ends.
        self._admission = admission
        self._generated = 0  # tokens relayed so far
        self._first_token_at: float | None = None
        # What kvlane changed in the request (the response's `kvlane` field), if anything.
        self.notes: KvlaneNotes | None = None
        self._frames: Frames | None = None
        self._first: TokenChunk | StreamEnd | None = None
        self.end: StreamEnd | None = None
        self._end_at: float | None = None  # when the final frame came
        self._failure: BaseException | None = None

    def capped(self, max_tokens: int) -> None:
        """The balancer degraded the request under overload: it may generate `max_tokens` at most."""
        requested = self._prepared.sampling.max_tokens
        self.notes = KvlaneNotes(degraded=Degraded("overload", max_tokens, requested))
        log.info("degraded", max_tokens=max_tokens, requested_max_tokens=requested)

    def degraded_header(self) -> dict[str, str]:
        """`X-Kvlane-Degraded` for the transport's reply, when the request was degraded."""
        if self.notes is None or self.notes.degraded is None:
            return {}
        d = self.notes.degraded
        return {DEGRADED_HEADER: f"reason={d.reason}; max_tokens={d.max_tokens}; requested_max_tokens={d.requested_max_tokens}"}

    async def begin(self, frames: Frames) -> None:
        structlog.contextvars.bind_contextvars(request_id=self.request_id)
        self._metrics.in_flight.inc()
        self._frames = self._timed(frames)
        try:
            self._first = await anext(self._frames)
        except StopAsyncIteration:
            error = ApiError(502, "stream ended without a final frame", code="stream_incomplete")
            await self.aclose(error)
            raise error from None
        except BaseException as exc:
            await self.aclose(exc)
            raise

    async def _timed(self, frames: Frames) -> Frames:
        """Relays frames while recording TTFT, inter-token latency and totals."""
        model = self._prepared.model
        last: float | None = None
        async with contextlib.aclosing(frames):
            async for frame in frames:
                now = self._clock()
                if isinstance(frame, TokenChunk):
                    self._generated += len(frame.token_ids)
                    if last is None:
                        self._first_token_at = now
                        self._metrics.first_token(model, now - self._received)
                        self._span.first_token(now - self._received)
                    else:
                        self._metrics.inter_token(model, now - last)
                    last = now
                else:
                    self.end, self._end_at = frame, now
                    self._metrics.finished(model, frame, now - self._received)
                yield frame

    async def relayed(self) -> Frames:
        """The request's frames, from the first, ending with its `StreamEnd`; raises what broke it off."""
        assert self._frames is not None and self._first is not None
        yield self._first
        try:
            async for frame in self._frames:
                if self._caller_gone():
                    # Checked per frame: much output carries no text to write (special
                    # tokens, partial characters, a non-streamed reply), so a failed
                    # write alone would notice a departed caller only at the end.
                    raise CallerGone("the caller has gone")
                yield frame
        except Exception as exc:  # an error mid-stream, or the caller gone: what the request's span ends with
            raise self.failed(exc)
        if self.end is None:
            raise self.failed(ApiError(502, "stream ended without a final frame", code="stream_incomplete"))

    def failed(self, error: BaseException) -> BaseException:
        self._failure = self._failure or error
        return error

    async def aclose(self, error: BaseException | None = None) -> None:
        """End the call (`error`: what ended it, if anything did); a request still running is aborted on its nodes."""
        frames, self._frames = self._frames, None
        if frames is None:
            return
        try:
            await frames.aclose()
        finally:
            self._metrics.in_flight.dec()
            structlog.contextvars.unbind_contextvars("request_id")
            ended_at = self._end_at if self._end_at is not None else self._clock()
            failure = self._failure or error
            if self._admission is not None:
                # What it used: the prompt and every token generated (all of them, if it finished).
                usage = self.end.usage if self.end is not None else None
                used = usage.prompt_tokens + usage.completion_tokens if usage else len(self._prepared.prompt_token_ids) + self._generated
                self._admission.settle(used)
            self._metrics.tenant_request(self._prepared.tenant, 200 if self.end is not None and failure is None
                                         else status_of(failure), self.end)
            self._span.end(ended_at, self.end, failure)
            if self.end is not None:
                self._on_served(self._served(ended_at, self.end))

    def _served(self, ended_at: float, end: StreamEnd) -> RequestServed:
        e2e, tokens = ended_at - self._received, end.usage.completion_tokens
        ttft = None if self._first_token_at is None else self._first_token_at - self._received
        tpot = None if ttft is None else genai.time_per_output_token(e2e, ttft, tokens)
        return RequestServed(self.request_id, self._prepared.model, ttft, e2e, tokens, tpot)

    async def __aenter__(self) -> CompletionCall:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        await self.aclose(exc)


class Served(Protocol):
    """An answer as a transport serves it: one body, or a stream (NATS: one message per chunk; HTTP: `sse`, the
    stream's server-sent events in the endpoint's framing, its end and its mid-stream error included)."""

    stream: bool
    request_id: str

    def degraded_header(self) -> dict[str, str]: ...

    async def body(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def sse(self) -> AsyncIterator[bytes]: ...

    async def __aenter__(self) -> Served: ...

    async def __aexit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None: ...


def answer_shape(request: ChatCompletionRequest | CompletionRequest, prepared: PreparedRequest,
                 model: WorkerRegistration) -> AnswerShape:
    """What shapes the answer to `request` (its first prompt's `prepared`) on `model`'s workers."""
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    common = dict(n=request.n, prompt_tokens=len(prepared.prompt_token_ids), echo_text=prepared.echo_text,
                  include_usage=include_usage, continuous_usage=include_usage and bool(options and options.continuous_usage_stats))
    if isinstance(request, CompletionRequest):
        return AnswerShape(completion_logprobs=request.logprobs, **common)
    choice = request.tool_choice
    tool_choice = "named" if isinstance(choice, NamedToolChoice) else (choice or ("auto" if request.tools else "none"))
    return AnswerShape(
        role=prepared.role,
        chat_logprobs=bool(request.logprobs),
        top_logprobs=request.top_logprobs,
        # A plain request's output is plain text (no body: the engine's parser never sees it).
        parsed=bool(model.tool_call_parser or model.reasoning_parser) and prepared.api is not None,
        auto_tools=bool(model.tool_call_parser),
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        include_reasoning=request.include_reasoning,
        reasoning_model=bool(model.reasoning_parser),
        **common,
    )


class Answer:
    """What a transport serves for one API request: the calls that answer it (one per prompt of a batch),
    rendered as one response body or one stream of chunks. Close it (`async with`) to end or abort them."""

    def __init__(self, calls: list[CompletionCall], renderer: Renderer, prepared: PreparedRequest) -> None:
        self._calls = calls
        self._renderer = renderer
        self.request_id = calls[0].request_id
        self.stream = prepared.stream
        self._include_usage = prepared.include_usage

    @property
    def notes(self) -> KvlaneNotes | None:
        """What kvlane changed in the request (the first call that says so)."""
        return next((call.notes for call in self._calls if call.notes is not None), None)

    def degraded_header(self) -> dict[str, str]:
        """`X-Kvlane-Degraded` for the transport's reply, when a request was degraded."""
        return next((header for call in self._calls if (header := call.degraded_header())), {})

    async def body(self) -> bytes:
        """The whole response body (for `"stream": false`)."""
        ends: list[StreamEnd] = []
        for index, call in enumerate(self._calls):
            async for frame in call.relayed():
                if isinstance(frame, TokenChunk):
                    self._renderer.add(frame, index)
                else:
                    ends.append(frame)
        return self._renderer.whole(ends, self.notes)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The JSON of each stream chunk, in order (for `"stream": true`); an error mid-stream raises `ApiError`."""
        for chunk in self._renderer.opening():
            yield chunk
        ends: list[StreamEnd] = []
        for index, call in enumerate(self._calls):
            async for frame in call.relayed():
                if isinstance(frame, TokenChunk):
                    for chunk in self._renderer.delta(frame, index, call.notes):
                        yield chunk
                else:
                    ends.append(frame)
                    for chunk in self._renderer.closing(frame, call.notes, index):
                        yield chunk
        if self._include_usage:
            yield self._renderer.usage(ends)

    async def sse(self) -> AsyncIterator[bytes]:
        """The stream as server-sent events: each chunk, the error that broke it off (if one did), `[DONE]`."""
        try:
            async for chunk in self.chunks():
                yield sse(chunk)
        except ApiError as exc:
            log.warning("stream_failed", code=exc.code, error=exc.message)
            yield sse(error_json(exc))
        yield DONE

    async def aclose(self, error: BaseException | None = None) -> None:
        for call in self._calls:
            await call.aclose(error)

    async def __aenter__(self) -> Answer:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        await self.aclose(exc)


class TranslatedAnswer(ABC):
    """A chat's answer told in another API's shape (Anthropic's Messages, OpenAI's Responses): a body, or a stream
    of events. A subclass says how (`body`, `events`, `sse`); closing it (`async with`) ends or aborts the chat."""

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self.stream = answer.stream
        self.request_id = answer.request_id

    def degraded_header(self) -> dict[str, str]:
        return self._answer.degraded_header()

    @abstractmethod
    def events(self) -> AsyncIterator[Any]:
        """The answer as the other API's events, in order."""

    async def chunks(self) -> AsyncIterator[bytes]:
        """Each event's JSON (the NATS API's stream messages: the event's `type` is in its body)."""
        async for event in self.events():
            yield _ENCODER.encode(event)

    async def __aenter__(self) -> TranslatedAnswer:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        await self._answer.aclose(exc)


def error_json(error: ApiError) -> bytes:
    return _ENCODER.encode(error.body())


def status_of(exc: BaseException | None) -> int:
    """The HTTP status a request that ended with `exc` gets (499: its caller left, or it ended unfinished)."""
    if isinstance(exc, ApiError):
        return exc.status
    if exc is None or isinstance(exc, (ConnectionError, asyncio.CancelledError, GeneratorExit)):
        return 499
    return 500
