"""The spans one request makes, without servers: the ingress's SERVER span (GenAI
conventions), its dispatch attempts, the balancer's fast-forward flag and the
worker's span helpers, recorded by in-memory exporters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from contracts.messages import (
    EngineStats, GenerateRequest, Heartbeat, KvRef, SamplingParams, StreamEnd, Timings, TokenChunk, Usage, WorkerRegistration,
)
from services.balancer.snapshot import ChainState, ClusterSnapshot
from services.ingress.completions import CHAT, TEXT_COMPLETION, Completions
from services.ingress.dispatch import StreamInterrupted, _Attempt
from services.ingress.errors import ApiError
from services.worker.tracing import KvTransferSpan, end_request_span, request_span
from shared import genai
from shared.cluster import ClusterView
from shared.config import IngressSettings, TracingSettings
from shared.telemetry import Telemetry
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, request, router

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"


class Recorded:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.metrics = InMemoryMetricReader()
        self.telemetry = Telemetry(TracingSettings(exporter="otlp"), "test", exporter=self.spans, metric_reader=self.metrics)

    def finished(self) -> list[ReadableSpan]:
        self.telemetry.flush()
        return list(self.spans.get_finished_spans())

    def histogram_counts(self) -> dict[str, int]:
        data = self.metrics.get_metrics_data()
        if data is None:
            return {}
        return {m.name: sum(p.count for p in m.data.data_points)
                for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


class NoMetrics:
    """Stands in for the ingress's Prometheus metrics, which these tests do not look at."""

    def __getattr__(self, name: str) -> NoMetrics:
        return self

    def __call__(self, *args: object, **kwargs: object) -> NoMetrics:
        return self


class FakeDispatcher:
    """Yields two tokens and the end, and remembers the trace context it was given."""

    def __init__(self, cap: int | None = None) -> None:
        self.contexts: list[object] = []
        self._cap = cap  # the balancer degraded the request to this many tokens

    async def run(self, request_id: str, prepared, trace_context=None,
                  on_capped=lambda max_tokens: None) -> AsyncIterator[TokenChunk | StreamEnd]:
        self.contexts.append(trace_context)
        if self._cap is not None:
            on_capped(self._cap)
        yield TokenChunk(request_id, 0, [5], "a")
        yield TokenChunk(request_id, 1, [6], "b")
        yield StreamEnd(request_id, 2, "length", Usage(len(prepared.prompt_token_ids), 2, 1), Timings(), "w7")


def cluster_with(model: str) -> ClusterView:
    view = ClusterView(1e9)
    registration = WorkerRegistration(
        worker_id="w7", role="aggregated", model=model, engine="sim", inbox="inbox.w7", block_size=16, max_model_len=4096,
        tokenizer="sim", started_at=0.0,
    )
    view.observe(Heartbeat(registration=registration, stats=EngineStats(), sent_at=0.0, seq=1), 0.0)
    return view


def completions(recorded: Recorded, dispatcher: object = None, model: str = "m") -> Completions:
    return Completions(IngressSettings(max_body_bytes=4096), cluster_with(model), dispatcher, NoMetrics(),  # type: ignore[arg-type]
                       telemetry=recorded.telemetry)


def attributes(span: ReadableSpan) -> dict[str, object]:
    return dict(span.attributes or {})


async def test_the_ingress_span_continues_the_callers_trace_and_carries_the_genai_attributes() -> None:
    recorded, dispatcher = Recorded(), FakeDispatcher()
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0.3, "seed": 4}'
    call = await completions(recorded, dispatcher).start(CHAT, body, lambda: False, {"traceparent": TRACEPARENT})
    async with call:
        await call.body()
    (span,) = recorded.finished()
    assert span.name == "chat m" and span.kind == SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == PARENT_SPAN
    attrs = attributes(span)
    assert attrs[genai.OPERATION_NAME] == "chat" and attrs[genai.PROVIDER_NAME] == "kvlane"
    assert (attrs[genai.REQUEST_MODEL], attrs[genai.REQUEST_MAX_TOKENS], attrs[genai.REQUEST_TEMPERATURE]) == ("m", 2, 0.3)
    assert attrs[genai.REQUEST_SEED] == 4 and attrs[genai.RESPONSE_ID] == f"chatcmpl-{call.request_id}"
    assert attrs[genai.RESPONSE_FINISH_REASONS] == ("length",)
    assert (attrs[genai.USAGE_OUTPUT_TOKENS], attrs[genai.USAGE_CACHE_READ_INPUT_TOKENS]) == (2, 1)
    assert attrs[genai.USAGE_INPUT_TOKENS] > 0 and attrs[genai.TIME_TO_FIRST_TOKEN] >= 0
    assert [event.name for event in span.events] == [genai.FIRST_TOKEN_EVENT]
    assert span.status.status_code == StatusCode.UNSET and genai.ERROR_TYPE not in attrs
    # The dispatcher got the span's context: its attempts (and all downstream) are the span's children.
    (context,) = dispatcher.contexts
    from opentelemetry import trace
    assert trace.get_current_span(context).get_span_context().span_id == span.context.span_id
    assert recorded.histogram_counts() == {genai.TIME_TO_FIRST_TOKEN: 1, genai.TIME_PER_OUTPUT_TOKEN: 1, genai.REQUEST_DURATION: 1}


async def test_a_degraded_request_says_so_in_its_body_closing_chunk_and_header() -> None:
    import json

    body = b'{"model": "m", "prompt": "x", "max_tokens": 40}'
    call = await completions(Recorded(), FakeDispatcher(cap=2)).start(TEXT_COMPLETION, body, lambda: False, {})
    async with call:
        whole = json.loads(await call.body())
    assert whole["kvlane"] == {"degraded": {"reason": "overload", "max_tokens": 2, "requested_max_tokens": 40}}
    assert call.degraded_header() == {"X-Kvlane-Degraded": "reason=overload; max_tokens=2; requested_max_tokens=40"}
    streamed = await completions(Recorded(), FakeDispatcher(cap=2)).start(TEXT_COMPLETION, body[:-1] + b', "stream": true}',
                                                                           lambda: False, {})
    async with streamed:
        chunks = [json.loads(chunk) async for chunk in streamed.chunks()]
    assert [("kvlane" in chunk) for chunk in chunks] == [False, False, True]  # the closing chunk only
    plain = await completions(Recorded(), FakeDispatcher()).start(TEXT_COMPLETION, body, lambda: False, {})
    async with plain:
        assert "kvlane" not in json.loads(await plain.body()) and plain.degraded_header() == {}


async def test_without_a_traceparent_the_ingress_starts_the_trace() -> None:
    recorded = Recorded()
    call = await completions(recorded, FakeDispatcher()).start(TEXT_COMPLETION, b'{"model": "m", "prompt": "x"}', lambda: False, {})
    async with call:
        async for _ in call.chunks():
            pass
    (span,) = recorded.finished()
    assert span.name == "text_completion m" and span.parent is None


@pytest.mark.parametrize(("body", "name", "error"), [
    (b"{not json", "chat", "invalid_json"),
    (b'{"model": "other", "messages": [{"role": "user", "content": "hi"}]}', "chat other", "model_not_found"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}', "chat m", "invalid_value"),
    (b"x" * 5000, "chat", "request_entity_too_large"),
])
async def test_a_request_that_fails_validation_still_gets_its_span_with_the_error(body: bytes, name: str, error: str) -> None:
    recorded = Recorded()
    with pytest.raises(ApiError):
        await completions(recorded).start(CHAT, body, lambda: False, {"traceparent": TRACEPARENT})
    (span,) = recorded.finished()
    assert span.name == name and span.kind == SpanKind.SERVER
    assert attributes(span)[genai.ERROR_TYPE] == error and span.status.status_code == StatusCode.ERROR
    assert recorded.histogram_counts() == {genai.REQUEST_DURATION: 1}


async def test_a_request_failing_mid_stream_ends_its_span_with_the_error() -> None:
    class Failing(FakeDispatcher):
        async def run(self, request_id: str, prepared, trace_context=None, on_capped=None):
            yield TokenChunk(request_id, 0, [5], "a")
            raise ApiError(502, "request failed after 2 resumptions", code="stream_interrupted")

    recorded = Recorded()
    call = await completions(recorded, Failing()).start(TEXT_COMPLETION, b'{"model": "m", "prompt": "x", "stream": true}',
                                                        lambda: False)
    with pytest.raises(ApiError):
        async with call:
            async for _ in call.chunks():
                pass
    (span,) = recorded.finished()
    assert attributes(span)[genai.ERROR_TYPE] == "stream_interrupted" and span.status.status_code == StatusCode.ERROR
    assert recorded.histogram_counts() == {genai.REQUEST_DURATION: 1}


async def test_a_caller_gone_before_the_end_is_client_disconnected() -> None:
    recorded = Recorded()
    call = await completions(recorded, FakeDispatcher()).start(TEXT_COMPLETION, b'{"model": "m", "prompt": "x"}', lambda: False)
    async with call:
        pass  # the transport stopped before reading anything: its client left
    (span,) = recorded.finished()
    assert attributes(span)[genai.ERROR_TYPE] == "client_disconnected"


# --- dispatch attempts --------------------------------------------------------------


def attempt_span(recorded: Recorded, act) -> ReadableSpan:
    attempt = _Attempt(recorded.telemetry.tracer, None, 2, "r1", 7)
    act(attempt)
    attempt.end()
    (span,) = recorded.finished()
    assert span.name == "dispatch.attempt"
    assert (attributes(span)["kvlane.attempt"], attributes(span)["kvlane.resumed_tokens"]) == (2, 7)
    return span


def test_attempt_outcomes() -> None:
    span = attempt_span(Recorded(), lambda a: a.interrupted(StreamInterrupted("worker w0 is gone", "timeout", "w0")))
    assert attributes(span)["kvlane.outcome"] == "interrupted" and attributes(span)["kvlane.interruption.culprit"] == "w0"
    assert attributes(span)[genai.ERROR_TYPE] == "stream_interrupted" and span.status.status_code == StatusCode.ERROR

    span = attempt_span(Recorded(), lambda a: a.interrupted(StreamInterrupted("preempted to make room", None, preempted=True)))
    assert attributes(span)["kvlane.outcome"] == "preempted" and span.status.status_code == StatusCode.UNSET

    span = attempt_span(Recorded(), lambda a: a.refused("w1"))
    assert attributes(span)["kvlane.outcome"] == "not_accepted" and attributes(span)["kvlane.refused_by"] == "w1"

    span = attempt_span(Recorded(), lambda a: a.failed(ApiError(404, "no", code="model_not_found")))
    assert attributes(span)["kvlane.outcome"] == "failed" and attributes(span)[genai.ERROR_TYPE] == "model_not_found"

    span = attempt_span(Recorded(), lambda a: a.failed(asyncio.CancelledError()))
    assert attributes(span)["kvlane.outcome"] == "cancelled" and span.status.status_code == StatusCode.UNSET

    def finished_then_closed(attempt: _Attempt) -> None:
        attempt.outcome = "finished"
        attempt.failed(GeneratorExit())  # the caller stopped reading after the final frame

    assert attributes(attempt_span(Recorded(), finished_then_closed))["kvlane.outcome"] == "finished"


# --- balancer ------------------------------------------------------------------------


class Choosing:
    """A policy that takes the first free chain, counting a fast-forward when told to."""

    name = "stub"
    cache_hold_share = 0.0
    bounds_backlog = False

    def __init__(self, fast_forward: bool) -> None:
        self._fast_forward = fast_forward
        self.fast_forwards = 0

    def choose(self, request, snapshot: ClusterSnapshot) -> ChainState | None:
        self.fast_forwards += self._fast_forward
        return snapshot.free()[0]

    def choose_indexed(self, request, chains) -> int | None:
        self.fast_forwards += self._fast_forward
        return int(chains.free_rows[0])


@pytest.mark.parametrize("fast_forward", [True, False])
def test_a_placement_says_whether_the_policy_fast_forwarded(fast_forward: bool) -> None:
    core = router()
    core.policy = Choosing(fast_forward)
    placement = core.place(request(), [heartbeat("w0")], NOW_WALL + 60)
    assert placement is not None and placement.fast_forward is fast_forward


# --- worker --------------------------------------------------------------------------


def test_worker_spans_carry_the_request_and_end_once() -> None:
    recorded = Recorded()
    registration = cluster_with("m").models(0.0)["m"]
    run = GenerateRequest(request_id="r1", model="m", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4),
                          stream_to="s", timeout_s=30.0, resume_token_ids=[9])
    decode = request_span(recorded.telemetry.tracer, "decode", registration, run)
    transfer = KvTransferSpan(recorded.telemetry.tracer, KvRef("p0", "p0", "r1", 3, 30.0, kv_bytes=3072), "nvlink")
    transfer.pull_failed(1, "source p0 unreachable")
    transfer.done("recomputed", 1, "kv_pull_failed")
    transfer.done("aborted", 0)  # already ended: nothing changes
    end_request_span(decode, "error", "engine_error", 2, 0)
    spans = {span.name: span for span in recorded.finished()}
    assert attributes(spans["kv.transfer"]) | {} == {
        "kvlane.kv.bytes": 3072, "kvlane.kv.tokens": 3, "kvlane.kv.link": "nvlink", "kvlane.kv.source_worker.id": "p0",
        "kvlane.outcome": "recomputed", "kvlane.kv.pull_attempts": 1, genai.ERROR_TYPE: "kv_pull_failed",
    }
    assert [event.name for event in spans["kv.transfer"].events] == ["kv_pull_failed"]
    attrs = attributes(spans["decode"])
    assert (attrs["kvlane.worker.id"], attrs["kvlane.resumed_tokens"], attrs[genai.USAGE_INPUT_TOKENS]) == ("w7", 1, 3)
    assert attrs["kvlane.outcome"] == "error" and attrs[genai.ERROR_TYPE] == "engine_error"
    assert spans["decode"].status.status_code == StatusCode.ERROR
