"""The simulation's latencies measured on a live fleet: where a request's time to first token goes.

A live `kvlane bench` run with the services' spans exported to their logs
(`tracing.exporter = "console"`) shows each request's way in stretches,
all on the host's one wall clock:

    client     the load generator's send to ingress's request span, plus the
               first token's way from ingress's span event back to the client
    prepare    ingress's request span to its first `dispatch.attempt`
    message    the attempt to the balancer's handling of the route request (one NATS message)
    decision   that handling to the end of the balancer's `route` span (its policy, slot and lease)
    handover   the `route` span's end to the worker's `decode` span
    engine     the `decode` span to its first output (the engine: simulated, not measured)
    stream     the worker's first output to ingress's first-token event

`fit_latencies` turns the medians of all but `engine` into `Latencies`, and
the live engine's step overhead into `step_overhead_s`: the live TPOT
beyond the simulated one on the same workload (a sim engine's step is the
same scheduler step live and simulated; live it also waits for its timer
and its event loop).
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from contracts import subjects
from loadtest.simulation.world import Latencies

STRETCHES = ("client", "prepare", "message", "decision", "handover", "engine", "stream")
# `tracing.exporter = "console"`: every finished span goes to the service's stdout (its log) as indented JSON.
TRACING_OVERRIDES = {"tracing": {"exporter": "console", "batch_delay_s": 1.0}}
_SPAN_START = '{\n    "name"'


def read_spans(log_dir: Path) -> list[dict[str, Any]]:
    """Every span the services in `log_dir` (`*.log`) exported to the console, with `service` set to the log's name."""
    decoder = json.JSONDecoder()
    spans = []
    for log in sorted(log_dir.glob("*.log")):
        text = log.read_text(errors="replace")
        position = text.find(_SPAN_START)
        while position >= 0:
            try:
                span, end = decoder.raw_decode(text, position)
            except json.JSONDecodeError:  # cut off at the end of the log, or interleaved with another line
                end = position + 1
            else:
                if isinstance(span, dict) and "context" in span:
                    spans.append(span | {"service": log.stem})
            position = text.find(_SPAN_START, end)
    return spans


def _seconds(timestamp: str) -> float:
    return dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _first_event(span: Mapping[str, Any], word: str) -> float | None:
    return next((_seconds(e["timestamp"]) for e in span.get("events", ()) if word in e["name"]), None)


def request_stretches(spans: Iterable[Mapping[str, Any]], records: Iterable[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Seconds per stretch (`STRETCHES`), one value per request that was served on its first attempt.

    `records`: the bench's request records (`RequestRecord.to_json()`); their
    `request_id` joins them to ingress's span, `sent_s` and `first_token_s`
    give the client's own TTFT.
    """
    by_trace: dict[str, list[Mapping[str, Any]]] = {}
    for span in spans:
        by_trace.setdefault(span["context"]["trace_id"], []).append(span)
    client_ttft = {r["request_id"]: r["first_token_s"] - r["sent_s"] for r in records
                   if r.get("request_id") and r.get("first_token_s") is not None}
    stretches: dict[str, list[float]] = {name: [] for name in STRETCHES}
    for trace in by_trace.values():
        named: dict[str, list[Mapping[str, Any]]] = {}
        for span in trace:
            named.setdefault(span["name"], []).append(span)
        request = next((s for s in trace if s.get("kind") == "SpanKind.SERVER" and s["service"] == "ingress"), None)
        attempts, routes, decodes = named.get("dispatch.attempt", []), named.get("route", []), named.get("decode", [])
        handled = [s for s in trace if s["name"] == f"handle {subjects.ROUTE}"]
        if request is None or not len(attempts) == len(handled) == len(routes) == len(decodes) == 1:
            continue  # not served, or routed or dispatched more than once: not the common way
        ttft = client_ttft.get(request["attributes"].get("kvlane.request_id"))
        first_token = _first_event(request, "first_token")
        first_output = _first_event(decodes[0], "first")
        if ttft is None or first_token is None or first_output is None:
            continue
        received = _seconds(request["start_time"])
        attempt = _seconds(attempts[0]["start_time"])
        handling = _seconds(handled[0]["start_time"])
        routed = _seconds(routes[0]["end_time"])
        decoding = _seconds(decodes[0]["start_time"])
        parts = {
            "client": ttft - (first_token - received),
            "prepare": attempt - received,
            "message": handling - attempt,
            "decision": routed - handling,
            "handover": decoding - routed,
            "engine": first_output - decoding,
            "stream": first_token - first_output,
        }
        for name, value in parts.items():
            stretches[name].append(value)
    return stretches


def medians(stretches: Mapping[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in stretches.items() if values}


def fit_latencies(stretches: Mapping[str, list[float]], live_tpot_s: float, simulated_tpot_s: float) -> Latencies:
    """`Latencies` from measured stretches (seconds) and the TPOT p50 of the live run and of its simulation without
    step overhead. Raises ValueError when a stretch has no measurement."""
    missing = [name for name in STRETCHES if not stretches.get(name)]
    if missing:
        raise ValueError(f"no request showed these stretches in its spans: {', '.join(missing)}")
    m = medians(stretches)
    return Latencies(
        ingress_s=max(0.0, m["client"] + m["prepare"]),
        hop_s=max(0.0, m["message"]),
        decision_s=max(0.0, m["decision"]),
        handover_s=max(0.0, m["handover"]),
        stream_s=max(0.0, m["stream"]),
        step_overhead_s=max(0.0, live_tpot_s - simulated_tpot_s),
    )


def latencies_ms(latencies: Latencies) -> dict[str, float]:
    return {name.removesuffix("_s"): round(1000 * value, 3) for name, value in vars(latencies).items()}
