"""OpenTelemetry tracing with W3C trace context carried in NATS headers.

A `Telemetry` object is built once per service and handed to what needs
it; there is no global tracer provider, so tests can run several services
in one process without them sharing exporters.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.config import TracingSettings


def _exporter(settings: TracingSettings) -> SpanExporter | None:
    if settings.exporter == "console":
        return ConsoleSpanExporter()
    if settings.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=settings.otlp_endpoint)
    return None


class Telemetry:
    def __init__(self, settings: TracingSettings, service: str, exporter: SpanExporter | None = None) -> None:
        """`exporter` replaces the configured one (tests pass an in-memory exporter)."""
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": f"kvlane-{service}"}),
            sampler=ParentBasedTraceIdRatio(settings.sample_ratio),
        )
        exporter = exporter or _exporter(settings)
        if exporter is not None:
            self._provider.add_span_processor(BatchSpanProcessor(exporter))
            self.tracer = self._provider.get_tracer("kvlane")
        else:
            # Spans nobody exports cost a few percent of a busy service's CPU. The no-op tracer
            # still passes an incoming `traceparent` on, so a trace begun elsewhere continues.
            self.tracer = trace.NoOpTracerProvider().get_tracer("kvlane")
        self._propagator = TraceContextTextMapPropagator()

    def inject(self, headers: dict[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
        """Headers carrying the current (or given) span's `traceparent`."""
        headers = {} if headers is None else headers
        self._propagator.inject(headers, context=context)
        return headers

    def extract(self, headers: Mapping[str, str] | None) -> Context:
        return self._propagator.extract(headers or {})

    @staticmethod
    def trace_id() -> str | None:
        ctx = trace.get_current_span().get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid else None

    def flush(self) -> None:
        self._provider.force_flush()

    def shutdown(self) -> None:
        self._provider.shutdown()
