"""One OpenTelemetry trace per request, exported over OTLP/HTTP to a real receiver.

The receiver is an aiohttp server on a free port that decodes what the
services POST to `/v1/traces` and `/v1/metrics` with `opentelemetry-proto`.
Each fleet is told `tracing.exporter = "otlp"` at the receiver, with a short
batch delay, so spans arrive within a fraction of a second; the tests poll
the received spans until the trace they expect is complete (or a deadline).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats
import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as ProtoStatus

from contracts import subjects
from contracts.messages import GenerateRequest, TokenChunk
from launch.fleet import Fleet, with_overrides
from launch.launcher import free_port
from tests.integration.conftest import MODEL, launch, stop_and_check
from tests.integration.test_disaggregated import LONG, BusWatch, disaggregated, process, worker_of
from tests.integration.test_prefix_pull import BUSY_TOKENS, PREFIX, busy_source, cache_on_one_worker, sharing

pytestmark = pytest.mark.integration

SERVER = ProtoSpan.SPAN_KIND_SERVER
CONSUMER = ProtoSpan.SPAN_KIND_CONSUMER
INTERNAL = ProtoSpan.SPAN_KIND_INTERNAL
ERROR = ProtoStatus.STATUS_CODE_ERROR


# --- the receiver ------------------------------------------------------------------


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs) -> dict[str, object]:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass
class Span:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object]
    status: int
    events: list[str]


@dataclass
class Histogram:
    count: int
    attributes: dict[str, object]


@dataclass
class OtlpReceiver:
    """A real OTLP/HTTP (protobuf) endpoint: what the services send, decoded."""

    spans: list[Span] = field(default_factory=list)
    # Metric name -> its data points in the latest export that carried it (cumulative temporality).
    histograms: dict[str, list[Histogram]] = field(default_factory=dict)
    url: str = ""

    async def _traces(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await _body(request))
        for resource_spans in export.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name"))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(Span(
                        service, span.name, span.kind, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                        _attributes(span.attributes), span.status.code, [event.name for event in span.events],
                    ))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf")

    async def _metrics(self, request: web.Request) -> web.Response:
        export = ExportMetricsServiceRequest.FromString(await _body(request))
        for resource_metrics in export.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.WhichOneof("data") == "histogram":
                        assert metric.unit == "s", metric.name
                        self.histograms[metric.name] = [
                            Histogram(point.count, _attributes(point.attributes)) for point in metric.histogram.data_points
                        ]
        return web.Response(body=ExportMetricsServiceResponse().SerializeToString(), content_type="application/x-protobuf")

    def trace(self, trace_id: str) -> list[Span]:
        return [span for span in self.spans if span.trace_id == trace_id]


async def _body(request: web.Request) -> bytes:
    assert request.content_type == "application/x-protobuf"
    body = await request.read()
    return gzip.decompress(body) if request.headers.get("Content-Encoding") == "gzip" else body


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    collected = OtlpReceiver()
    app = web.Application()
    app.router.add_post("/v1/traces", collected._traces)
    app.router.add_post("/v1/metrics", collected._metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    collected.url = f"http://127.0.0.1:{port}"
    yield collected
    await runner.cleanup()


def exporting_to(receiver: OtlpReceiver, then: Callable | None = None, **tracing: object) -> Callable:
    """A `tune` that sends every service's spans (and metrics) to `receiver`, given as a base URL."""

    def tune(config):
        config = with_overrides(config, tracing={"exporter": "otlp", "otlp_endpoint": receiver.url, "batch_delay_s": 0.1,
                                                 **tracing})
        return then(config) if then else config

    return tune


async def start_fleet(tmp_path: Path, **kwargs: object) -> Fleet:
    # Off the event loop: the receiver must answer while the fleet starts.
    return await asyncio.to_thread(launch, tmp_path, **kwargs)


async def stop_fleet(fleet: Fleet) -> None:
    await asyncio.to_thread(stop_and_check, fleet)


async def wait_for(
    check: Callable[[], object], timeout: float = 20.0, what: str = "spans", seen: Callable[[], object] = lambda: None,
) -> object:
    """Poll until `check()` returns something truthy; after `timeout`, fail saying what `seen()` found."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what} not received within {timeout}s; received: {seen()}"
        await asyncio.sleep(0.05)
    return result


def traceparent() -> tuple[str, str, str]:
    """A client-chosen W3C traceparent: (header, trace id, parent span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def one(spans: list[Span], name: str, **attributes: object) -> Span:
    found = [s for s in spans if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())]
    assert len(found) == 1, f"{len(found)} spans {name} {attributes} in {[(s.service, s.name) for s in spans]}"
    return found[0]


def names(spans: list[Span]) -> set[str]:
    return {span.name for span in spans}


# --- (a) an aggregated request, its trace continued; the GenAI metrics --------------


AGGREGATED_SPANS = {"chat kvlane-sim", "dispatch.attempt", "handle kvlane.v1.route", "route", "kv.allocate", "decode"}


async def test_aggregated_request_continues_the_callers_trace_and_metrics_are_flushed(tmp_path: Path, receiver: OtlpReceiver) -> None:
    # Metrics every 10 minutes: only the flush at shutdown can deliver them.
    fleet = await start_fleet(tmp_path, tune=exporting_to(receiver, metrics_interval_s=600.0))
    try:
        header, trace_id, parent_id = traceparent()
        client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "trace me"}], max_tokens=9, temperature=0.5, top_p=0.9,
            extra_headers={"traceparent": header},
        )
        spans = await wait_for(lambda: AGGREGATED_SPANS <= names(found := receiver.trace(trace_id)) and found)

        ingress = one(spans, "chat kvlane-sim")
        assert (ingress.service, ingress.kind, ingress.parent_id) == ("kvlane-ingress", SERVER, parent_id)
        attrs = ingress.attributes
        assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.provider.name"] == "kvlane"
        assert attrs["gen_ai.request.model"] == MODEL and attrs["gen_ai.response.model"] == MODEL
        assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"], attrs["gen_ai.request.top_p"]) == (9, 0.5, 0.9)
        assert attrs["gen_ai.response.id"] == reply.id
        assert attrs["gen_ai.response.finish_reasons"] == [reply.choices[0].finish_reason]
        assert attrs["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
        assert attrs["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens == 9
        assert 0 < attrs["gen_ai.server.time_to_first_token"] < 30
        assert "gen_ai.first_token" in ingress.events and "error.type" not in attrs and ingress.status != ERROR

        attempt = one(spans, "dispatch.attempt")
        assert attempt.parent_id == ingress.span_id and attempt.service == "kvlane-ingress"
        worker_id = attempt.attributes["kvlane.worker.id"]
        assert attempt.attributes["kvlane.attempt"] == 1 and attempt.attributes["kvlane.outcome"] == "finished"

        handle_route = one(spans, "handle kvlane.v1.route")
        assert (handle_route.service, handle_route.kind, handle_route.parent_id) == ("kvlane-balancer", CONSUMER, attempt.span_id)
        route = one(spans, "route")
        assert route.parent_id == handle_route.span_id and route.service == "kvlane-balancer"
        assert route.attributes["kvlane.worker.id"] == worker_id and route.attributes["kvlane.route.outcome"] == "placed"
        assert route.attributes["kvlane.route.policy"] == attempt.attributes["kvlane.route.policy"]
        assert route.attributes["kvlane.route.queue_wait_s"] == 0.0 and route.attributes["kvlane.route.fast_forward"] is False
        allocation = one(spans, "kv.allocate")
        assert allocation.parent_id == route.span_id and allocation.attributes["kvlane.worker.id"] == worker_id
        assert allocation.attributes["kvlane.kv.blocks"] >= 1 and allocation.attributes["kvlane.kv.tokens"] >= 9

        handle_generate = one(spans, f"handle {subjects.worker_inbox(worker_id)}")
        assert handle_generate.parent_id == attempt.span_id and handle_generate.service == "kvlane-worker"
        decode = one(spans, "decode")
        assert decode.parent_id == handle_generate.span_id and decode.attributes["kvlane.worker.id"] == worker_id
        assert decode.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
        assert decode.attributes["kvlane.outcome"] == reply.choices[0].finish_reason and "first_output" in decode.events
        # Every span of the request descends from the ingress span.
        by_id = {span.span_id: span for span in spans}
        for span in spans:
            if span is not ingress:
                ancestor = span
                while ancestor.parent_id in by_id and ancestor is not ingress:
                    ancestor = by_id[ancestor.parent_id]
                assert ancestor is ingress, f"{span.name} does not descend from the ingress span"

        # The NATS API continues a traceparent sent in the NATS headers too.
        nats_header, nats_trace_id, nats_parent_id = traceparent()
        nc = await nats.connect(fleet.config.nats.url)
        try:
            body = {"model": MODEL, "prompt": "over nats", "max_tokens": 4}
            answer = await nc.request(subjects.API_COMPLETIONS, json.dumps(body).encode(), timeout=30,
                                      headers={"traceparent": nats_header})
        finally:
            await nc.close()
        completion = json.loads(answer.data)
        over_nats = await wait_for(lambda: [s for s in receiver.trace(nats_trace_id) if s.kind == SERVER])
        assert over_nats[0].name == "text_completion kvlane-sim" and over_nats[0].parent_id == nats_parent_id
        assert over_nats[0].attributes["gen_ai.usage.output_tokens"] == completion["usage"]["completion_tokens"]

        # Without a traceparent the ingress starts the trace; a request that fails validation still gets its span.
        plain = await client.completions.create(model=MODEL, prompt="no trace given", max_tokens=6)
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        root = await wait_for(lambda: [s for s in receiver.spans if s.attributes.get("gen_ai.response.id") == plain.id])
        assert root[0].parent_id == "" and root[0].kind == SERVER
        refused = await wait_for(lambda: [s for s in receiver.spans if s.name == "text_completion no-such-model"])
        assert refused[0].attributes["error.type"] == "model_not_found" and refused[0].status == ERROR

        # The gen_ai.server.* histograms: flushed when the ingress stops, one measurement per request.
        sent = 3  # chat, NATS, plain: the refused one counts in request.duration only, with error.type
        assert not receiver.histograms
        await asyncio.to_thread(fleet.ingress.stop)  # SIGTERM: it drains, then exports once more
        metrics = ("gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token", "gen_ai.server.request.duration")
        await wait_for(lambda: all(name in receiver.histograms for name in metrics), what="metrics")
        for name in metrics:
            points = receiver.histograms[name]
            ok = [p for p in points if "error.type" not in p.attributes]
            assert sum(p.count for p in ok) == sent, (name, points)
            assert all(p.attributes["gen_ai.provider.name"] == "kvlane" and p.attributes["gen_ai.request.model"] == MODEL
                       for p in ok)
            assert {p.attributes["gen_ai.operation.name"] for p in ok} == {"chat", "text_completion"}
        failed = [p for p in receiver.histograms["gen_ai.server.request.duration"] if "error.type" in p.attributes]
        assert [(p.count, p.attributes["error.type"]) for p in failed] == [(1, "model_not_found")]
    finally:
        await stop_fleet(fleet)


# --- (b) a disaggregated request ---------------------------------------------------


async def test_disaggregated_request_traces_prefill_handoff_and_decode(tmp_path: Path, receiver: OtlpReceiver) -> None:
    fleet = await start_fleet(tmp_path, workers=0, prefill_workers=1, decode_workers=1,
                              tune=exporting_to(receiver, then=disaggregated()))
    try:
        header, trace_id, _ = traceparent()
        client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
        reply = await client.completions.create(model=MODEL, prompt=LONG, max_tokens=6, extra_headers={"traceparent": header})
        wanted = {"text_completion kvlane-sim", "dispatch.attempt", "route", "prefill", "kv.handoff", "decode", "kv.transfer"}
        spans = await wait_for(lambda: wanted <= names(found := receiver.trace(trace_id)) and found)

        ingress = one(spans, "text_completion kvlane-sim")
        attempt = one(spans, "dispatch.attempt")
        assert attempt.parent_id == ingress.span_id
        assert (attempt.attributes["kvlane.prefill_worker.id"], attempt.attributes["kvlane.worker.id"]) == ("p0", "d0")
        route = one(spans, "route")
        assert route.attributes["kvlane.prefill_worker.id"] == "p0" and route.attributes["kvlane.worker.id"] == "d0"

        handle_prefill = one(spans, f"handle {subjects.worker_inbox('p0')}")
        assert handle_prefill.parent_id == attempt.span_id
        prefill = one(spans, "prefill")
        assert (prefill.service, prefill.parent_id) == ("kvlane-prefill-worker", handle_prefill.span_id)
        assert prefill.attributes["kvlane.outcome"] == "handed_off" and prefill.attributes["kvlane.decode_worker.id"] == "d0"
        assert prefill.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
        handoff = one(spans, "kv.handoff")
        assert handoff.parent_id == prefill.span_id and handoff.status != ERROR
        kv_bytes = handoff.attributes["kvlane.kv.bytes"]
        assert kv_bytes >= reply.usage.prompt_tokens * 1024 and handoff.attributes["kvlane.kv.link"] == "rdma-400g"

        handle_decode = one(spans, f"handle {subjects.worker_inbox('d0')}")
        assert handle_decode.parent_id == handoff.span_id
        decode = one(spans, "decode")
        assert (decode.service, decode.parent_id) == ("kvlane-decode-worker", handle_decode.span_id)
        assert decode.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
        transfer = one(spans, "kv.transfer")
        assert transfer.parent_id == decode.span_id and transfer.attributes["kvlane.outcome"] == "pulled"
        assert transfer.attributes["kvlane.kv.bytes"] == kv_bytes and transfer.attributes["kvlane.kv.source_worker.id"] == "p0"
        assert ingress.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
    finally:
        await stop_fleet(fleet)


# --- (c) a migrated request --------------------------------------------------------


async def test_migrated_request_shows_two_attempts_in_one_trace(tmp_path: Path, receiver: OtlpReceiver) -> None:
    # 20 ms a step and 300 tokens: the request is still mid-stream when its worker dies, even
    # when this test hears the stream seconds late on a loaded machine (a frame then carries several steps' tokens).
    fleet = await start_fleet(tmp_path, workers=2, tune=exporting_to(receiver), speed=0.1)
    try:
        header, trace_id, _ = traceparent()
        async with BusWatch(fleet) as watch:
            victim: list[str] = []
            request_ids: list[str] = []
            tokens = [0]

            def on(subject: str, message: object) -> None:
                # This request's (its 300 tokens), not a health prober's canary: those run on the same bus.
                if isinstance(message, GenerateRequest) and not victim and message.sampling.max_tokens == 300:
                    victim.append(worker_of(subject))
                    request_ids.append(message.request_id)
                elif isinstance(message, TokenChunk) and request_ids and message.request_id == request_ids[0] and tokens[0] < 5:
                    tokens[0] += len(message.token_ids)
                    if tokens[0] >= 5:
                        process(fleet, victim[0]).signal(signal.SIGKILL)

            watch.on = on
            client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
            stream = await client.completions.create(
                model=MODEL, prompt="a request that moves", max_tokens=300, seed=5, stream=True,
                stream_options={"include_usage": True}, extra_headers={"traceparent": header},
            )
            usage = [chunk.usage async for chunk in stream if chunk.usage][-1]
        assert tokens[0] >= 5 and usage.completion_tokens == 300, "the worker was not killed mid-stream"
        survivor = {"w0": "w1", "w1": "w0"}[victim[0]]

        def both_attempts_and_the_survivors_decode() -> list[Span] | None:
            found = receiver.trace(trace_id)
            done = len([s for s in found if s.name == "dispatch.attempt"]) == 2 and "decode" in names(found)
            return found if done and "text_completion kvlane-sim" in names(found) else None

        spans = await wait_for(both_attempts_and_the_survivors_decode,
                               seen=lambda: sorted((s.service, s.name) for s in receiver.trace(trace_id)))
        ingress = one(spans, "text_completion kvlane-sim")
        first = one(spans, "dispatch.attempt", **{"kvlane.attempt": 1})
        second = one(spans, "dispatch.attempt", **{"kvlane.attempt": 2})
        assert first.parent_id == second.parent_id == ingress.span_id
        assert first.attributes["kvlane.worker.id"] == victim[0] and first.attributes["kvlane.outcome"] == "interrupted"
        assert first.status == ERROR and first.attributes["error.type"] == "stream_interrupted"
        assert second.attributes["kvlane.worker.id"] == survivor and second.attributes["kvlane.outcome"] == "finished"
        assert first.attributes["kvlane.handed_over"] and second.attributes["kvlane.handed_over"]  # by the balancer
        assert second.attributes["kvlane.resumed_tokens"] >= 5
        # Each attempt was routed in its own span; the survivor's decode descends from the second attempt.
        assert sorted(s.parent_id for s in spans if s.name == "handle kvlane.v1.route") == sorted([first.span_id, second.span_id])
        decode = one(spans, "decode")
        handle = next(s for s in spans if s.span_id == decode.parent_id)
        assert handle.parent_id == second.span_id and decode.attributes["kvlane.worker.id"] == survivor
        assert decode.attributes["kvlane.resumed_tokens"] == second.attributes["kvlane.resumed_tokens"]
        assert ingress.attributes["gen_ai.usage.output_tokens"] == 300 and ingress.status != ERROR
    finally:
        await stop_fleet(fleet)


# --- a queued request ---------------------------------------------------------------


async def test_queued_request_is_placed_and_allocated_within_its_own_route_span(tmp_path: Path, receiver: OtlpReceiver) -> None:
    """One slot: the second request waits in the balancer's queue; its placement and lease happen in the drain task."""

    def one_slot(config):
        return with_overrides(config, **{"balancer.slots": {"max_per_chain": 1}})

    fleet = await start_fleet(tmp_path, workers=1, tune=exporting_to(receiver, then=one_slot), speed=0.1)
    try:
        client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        async with BusWatch(fleet) as watch:
            first = asyncio.create_task(client.completions.create(model=MODEL, prompt="holds the slot", max_tokens=30))
            await wait_for(lambda: [m for m in watch.seen if isinstance(m, GenerateRequest) and not m.request_id.startswith("probe-")],
                           what="the first request")
            header, trace_id, _ = traceparent()
            second = await client.completions.create(model=MODEL, prompt="waits", max_tokens=3,
                                                     extra_headers={"traceparent": header})
            await first
        assert second.usage.completion_tokens == 3
        # Each service exports on its own schedule: wait for the ingress's spans too.
        spans = await wait_for(lambda: {"route", "kv.allocate", "decode", "dispatch.attempt"} <= names(found := receiver.trace(trace_id))
                               and found)
        route = one(spans, "route")
        assert route.attributes["kvlane.route.outcome"] == "queued" and route.attributes["kvlane.route.queue_wait_s"] > 0
        assert one(spans, "kv.allocate").parent_id == route.span_id
        assert one(spans, "dispatch.attempt").attributes["kvlane.outcome"] == "finished"
    finally:
        await stop_fleet(fleet)


# --- (d) a pulled prefix ---------------------------------------------------------------


async def test_a_pulled_prefix_shows_its_source_size_and_costs_on_the_route_span(tmp_path: Path, receiver: OtlpReceiver) -> None:
    fleet = await start_fleet(tmp_path, workers=2, tune=exporting_to(receiver, then=sharing), speed=0.3)
    try:
        source = await cache_on_one_worker(fleet, PREFIX, seed=1)
        runner = next(w for w in ("w0", "w1") if w != source)
        busy = await busy_source(fleet, f"{PREFIX} busy", BUSY_TOKENS, seed=2)
        header, trace_id, _ = traceparent()
        client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        await client.completions.create(model=MODEL, prompt=f"{PREFIX} traced", max_tokens=3, extra_headers={"traceparent": header})
        await busy
        spans = await wait_for(lambda: {"route", "prefill", "kv.transfer"} <= names(found := receiver.trace(trace_id)) and found)
        route = one(spans, "route")
        attributes = route.attributes
        assert (attributes["kvlane.route.choice"], attributes["kvlane.prefix_pull.source.id"]) == ("pull", source)
        assert (attributes["kvlane.prefill_worker.id"], attributes["kvlane.worker.id"]) == (source, runner)
        assert attributes["kvlane.prefix_pull.exposed_tokens"] % 16 == 0 and attributes["kvlane.prefix_pull.pulled_tokens"] > 0
        assert attributes["kvlane.prefix_pull.bytes"] == attributes["kvlane.prefix_pull.pulled_tokens"] * 1024
        assert 0 < attributes["kvlane.prefix_pull.predicted_pull_s"] < attributes["kvlane.prefix_pull.predicted_recompute_s"]
        assert one(spans, "prefill").attributes["kvlane.outcome"] == "handed_off"
        assert one(spans, "kv.transfer").attributes["kvlane.outcome"] == "pulled"
    finally:
        await stop_fleet(fleet)
