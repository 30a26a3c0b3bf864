"""Telemetry: tracing without an exporter records nothing yet carries a trace begun elsewhere;
OTLP endpoints, the GenAI server metrics and their flush at shutdown."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics.export import (
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)

from kvlane.cli import build_parser, up_config
from shared import genai
from shared.config import TracingSettings, to_env
from shared.telemetry import Telemetry, otlp_endpoints

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_without_an_exporter_an_incoming_traceparent_is_passed_on() -> None:
    telemetry = Telemetry(TracingSettings(exporter="none"), "test")
    with telemetry.tracer.start_as_current_span("handle", context=telemetry.extract({"traceparent": PARENT})) as span:
        assert not span.is_recording()
        assert telemetry.inject() == {"traceparent": PARENT}
    # Nothing begun here: no trace is invented.
    assert telemetry.inject() == {}


# --- endpoints, propagation, providers ----------------------------------------------

@pytest.mark.parametrize("endpoint", [
    "http://collector:4318", "http://collector:4318/", "http://collector:4318/v1/traces", "http://collector:4318/v1/metrics",
])
def test_otlp_endpoints_from_a_base_url_or_either_signals_url(endpoint: str) -> None:
    assert otlp_endpoints(endpoint) == ("http://collector:4318/v1/traces", "http://collector:4318/v1/metrics")


def test_a_path_before_the_signal_is_kept() -> None:
    assert otlp_endpoints("https://gw.example/otlp/v1/traces") == ("https://gw.example/otlp/v1/traces", "https://gw.example/otlp/v1/metrics")


@pytest.mark.parametrize("name", ["traceparent", "Traceparent", "TRACEPARENT"])
def test_an_incoming_traceparent_is_read_whatever_its_letter_case(name: str) -> None:
    telemetry = Telemetry(TracingSettings(), "test")
    with telemetry.tracer.start_as_current_span("handle", context=telemetry.extract({name: PARENT})):
        assert telemetry.inject() == {"traceparent": PARENT}


def test_metrics_go_nowhere_without_the_otlp_exporter() -> None:
    assert Telemetry(TracingSettings(exporter="none"), "test").meter is None
    assert Telemetry(TracingSettings(exporter="console"), "test").meter is None


class RecordingExporter(MetricExporter):
    def __init__(self) -> None:
        super().__init__(preferred_temporality={}, preferred_aggregation={})
        self.exported: list[object] = []

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        self.exported.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


def test_shutdown_exports_the_metrics_one_last_time() -> None:
    exporter = RecordingExporter()
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)  # never on its own here
    telemetry = Telemetry(TracingSettings(exporter="otlp"), "test", metric_reader=reader)
    assert telemetry.meter is not None
    genai.GenAiServerMetrics(telemetry.meter).record("chat", "m", 1.0, 0.2, 5)
    assert not exporter.exported
    telemetry.shutdown()
    names = {m.name for data in exporter.exported for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert names == {genai.TIME_TO_FIRST_TOKEN, genai.TIME_PER_OUTPUT_TOKEN, genai.REQUEST_DURATION}


def test_kvlane_up_otlp_endpoint_reaches_every_service_through_the_environment() -> None:
    config = up_config(build_parser().parse_args(["up", "--otlp-endpoint", "http://localhost:4318"]))
    env = to_env(config)
    assert env["KVLANE__TRACING__EXPORTER"] == '"otlp"'
    assert env["KVLANE__TRACING__OTLP_ENDPOINT"] == '"http://localhost:4318"'
    assert up_config(build_parser().parse_args(["up"])).tracing.exporter == "none"


# --- the GenAI server metrics ---------------------------------------------------------


def test_time_per_output_token_is_the_decode_time_per_token_after_the_first() -> None:
    assert genai.time_per_output_token(1.0, 0.2, 5) == pytest.approx(0.2)
    assert genai.time_per_output_token(1.0, 0.2, 1) is None
    assert genai.time_per_output_token(1.0, 0.2, 0) is None


def histograms(reader: InMemoryMetricReader) -> dict[str, list]:
    data = reader.get_metrics_data()
    return {m.name: m.data.data_points for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def test_genai_server_metrics_record_successes_and_failures_with_the_convention_attributes() -> None:
    reader = InMemoryMetricReader()
    telemetry = Telemetry(TracingSettings(exporter="otlp"), "test", metric_reader=reader)
    metrics = genai.GenAiServerMetrics(telemetry.meter)
    metrics.record("chat", "m", duration_s=1.0, ttft_s=0.2, output_tokens=5)
    metrics.record("text_completion", "m", duration_s=0.5, ttft_s=0.5, output_tokens=1)  # one token: no TPOT
    metrics.record("chat", None, duration_s=0.01, error="invalid_json")
    found = histograms(reader)
    attrs = {genai.OPERATION_NAME: "chat", genai.PROVIDER_NAME: "kvlane", genai.REQUEST_MODEL: "m", genai.RESPONSE_MODEL: "m"}
    (tpot,) = found[genai.TIME_PER_OUTPUT_TOKEN]
    assert dict(tpot.attributes) == attrs and tpot.count == 1 and tpot.sum == pytest.approx(0.2)
    assert sorted(p.count for p in found[genai.TIME_TO_FIRST_TOKEN]) == [1, 1]
    assert tuple(found[genai.TIME_TO_FIRST_TOKEN][0].explicit_bounds) == genai.TTFT_BUCKETS
    failed = [p for p in found[genai.REQUEST_DURATION] if genai.ERROR_TYPE in p.attributes]
    assert [(p.count, dict(p.attributes)) for p in failed] == [
        (1, {genai.OPERATION_NAME: "chat", genai.PROVIDER_NAME: "kvlane", genai.ERROR_TYPE: "invalid_json"})
    ]
    assert sum(p.count for p in found[genai.REQUEST_DURATION] if genai.ERROR_TYPE not in p.attributes) == 2
