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
and its event loop). With `spreads`, it also keeps each delay's
distribution over the measured requests as a table of quantiles
(`fit_spreads`), from which the simulation draws every request's own:
a loaded host's delays are not one figure but a long tail, and a tail of
the TTFT follows from theirs. Given each request's load when it was sent
(`in_flight_at_send`), it keeps one distribution per band of requests in
flight instead, for a host whose delays grow with the load; with
`per_request`, the measured requests' delays themselves, for each
simulated request to take one measured request's delays together.
"""

from __future__ import annotations

import bisect
import datetime as dt
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from contracts import subjects
from loadtest.simulation.delays import SPREAD_DELAYS, Latencies, Spread, SpreadByLoad

STRETCHES = ("client", "prepare", "message", "decision", "handover", "engine", "stream")
# `tracing.exporter = "console"`: every finished span goes to the service's stdout (its log) as indented JSON.
TRACING_OVERRIDES = {"tracing": {"exporter": "console", "batch_delay_s": 1.0}}
_SPAN_START = '{\n    "name"'
# Quantiles kept per delay: every 2.5% from the minimum to the maximum.
SPREAD_POINTS = 41
# Delays by load: up to this many bands of requests in flight, each of at least this many measured requests.
LOAD_BANDS = 4
MIN_BAND_REQUESTS = 30


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
    stretches: dict[str, list[float]] = {name: [] for name in STRETCHES}
    for _, parts in measured_requests(spans, records):
        for name, value in parts.items():
            stretches[name].append(value)
    return stretches


def in_flight_at_send(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Per request id, how many requests the clients had in flight once they sent it, itself included: the
    load its own delays met (the simulation counts its requests in flight the same way)."""
    spans = [(r["sent_s"], r.get("end_s") if r.get("end_s") is not None else float("inf"), r.get("request_id"))
             for r in records if r.get("sent_s") is not None]
    starts = sorted(start for start, _, _ in spans)
    ends = sorted(end for _, end, _ in spans)
    return {request_id: bisect.bisect_left(starts, start) + 1 - bisect.bisect_right(ends, start)
            for start, _, request_id in spans if request_id}


def measured_requests(spans: Iterable[Mapping[str, Any]],
                      records: Iterable[Mapping[str, Any]]) -> list[tuple[str, dict[str, float]]]:
    """(request id, seconds per stretch) of each request served on its first attempt (`request_stretches`)."""
    by_trace: dict[str, list[Mapping[str, Any]]] = {}
    for span in spans:
        by_trace.setdefault(span["context"]["trace_id"], []).append(span)
    client_ttft = {r["request_id"]: r["first_token_s"] - r["sent_s"] for r in records
                   if r.get("request_id") and r.get("first_token_s") is not None}
    measured = []
    for trace in by_trace.values():
        named: dict[str, list[Mapping[str, Any]]] = {}
        for span in trace:
            named.setdefault(span["name"], []).append(span)
        request = next((s for s in trace if s.get("kind") == "SpanKind.SERVER" and s["service"] == "ingress"), None)
        attempts, routes, decodes = named.get("dispatch.attempt", []), named.get("route", []), named.get("decode", [])
        handled = [s for s in trace if s["name"] == f"handle {subjects.ROUTE}"]
        if request is None or not len(attempts) == len(handled) == len(routes) == len(decodes) == 1:
            continue  # not served, or routed or dispatched more than once: not the common way
        request_id = request["attributes"].get("kvlane.request_id")
        ttft = client_ttft.get(request_id)
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
        measured.append((request_id, parts))
    return measured


def medians(stretches: Mapping[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in stretches.items() if values}


def quantile_table(values: Iterable[float], points: int = SPREAD_POINTS) -> tuple[float, ...]:
    """`points` quantiles of `values` at evenly spaced probabilities from 0 to 1, interpolated linearly."""
    ordered = sorted(values)
    if not ordered or points < 2:
        raise ValueError("a quantile table needs values and at least two points")
    last = len(ordered) - 1
    table = []
    for i in range(points):
        position = i * last / (points - 1)
        low = int(position)
        high = min(low + 1, last)
        table.append(ordered[low] + (ordered[high] - ordered[low]) * (position - low))
    return tuple(table)


def simulated_delays(stretches: Mapping[str, list[float]]) -> dict[str, list[float]]:
    """Each measured request's delays as the simulation charges them (`SPREAD_DELAYS`): the client leg and
    ingress's preparation are its `ingress`, one after the other; the engine is not a delay but simulated."""
    ingress = [client + prepare for client, prepare in zip(stretches["client"], stretches["prepare"])]
    return {"ingress": ingress, "hop": list(stretches["message"]), "decision": list(stretches["decision"]),
            "handover": list(stretches["handover"]), "stream": list(stretches["stream"])}


def load_bands(in_flight: Sequence[int], bands: int = LOAD_BANDS) -> tuple[int, ...]:
    """Upper bounds that split the measured loads into up to `bands` bands of about as many requests each,
    at least `MIN_BAND_REQUESTS` (fewer bands where loads repeat or requests are few; none: one band)."""
    ordered = sorted(in_flight)
    count = min(bands, len(ordered) // MIN_BAND_REQUESTS)
    bounds: list[int] = []
    for i in range(1, count):
        bound = ordered[i * len(ordered) // count - 1]
        if (not bounds or bound > bounds[-1]) and bound < ordered[-1]:
            bounds.append(bound)
    return tuple(bounds)


def fit_spreads(stretches: Mapping[str, list[float]], in_flight: Sequence[int] | None = None,
                points: int = SPREAD_POINTS) -> tuple[tuple[str, Spread | SpreadByLoad], ...]:
    """Each simulated delay's distribution over the measured requests (negative ones, from clocks a
    microsecond apart, as 0); with `in_flight` (each request's load when sent, `in_flight_at_send`), one
    distribution per band of load."""

    def spread(values: Iterable[float]) -> Spread:
        return Spread(quantile_table((max(0.0, v) for v in values), points))

    delays = simulated_delays(stretches)
    bounds = load_bands(in_flight) if in_flight else ()
    if not bounds:
        return tuple((name, spread(delays[name])) for name in SPREAD_DELAYS)
    fitted: list[tuple[str, Spread | SpreadByLoad]] = []
    for name in SPREAD_DELAYS:
        banded: list[list[float]] = [[] for _ in range(len(bounds) + 1)]
        for value, load in zip(delays[name], in_flight or ()):
            banded[bisect.bisect_left(bounds, load)].append(value)
        fitted.append((name, SpreadByLoad(bounds, tuple(spread(values) for values in banded))))
    return tuple(fitted)


def fit_latencies(stretches: Mapping[str, list[float]], live_tpot_s: float, simulated_tpot_s: float,
                  spreads: bool = False, in_flight: Sequence[int] | None = None, per_request: bool = False) -> Latencies:
    """`Latencies` from measured stretches (seconds) and the TPOT p50 of the live run and of its simulation without
    step overhead; with `spreads`, each delay's distribution too (by load, given `in_flight`); with
    `per_request`, each measured request's delays, to be drawn together. Raises ValueError when a stretch has
    no measurement."""
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
        spreads=fit_spreads(stretches, in_flight) if spreads else (),
        per_request=tuple((name, tuple(max(0.0, v) for v in values)) for name, values in simulated_delays(stretches).items())
        if per_request else (),
    )


def latencies_ms(latencies: Latencies) -> dict[str, float]:
    """The constant delays in milliseconds by `kvlane simulate` option name (`ingress`, ..., `step_overhead`)."""
    return {name.removesuffix("_s"): round(1000 * value, 3) for name, value in latencies.constants().items()}


def spreads_ms(latencies: Latencies) -> dict[str, Any]:
    """The delays' quantile tables in milliseconds, as `kvlane simulate --spreads` reads them: a list per
    delay, or {"in_flight_up_to": [bounds], "quantiles": [a list per band]} for one by load."""

    def table(spread: Spread) -> list[float]:
        return [round(1000 * q, 4) for q in spread.quantiles]

    return {name: {"in_flight_up_to": list(spread.up_to), "quantiles": [table(band) for band in spread.bands]}
            if isinstance(spread, SpreadByLoad) else table(spread) for name, spread in latencies.spreads}


def per_request_ms(latencies: Latencies) -> dict[str, list[float]]:
    """Each measured request's delays in milliseconds, one list per delay, as `kvlane simulate --spreads` reads
    them under "per_request_ms"."""
    return {name: [round(1000 * v, 4) for v in values] for name, values in latencies.per_request}


def read_delays(path: Path) -> tuple[tuple[tuple[str, Spread | SpreadByLoad], ...], tuple[tuple[str, tuple[float, ...]], ...]]:
    """`Latencies.spreads` and `Latencies.per_request` from a JSON file: quantile tables in milliseconds
    (`spreads_ms`' shape) as the document or under "spreads_ms" (`loadtest.simulation.fidelity`'s calibration.json),
    and measured requests' delays under "per_request_ms". ValueError when it holds neither or a bad one."""
    document = json.loads(path.read_text())
    if not isinstance(document, dict):
        document = {}
    rows = document.get("per_request_ms") or {}
    try:
        per_request = tuple((name, tuple(float(v) / 1000.0 for v in values)) for name, values in rows.items())
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: {exc!r}") from None
    tables = document.get("spreads_ms", {} if per_request else document)
    if not isinstance(tables, dict) or not (tables or per_request):
        raise ValueError(f"{path}: no quantile tables ({{delay: [milliseconds, ...]}})")
    return _spreads(path, tables), per_request


def read_spreads(path: Path) -> tuple[tuple[str, Spread | SpreadByLoad], ...]:
    """The quantile tables of `read_delays`."""
    return read_delays(path)[0]


def _spreads(path: Path, tables: dict[str, Any]) -> tuple[tuple[str, Spread | SpreadByLoad], ...]:
    """`spreads_ms`' tables as spreads."""

    def spread(values: Iterable[Any]) -> Spread:
        return Spread(tuple(float(v) / 1000.0 for v in values))

    try:
        return tuple((name, SpreadByLoad(tuple(int(b) for b in value["in_flight_up_to"]),
                                         tuple(spread(band) for band in value["quantiles"])))
                     if isinstance(value, dict) else (name, spread(value)) for name, value in tables.items())
    except (TypeError, KeyError) as exc:
        raise ValueError(f"{path}: {exc!r}") from None
