"""Tracing without an exporter records nothing, yet carries a trace begun elsewhere."""

from __future__ import annotations

from shared.config import TracingSettings
from shared.telemetry import Telemetry

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_without_an_exporter_an_incoming_traceparent_is_passed_on() -> None:
    telemetry = Telemetry(TracingSettings(exporter="none"), "test")
    with telemetry.tracer.start_as_current_span("handle", context=telemetry.extract({"traceparent": PARENT})) as span:
        assert not span.is_recording()
        assert telemetry.inject() == {"traceparent": PARENT}
    # Nothing begun here: no trace is invented.
    assert telemetry.inject() == {}
