"""One completion request as OpenTelemetry sees it at the ingress.

The request's SERVER span, `{gen_ai.operation.name} {gen_ai.request.model}`
(GenAI semantic conventions), continues the caller's W3C `traceparent` when
there is one and is the parent of every span the request causes downstream
(`context` goes with the dispatcher's bus messages). When the request ends
the span gets the usage, finish reason and time to first token, and the
`gen_ai.server.*` histograms get one measurement each.

Nothing here runs per token: `first_token` is called once.
"""

from __future__ import annotations

import asyncio

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, NoOpTracer, SpanKind, Tracer

from contracts.messages import StreamEnd
from services.ingress.errors import ApiError
from services.ingress.prompts import PreparedRequest
from shared import genai
from shared.telemetry import set_error


def error_type(exc: BaseException | None) -> str:
    """`error.type` of a request that failed: the API error's code (else its status), or what ended it."""
    if isinstance(exc, ApiError):
        return exc.code or str(exc.status)
    if exc is None or isinstance(exc, ConnectionError):  # CallerGone included
        return "client_disconnected"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    return type(exc).__qualname__


class RequestTrace:
    def __init__(
        self,
        tracer: Tracer,
        metrics: genai.GenAiServerMetrics | None,
        operation: str,
        parent: Context | None,
        received: float,
    ) -> None:
        """`parent`: the caller's trace (from its `traceparent`), else a new trace starts here; `received`: monotonic."""
        self._metrics = metrics
        self._operation = operation
        self._received = received
        self._model: str | None = None
        self._ttft_s: float | None = None
        self._ended = False
        if isinstance(tracer, NoOpTracer) and not trace.get_current_span(parent).get_span_context().is_valid:
            # Tracing off and no caller's trace to continue: nothing to record or pass on, so no span to make.
            self.span, self.context = INVALID_SPAN, parent if parent is not None else Context()
            return
        self.span = tracer.start_span(
            genai.span_name(operation, None), context=parent, kind=SpanKind.SERVER,
            attributes={genai.OPERATION_NAME: operation, genai.PROVIDER_NAME: genai.PROVIDER},
        )
        # What the dispatcher's attempts descend from.
        self.context = trace.set_span_in_context(self.span, parent)

    def model(self, model: str) -> None:
        """The body decoded: the span is named after the model asked for."""
        self._model = model
        if self.span.is_recording():
            self.span.update_name(genai.span_name(self._operation, model))
            self.span.set_attribute(genai.REQUEST_MODEL, model)

    def caller(self, tenant: str, key_id: str) -> None:
        """Who asks: the tenant of the request's API key and the key's public id (never the key)."""
        self.span.set_attributes({"kvlane.tenant": tenant, "kvlane.api_key.id": key_id})

    def prepared(self, request_id: str, response_id: str, prepared: PreparedRequest, requested_priority: int | None = None) -> None:
        """`requested_priority`: what the body asked for, when the key's maximum may have lowered it."""
        span = self.span
        if not span.is_recording():
            return
        sampling = prepared.sampling
        attributes = {
            genai.REQUEST_MAX_TOKENS: sampling.max_tokens,
            genai.REQUEST_TEMPERATURE: sampling.temperature,
            genai.REQUEST_TOP_P: sampling.top_p,
            genai.RESPONSE_ID: response_id,
            "kvlane.request_id": request_id,
            "kvlane.stream": prepared.stream,
            "kvlane.priority": prepared.priority,
            "kvlane.prompt_blocks": len(prepared.block_hashes),
        }
        if requested_priority is not None and requested_priority != prepared.priority:
            attributes["kvlane.priority.requested"] = requested_priority
        if prepared.adapter is not None:
            attributes["kvlane.adapter"] = prepared.adapter.name
        if sampling.top_k > 0:
            attributes[genai.REQUEST_TOP_K] = sampling.top_k
        if sampling.seed is not None:
            attributes[genai.REQUEST_SEED] = sampling.seed
        if sampling.stop:
            attributes[genai.REQUEST_STOP_SEQUENCES] = sampling.stop
        if sampling.presence_penalty:
            attributes[genai.REQUEST_PRESENCE_PENALTY] = sampling.presence_penalty
        if sampling.frequency_penalty:
            attributes[genai.REQUEST_FREQUENCY_PENALTY] = sampling.frequency_penalty
        span.set_attributes(attributes)

    def first_token(self, ttft_s: float) -> None:
        """The first output token reached the ingress, `ttft_s` after the request did."""
        self._ttft_s = ttft_s
        self.span.add_event(genai.FIRST_TOKEN_EVENT, {genai.TIME_TO_FIRST_TOKEN: ttft_s})

    def end(self, now: float, end: StreamEnd | None, failure: BaseException | None) -> None:
        """The request is over: it succeeded when its final frame came and nothing failed (idempotent)."""
        if self._ended:
            return
        self._ended = True
        duration_s = now - self._received
        span = self.span
        if end is not None and failure is None:
            usage = end.usage
            if span.is_recording():
                attributes = {
                    genai.RESPONSE_MODEL: self._model or "",
                    genai.RESPONSE_FINISH_REASONS: [end.finish_reason],
                    genai.USAGE_INPUT_TOKENS: usage.prompt_tokens,
                    genai.USAGE_OUTPUT_TOKENS: usage.completion_tokens,
                    genai.USAGE_CACHE_READ_INPUT_TOKENS: usage.cached_tokens,
                    "kvlane.worker.id": end.worker_id,
                }
                if self._ttft_s is not None:
                    attributes[genai.TIME_TO_FIRST_TOKEN] = self._ttft_s
                span.set_attributes(attributes)
            if self._metrics is not None:
                self._metrics.record(self._operation, self._model, duration_s, self._ttft_s, usage.completion_tokens)
        else:
            kind = error_type(failure)
            set_error(span, kind, str(failure) if failure is not None else "the request ended before its final frame")
            if self._metrics is not None:
                self._metrics.record(self._operation, self._model, duration_s, error=kind)
        span.end()
