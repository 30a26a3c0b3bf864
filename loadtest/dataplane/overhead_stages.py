"""Where one sequential request's time goes, seen on the wire.

Starts the same fleet as `loadtest.dataplane.overhead` (nats-server, redis-server,
balancer, cache-manager, one sim worker of profile `zero`, one ingress) and
sends N sequential 1-token requests on each path, interleaved: A, a
non-streaming `POST /v1/completions` through the ingress, and B, a
`GenerateRequest` straight to the worker. A separate NATS connection
subscribed to every subject notes when each of a request's messages passed
through nats-server, so a request's time splits into stages without any
instrumentation in the services:

    A: sent -> route request -> route reply -> hand-over -> accept -> frames -> response
    B: sent -> hand-over -> accept -> frames -> response

`route reply -> hand-over` is the ingress between the balancer's answer and
its request to the worker; `frames -> response` the ingress relaying the
frames and writing the HTTP response, plus the client reading it. A third
path, `GET /health` on the ingress, is the floor of one HTTP round trip
through aiohttp on both ends, which path A pays whatever the ingress does. Each
sighting also carries the delay of delivering it to the observer, which
runs on this client's event loop: about alike for every message while the
client waits, so differences between stages are what count, and a stage
under about 0.1 ms is within that noise. A message the observer notes only
after the client had its answer falls outside the request, and the stages
next to it go uncounted for that request (`n`).

    python -m loadtest.dataplane.overhead_stages [--requests N] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
from nats.aio.msg import Msg

from contracts import subjects
from launch.fleet import Fleet, start_fleet
from launch.launcher import Launcher
from loadtest.dataplane.overhead import (
    WORKER_ID,
    DirectPath,
    HttpPath,
    _run_async,
    bench_config,
    wait_until_ok,
)
from loadtest.dataplane.overhead_ingresses import IngressUnderTest, wait_all_serving
from shared.bus import Bus, StreamReceiver
from shared.config import TracingSettings
from shared.telemetry import Telemetry
from shared.tokenizer import SimTokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "overhead_stages.json"
PROMPT = "Say hello to the control plane."

# What each sighting is, in the order a request's messages pass; a reply is known by the reply subject its request named.
_ROUTE, _ROUTE_REPLY, _HANDOVER, _ACCEPT, _FRAMES, _FINISHED = (
    "route request", "route reply", "hand-over", "accept", "frames", "finished event",
)
STAGES_A = ("sent", _ROUTE, _ROUTE_REPLY, _HANDOVER, _ACCEPT, _FRAMES, "response")
STAGES_B = ("sent", _HANDOVER, _ACCEPT, _FRAMES, "response")


class HealthPath:
    """The HTTP floor: `GET /health` on the ingress (keep-alive, the same client session as path A)."""

    name = "http floor"

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self._session = session
        self._url = f"{base_url}/health"

    async def call(self) -> float:
        started = time.perf_counter()
        async with self._session.get(self._url) as response:
            await response.read()
        return time.perf_counter() - started


@dataclass
class Window:
    """One request: when the client sent it and got its answer, and the messages seen in between."""

    path: str
    sent: float
    answered: float = 0.0
    seen: list[tuple[float, str, str]] = field(default_factory=list)


class WireLog:
    """Every message on the bus with the moment it reached this observer (`time.perf_counter`)."""

    def __init__(self) -> None:
        self.sightings: list[tuple[float, str, str]] = []
        self._connection: Any = None

    async def start(self, url: str) -> None:
        self._connection = await nats.connect(url, name="kvlane-overhead-stages")
        await self._connection.subscribe(">", cb=self._seen)
        await self._connection.flush()

    async def _seen(self, msg: Msg) -> None:
        self.sightings.append((time.perf_counter(), msg.subject, msg.reply))

    async def stop(self) -> None:
        if self._connection is not None:
            await self._connection.close()


def classify(subject: str, replies: dict[str, str], worker_inbox: str) -> str | None:
    """The stage a message on `subject` marks (None: not the request's own); `replies`: reply subjects awaited, by stage."""
    if subject == subjects.ROUTE or subject.startswith(f"{subjects.ROUTE}."):  # the queue group, or one replica
        return _ROUTE
    if subject == worker_inbox:
        return _HANDOVER
    if subject in replies:
        return replies[subject]
    if subject.startswith(f"{subjects.PREFIX}.stream."):
        return _FRAMES
    if subject == subjects.REQUEST_FINISHED:
        return _FINISHED
    return None


def stage_times(window: Window, worker_inbox: str) -> dict[str, float]:
    """Moment of each stage's first sighting, relative to `sent`, in ms."""
    marks: dict[str, float] = {"sent": 0.0}
    replies: dict[str, str] = {}
    for at, subject, reply in window.seen:
        stage = classify(subject, replies, worker_inbox)
        if stage is None or stage in marks:
            continue
        if reply and stage in (_ROUTE, _HANDOVER):
            replies[reply] = _ROUTE_REPLY if stage == _ROUTE else _ACCEPT
        marks[stage] = (at - window.sent) * 1000.0
    marks["response"] = (window.answered - window.sent) * 1000.0
    return marks


def breakdown(windows: Sequence[Window], stages: Sequence[str], worker_inbox: str) -> dict[str, Any]:
    """Per consecutive pair of stages, the median and p90 of its duration over the requests that saw both."""
    steps: dict[str, list[float]] = {f"{a} -> {b}": [] for a, b in zip(stages, stages[1:])}
    totals: list[float] = []
    for window in windows:
        marks = stage_times(window, worker_inbox)
        totals.append(marks["response"])
        for a, b in zip(stages, stages[1:]):
            if a in marks and b in marks:
                steps[f"{a} -> {b}"].append(marks[b] - marks[a])
    return {
        "requests": len(windows),
        "total_ms": _quantiles(totals),
        "stages_ms": {name: _quantiles(values) for name, values in steps.items()},
    }


def _quantiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p90": None}
    ordered = sorted(values)
    return {"n": len(values), "p50": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


def assign(windows: list[Window], sightings: list[tuple[float, str, str]]) -> None:
    """Give each request the messages seen between its sending and its answer (requests never overlap)."""
    ordered = sorted(windows, key=lambda w: w.sent)
    index = 0
    for at, subject, reply in sorted(sightings):
        while index < len(ordered) and at > ordered[index].answered:
            index += 1
        if index == len(ordered):
            break
        if at >= ordered[index].sent:
            ordered[index].seen.append((at, subject, reply))


async def measure(fleet: Fleet, requests: int, warmup: int) -> dict[str, Any]:
    config = fleet.config
    model = config.worker.model
    telemetry = Telemetry(TracingSettings(), "loadtest")
    bus = await Bus.connect(config.nats, "kvlane-loadtest", telemetry)
    wire = WireLog()
    try:
        streams = StreamReceiver(bus, f"loadtest-{uuid.uuid4().hex[:8]}")
        await streams.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0)) as session:
            http = HttpPath(session, fleet.base_url, model, PROMPT, 1)
            direct = DirectPath(bus, streams, WORKER_ID, model, SimTokenizer().encode(PROMPT), 1, 10.0)
            await wait_until_ok(http.call, 20.0)
            await wait_until_ok(direct.call, 20.0)
            for _ in range(warmup):
                await http.call()
                await direct.call()
            await wire.start(config.nats.url)
            windows: list[Window] = []
            health = HealthPath(session, fleet.base_url)
            for _ in range(requests):
                for path in (http, direct, health):
                    window = Window(path.name, time.perf_counter())
                    await path.call()
                    window.answered = time.perf_counter()
                    windows.append(window)
                    # Late messages of this request (its finished event) pass before the next one starts.
                    await asyncio.sleep(0.002)
            await asyncio.sleep(0.05)
    finally:
        await wire.stop()
        await bus.close()
        telemetry.shutdown()
    assign(windows, wire.sightings)
    inbox = subjects.worker_inbox(WORKER_ID)
    return {
        "A": breakdown([w for w in windows if w.path == "ingress"], STAGES_A, inbox),
        "B": breakdown([w for w in windows if w.path == "direct"], STAGES_B, inbox),
        "H": breakdown([w for w in windows if w.path == HealthPath.name], ("sent", "response"), inbox),
    }


def run(requests: int, warmup: int, out: Path) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="kvlane-stages-"))
    launcher = Launcher(log_dir)
    fleet: Fleet | None = None
    try:
        fleet = start_fleet(launcher, bench_config(), workers=1, ready_timeout=60.0)
        assert fleet.ingress is not None
        wait_all_serving(IngressUnderTest("ingress", 1, fleet.base_url, fleet.ingress), 60.0)
        results = _run_async(measure(fleet, requests, warmup))
    finally:
        if fleet is not None:
            fleet.stop()
        launcher.stop_all()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return results


def print_report(results: dict[str, Any]) -> None:
    for path, label in (("A", "A: HTTP ingress"), ("B", "B: worker direct (NATS)"), ("H", "HTTP floor: GET /health")):
        report = results[path]
        total = report["total_ms"]
        print(f"{label}: {report['requests']} requests, total p50 {total['p50']:.3f} ms, p90 {total['p90']:.3f} ms")
        for name, q in report["stages_ms"].items():
            cells = "      -" if q["p50"] is None else f"{q['p50']:7.3f} {q['p90']:7.3f}"
            print(f"  {name:<32} {cells}   (n={q['n']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per path")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    print_report(run(args.requests, args.warmup, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
