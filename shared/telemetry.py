"""OpenTelemetry tracing with W3C trace context carried in NATS headers,
and the OpenTelemetry metrics a service exports over OTLP.

A `Telemetry` object is built once per service and handed to what needs
it; there is no global tracer or meter provider, so tests can run several
services in one process without them sharing exporters.

With `tracing.exporter = "otlp"` spans go to `{endpoint}/v1/traces` and
metrics to `{endpoint}/v1/metrics` (OTLP/HTTP, protobuf); `otlp_endpoint`
may be the base URL or the full traces URL. Without an exporter the tracer
is a no-op and there is no meter (`meter is None`): nothing is recorded.

At shutdown what is pending goes out, but for at most `SHUTDOWN_FLUSH_S`:
the exporters retry an absent collector for about ten seconds, and an idle
service must stop within two.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Meter
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.config import TracingSettings


_SIGNALS = ("/v1/traces", "/v1/metrics")
# A collector that answers takes milliseconds for the last batch; one that does not is given up after this.
SHUTDOWN_FLUSH_S = 0.5


def otlp_endpoints(endpoint: str) -> tuple[str, str]:
    """The OTLP/HTTP traces and metrics URLs for a base URL (or for a URL naming either signal's path)."""
    base = endpoint.rstrip("/")
    for path in _SIGNALS:
        if base.endswith(path):
            base = base[: -len(path)]
            break
    return base + _SIGNALS[0], base + _SIGNALS[1]


def _exporter(settings: TracingSettings) -> SpanExporter | None:
    if settings.exporter == "console":
        return ConsoleSpanExporter()
    if settings.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=otlp_endpoints(settings.otlp_endpoint)[0])
    return None


def _metric_reader(settings: TracingSettings) -> MetricReader | None:
    if settings.exporter != "otlp":
        return None
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    exporter = OTLPMetricExporter(endpoint=otlp_endpoints(settings.otlp_endpoint)[1])
    return PeriodicExportingMetricReader(exporter, export_interval_millis=settings.metrics_interval_s * 1000)


class _CaseInsensitiveGetter(Getter[Mapping[str, str]]):
    """Header lookup whatever the case: HTTP headers are case-insensitive, NATS headers are whatever the sender wrote."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            value = next((v for k, v in carrier.items() if k.lower() == key), None)
        return None if value is None else [value]

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier.keys())


_GETTER = _CaseInsensitiveGetter()


class Telemetry:
    def __init__(
        self,
        settings: TracingSettings,
        service: str,
        exporter: SpanExporter | None = None,
        metric_reader: MetricReader | None = None,
        instance_id: str = "",
    ) -> None:
        """`exporter` and `metric_reader` replace the configured ones (tests pass in-memory ones)."""
        attributes = {"service.name": f"kvlane-{service}", **({"service.instance.id": instance_id} if instance_id else {})}
        resource = Resource.create(attributes)
        # Not shut down again at exit (`shutdown_on_exit`): that would wait out the exporters' retries unbounded.
        self._provider = TracerProvider(resource=resource, sampler=ParentBasedTraceIdRatio(settings.sample_ratio),
                                        shutdown_on_exit=False)
        exporter = exporter or _exporter(settings)
        if exporter is not None:
            self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=settings.batch_delay_s * 1000))
            self.tracer = self._provider.get_tracer("kvlane")
        else:
            # Spans nobody exports cost a few percent of a busy service's CPU. The no-op tracer
            # still passes an incoming `traceparent` on, so a trace begun elsewhere continues.
            self.tracer = trace.NoOpTracerProvider().get_tracer("kvlane")
        self._settings = settings
        self._resource = resource
        self._metric_reader = metric_reader
        self._meter_provider: MeterProvider | None = None
        self._propagator = TraceContextTextMapPropagator()

    @property
    def meter(self) -> Meter | None:
        """The service's meter; None when metrics go nowhere (callers then skip recording altogether).

        Made on first use: a service that records no metrics starts no exporting thread.
        """
        if self._meter_provider is None:
            reader = self._metric_reader or _metric_reader(self._settings)
            if reader is None:
                return None
            self._meter_provider = MeterProvider(metric_readers=[reader], resource=self._resource, shutdown_on_exit=False)
        return self._meter_provider.get_meter("kvlane")

    def inject(self, headers: dict[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
        """Headers carrying the current (or given) span's `traceparent`."""
        headers = {} if headers is None else headers
        self._propagator.inject(headers, context=context)
        return headers

    def extract(self, headers: Mapping[str, str] | None) -> Context:
        """The context of the `traceparent` in `headers` (any letter case); empty without one."""
        return self._propagator.extract(headers or {}, getter=_GETTER)

    @staticmethod
    def trace_id() -> str | None:
        ctx = trace.get_current_span().get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid else None

    def flush(self) -> None:
        self._provider.force_flush()
        if self._meter_provider is not None:
            self._meter_provider.force_flush()

    def shutdown(self, timeout_s: float = SHUTDOWN_FLUSH_S) -> bool:
        """Export what is pending (spans, and the metrics one last time), then stop, within `timeout_s`;
        whether it all went out (False: what was left is dropped with the exporters' daemon threads)."""
        stopping = threading.Thread(target=self._shutdown_providers, name="telemetry-shutdown", daemon=True)
        stopping.start()
        stopping.join(timeout_s)
        return not stopping.is_alive()

    def _shutdown_providers(self) -> None:
        self._provider.shutdown()
        if self._meter_provider is not None:
            self._meter_provider.shutdown()


def error_type(exc: BaseException) -> str:
    """A low-cardinality `error.type` for an exception: its `code` when it has one, else its class name."""
    code = getattr(exc, "code", None)
    return code if isinstance(code, str) and code else type(exc).__qualname__


def set_error(span: trace.Span, kind: str, description: str | None = None) -> None:
    """Mark `span` failed: `error.type` and status ERROR."""
    span.set_attribute("error.type", kind)
    span.set_status(trace.Status(trace.StatusCode.ERROR, description))
