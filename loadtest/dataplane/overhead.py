"""What the control plane costs: HTTP ingress + balancer versus the bare worker.

One run starts its own nats-server, redis-server and a fleet of one
balancer, one sim worker (profile `zero`: no simulated GPU time, so every
microsecond measured is control plane) and one ingress, all on free ports
of 127.0.0.1, then measures:

1. latency: N sequential 1-token requests on each of two paths, interleaved
   A, B, A, B... so that machine noise hits both alike:
   A. `POST /v1/completions` (non-streaming, keep-alive) through
      ingress -> balancer -> worker, timed to the full response;
   B. a `GenerateRequest` straight to the worker's NATS inbox, timed to the
      `StreamEnd` frame;
   and the overhead A - B (at p50 and p99) and the ratio A / B;
2. throughput: a closed loop of C concurrent clients for S seconds, again
   on both paths, with the CPU each process used meanwhile (which shows the
   bottleneck: the ingress, the worker, or this client itself).

With `--ingress-processes 1,2` the fleet gets one more ingress, of two
processes sharing its port (`ingress.processes`), on the same balancer and
worker: path A runs through each ingress in turn (`ingress`, then
`ingress-2p`), so the counts compare within one run.

With `--http-floor` path A also runs through `loadtest.dataplane.http_floor`, an aiohttp
server that answers from memory: what HTTP alone costs, and the most any
ingress on aiohttp could serve here. With `--path-floor` it also runs through
`loadtest.dataplane.path_floor`: the ingress path's processes, hops and messages (HTTP,
the route request, a Redis script, the hand-over, the worker's frames) with
none of kvlane's work in them, which splits what the ingress path costs above
the direct one into the architecture's share and kvlane's own; and through
the same floor routed in its front, with no balancer process (`path-floor-1`).

Results are printed as tables and written as JSON. Everything the run
started is stopped however it ends.

    python -m loadtest.dataplane.overhead [--requests N] [--concurrency C] [--duration S] [--ingress-processes 1,2] [--http-floor]
                                [--path-floor] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from contracts import subjects
from contracts.messages import (
    ErrorReply,
    GenerateRequest,
    SamplingParams,
    StreamEnd,
    TokenChunk,
    WorkerReply,
)
from launch.fleet import Fleet, start_fleet, with_overrides
from launch.launcher import Launcher, free_port
from loadtest.bench.machine import CpuMeter, machine_info
from loadtest.bench.metrics import latency_summary, percentile
from loadtest.dataplane.overhead_ingresses import (
    HOST, IngressUnderTest, start_http_floor, start_ingress, start_path_floor, wait_all_serving, with_ingress_totals,
)
from loadtest.dataplane.overhead_report import http_paths, print_report
from shared.bus import Bus, BusError, StreamReceiver
from shared.config import KvlaneConfig, LoggingSettings, TracingSettings
from shared.logging import configure_logging
from shared.telemetry import Telemetry
from shared.tokenizer import SimTokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "overhead.json"
WORKER_ID = "w0"  # start_fleet names its workers w0, w1, ...

Call = Callable[[], Awaitable[float]]


@dataclass
class BenchOptions:
    requests: int = 500  # sequential requests per path
    concurrency: int = 32  # closed-loop clients
    duration_s: float = 10.0  # closed-loop length per path
    out: Path = DEFAULT_OUT
    warmup: int = 50  # sequential requests per path before measuring
    prompt: str = "Say hello to the control plane."
    max_tokens: int = 1
    request_timeout_s: float = 10.0  # one request, either path
    max_requests: int = 200_000  # cap on each closed loop's request count
    ready_timeout_s: float = 60.0
    log_dir: Path | None = None  # default: a temporary directory, removed after a clean run
    quiet: bool = False
    # One ingress per count, each of that many processes on its own port (the first is the fleet's).
    ingress_processes: tuple[int, ...] = (1,)
    # One more ingress, of one process, that sends each worker its request itself rather than letting
    # the balancer send it on (`ingress.balancer_hands_over = false`): the hand-over's worth, side by side.
    ingress_sends: bool = False
    # One more path A, through loadtest/dataplane/http_floor.py: HTTP alone, answered from memory (what bounds any ingress).
    http_floor: bool = False
    # One more path A, through loadtest/dataplane/path_floor.py: the ingress path's hops and messages with no kvlane work in them.
    path_floor: bool = False

    def check(self) -> None:
        if self.requests < 1 or self.concurrency < 1 or self.warmup < 0 or self.max_tokens < 1:
            raise ValueError("requests, concurrency and max_tokens must be at least 1, warmup at least 0")
        if not self.ingress_processes or min(self.ingress_processes) < 1 or len(set(self.ingress_processes)) != len(self.ingress_processes):
            raise ValueError("ingress processes: distinct counts of at least 1, such as 1,2")
        if not 0 < self.duration_s <= 600:
            raise ValueError("duration must be in (0, 600] seconds")
        if self.requests > 100_000:
            raise ValueError("at most 100000 sequential requests per path")


class RequestFailed(Exception):
    """A request that got an answer other than a complete, successful one."""


class BenchError(RuntimeError):
    pass


# --- statistics -------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _diff(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


# --- the two paths -------------------------------------------------------------------


class HttpPath:
    """Path A: non-streaming `POST /v1/completions` to the ingress (keep-alive)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, prompt: str, max_tokens: int,
                 name: str = "ingress") -> None:
        self.name = name
        self._session = session
        self._url = f"{base_url}/v1/completions"
        self._body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens}).encode()
        self._headers = {"Content-Type": "application/json"}
        self._max_tokens = max_tokens

    async def call(self) -> float:
        started = time.perf_counter()
        async with self._session.post(self._url, data=self._body, headers=self._headers) as response:
            payload = await response.read()
        elapsed = time.perf_counter() - started
        if response.status != 200:
            raise RequestFailed(f"HTTP {response.status}: {payload[:200].decode(errors='replace')}")
        try:
            usage = json.loads(payload)["usage"]
        except (ValueError, KeyError) as exc:
            raise RequestFailed(f"malformed completion: {payload[:200]!r}") from exc
        if usage.get("completion_tokens") != self._max_tokens:
            raise RequestFailed(f"expected {self._max_tokens} completion tokens, got {usage.get('completion_tokens')}")
        return elapsed


class DirectPath:
    """Path B: a `GenerateRequest` to the worker's inbox, done at its `StreamEnd`."""

    name = "direct"

    def __init__(self, bus: Bus, streams: StreamReceiver, worker_id: str, model: str, prompt_token_ids: list[int],
                 max_tokens: int, timeout_s: float) -> None:
        self._bus = bus
        self._streams = streams
        self._inbox = subjects.worker_inbox(worker_id)
        self._model = model
        self._prompt_token_ids = prompt_token_ids
        # Exactly what ingress builds for this request body (prompts.prepare).
        self._sampling = SamplingParams(max_tokens=max_tokens)
        self._max_tokens = max_tokens
        self._timeout_s = timeout_s
        self._prefix = f"lt{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count()

    async def call(self) -> float:
        request_id = f"{self._prefix}{next(self._ids)}"
        started = time.perf_counter()
        async with asyncio.timeout(self._timeout_s):
            with self._streams.open(request_id) as stream:
                generate = GenerateRequest(
                    request_id=request_id,
                    model=self._model,
                    prompt_token_ids=self._prompt_token_ids,
                    sampling=self._sampling,
                    stream_to=stream.subject,
                    timeout_s=self._timeout_s,
                )
                reply = await self._bus.request(self._inbox, generate, WorkerReply, self._timeout_s)
                if isinstance(reply, ErrorReply):
                    raise RequestFailed(f"worker refused: {reply.code}: {reply.message}")
                tokens = 0
                while True:
                    frame = await stream.next(self._timeout_s)
                    match frame:
                        case TokenChunk():
                            tokens += len(frame.token_ids)
                        case StreamEnd():
                            break
                        case ErrorReply():
                            raise RequestFailed(f"stream failed: {frame.code}: {frame.message}")
        elapsed = time.perf_counter() - started
        if tokens != self._max_tokens or frame.usage.completion_tokens != self._max_tokens:
            raise RequestFailed(f"expected {self._max_tokens} tokens, got {tokens} (usage {frame.usage.completion_tokens})")
        return elapsed


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:200]


_EXPECTED_ERRORS = (RequestFailed, aiohttp.ClientError, BusError, TimeoutError, OSError)


# --- phases ----------------------------------------------------------------------------


async def wait_until_ok(call: Call, timeout_s: float) -> None:
    """The fleet can report ready a moment before the balancer sees the worker."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            await call()
            return
        except _EXPECTED_ERRORS as exc:
            last = _describe(exc)
            await asyncio.sleep(0.1)
    raise BenchError(f"no successful request within {timeout_s:.0f}s: {last}")


async def sequential(paths: Sequence[Any], count: int) -> dict[str, dict[str, Any]]:
    """`count` requests per path, one at a time, the paths taking turns."""
    latencies: dict[str, list[float | None]] = {p.name: [] for p in paths}
    errors: dict[str, Counter[str]] = {p.name: Counter() for p in paths}
    for _ in range(count):
        for path in paths:
            try:
                latencies[path.name].append(await path.call())
            except _EXPECTED_ERRORS as exc:
                latencies[path.name].append(None)
                errors[path.name][_describe(exc)] += 1
    return {
        p.name: {"latencies": latencies[p.name], "errors": sum(errors[p.name].values()), "error_kinds": dict(errors[p.name])}
        for p in paths
    }


async def closed_loop(call: Call, concurrency: int, duration_s: float, max_requests: int, timeout_s: float,
                      meter: CpuMeter) -> dict[str, Any]:
    """`concurrency` clients, each sending its next request when the last one ends, for `duration_s`."""
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    issued = 0
    started = time.perf_counter()
    stop_at = started + duration_s

    async def client() -> None:
        nonlocal issued
        while time.perf_counter() < stop_at and issued < max_requests:
            issued += 1
            try:
                latencies.append(await call())
            except _EXPECTED_ERRORS as exc:
                errors[_describe(exc)] += 1
                await asyncio.sleep(0.01)  # a failing fleet must not turn this into a busy loop

    cpu_before = meter.sample()
    try:
        # Clients stop starting requests at `stop_at`; in-flight ones are bounded by their own timeout.
        async with asyncio.timeout(duration_s + timeout_s + 5.0):
            await asyncio.gather(*(client() for _ in range(concurrency)))
    except TimeoutError as exc:
        raise BenchError("closed loop did not finish in time") from exc
    elapsed = time.perf_counter() - started
    cpu = CpuMeter.percent(cpu_before, meter.sample(), elapsed)
    stats = latency_summary(latencies)
    return {
        "concurrency": concurrency,
        "duration_s": duration_s,
        "elapsed_s": elapsed,
        "requests": issued,
        "succeeded": len(latencies),
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "requests_per_s": len(latencies) / elapsed if elapsed > 0 else 0.0,
        "p50_ms": stats["p50_ms"],
        "p90_ms": stats["p90_ms"],
        "p99_ms": stats["p99_ms"],
        "mean_ms": stats["mean_ms"],
        "cpu_percent": cpu,
        # Less sensitive to what else runs on the machine than requests/s: what one request costs each process.
        "cpu_ms_per_request": {
            name: None if pct is None or not latencies else pct / 100.0 * elapsed * 1000.0 / len(latencies)
            for name, pct in cpu.items()
            if not name.startswith(("machine-", "other-"))
        },
    }


async def measure(fleet: Fleet, options: BenchOptions, console: Console,
                  ingresses: Sequence[IngressUnderTest] = ()) -> dict[str, Any]:
    config = fleet.config
    ingresses = list(ingresses) or [IngressUnderTest("ingress", 1, fleet.base_url, fleet.ingress)]
    model = config.worker.model
    prompt_token_ids = SimTokenizer().encode(options.prompt)
    telemetry = Telemetry(TracingSettings(), "loadtest")
    async with asyncio.timeout(15):
        bus = await Bus.connect(config.nats, "kvlane-loadtest", telemetry)
    try:
        streams = StreamReceiver(bus, f"loadtest-{uuid.uuid4().hex[:8]}")
        await streams.start()
        connector = aiohttp.TCPConnector(limit=options.concurrency, ttl_dns_cache=None)
        timeout = aiohttp.ClientTimeout(total=options.request_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            https = [HttpPath(session, ingress.base_url, model, options.prompt, options.max_tokens, ingress.name)
                     for ingress in ingresses]
            direct = DirectPath(bus, streams, WORKER_ID, model, prompt_token_ids, options.max_tokens, options.request_timeout_s)
            for http in https:
                await wait_until_ok(http.call, 20.0)
            await wait_until_ok(direct.call, 20.0)
            if options.warmup:
                await sequential([*https, direct], options.warmup)
            measured = [p for p in [*fleet.servers, *fleet.services()] if p is not fleet.ingress]
            meter = CpuMeter([*measured, *(p for ingress in ingresses for p in ingress.measured())])

            _status(console, options, f"latency: {options.requests} sequential requests per path, interleaved")
            runs = await sequential([*https, direct], options.requests)
            latency = _latency_report(runs, [http.name for http in https])

            throughput = {}
            for path in (*https, direct):
                # Opens the pool's connections (and warms the worker) before the clock starts.
                await asyncio.gather(*(path.call() for _ in range(options.concurrency)), return_exceptions=True)
                _status(console, options, f"throughput via {path.name}: {options.concurrency} clients for {options.duration_s:g}s")
                throughput[path.name] = await closed_loop(
                    path.call, options.concurrency, options.duration_s, options.max_requests, options.request_timeout_s, meter
                )
                with_ingress_totals(throughput[path.name], ingresses)
            for http in https:
                throughput[f"{http.name}_vs_direct"] = _ratio(throughput[http.name]["requests_per_s"],
                                                              throughput["direct"]["requests_per_s"])
        return {"prompt_tokens": len(prompt_token_ids), "latency": latency, "throughput": throughput}
    finally:
        await bus.close()
        telemetry.shutdown()


def _latency_report(runs: dict[str, dict[str, Any]], http_names: Sequence[str] = ("ingress",)) -> dict[str, Any]:
    """Each path's latencies, and A - B for each ingress path A: `overhead` for the first, `<name>_overhead` for others."""
    report: dict[str, Any] = {}
    for name, run in runs.items():
        report[name] = {**latency_summary([x for x in run["latencies"] if x is not None]), "errors": run["errors"],
                        "error_kinds": run["error_kinds"]}
    for index, name in enumerate(http_names):
        report["overhead" if index == 0 else f"{name}_overhead"] = _overhead(report[name], report["direct"],
                                                                             runs[name]["latencies"], runs["direct"]["latencies"])
    return report


def _overhead(a: dict[str, Any], b: dict[str, Any], a_raw: Sequence[float | None], b_raw: Sequence[float | None]) -> dict[str, Any]:
    # Pairs measured back to back: the median difference is less noisy than a difference of medians.
    paired = sorted((x - y) * 1000.0 for x, y in zip(a_raw, b_raw) if x is not None and y is not None)
    return {
        "p50_ms": _diff(a["p50_ms"], b["p50_ms"]),
        "p90_ms": _diff(a["p90_ms"], b["p90_ms"]),
        "p99_ms": _diff(a["p99_ms"], b["p99_ms"]),
        "mean_ms": _diff(a["mean_ms"], b["mean_ms"]),
        "paired_median_ms": percentile(paired, 50) if paired else None,
        "ratio_p50": _ratio(a["p50_ms"], b["p50_ms"]),
        "ratio_p99": _ratio(a["p99_ms"], b["p99_ms"]),
        "ratio_mean": _ratio(a["mean_ms"], b["mean_ms"]),
    }


def _status(console: Console, options: BenchOptions, text: str) -> None:
    if not options.quiet:
        console.print(f"[dim]{text}[/]")


# --- the run ---------------------------------------------------------------------------------


def bench_config() -> KvlaneConfig:
    """Defaults with free local ports, quiet logs and a worker that takes no simulated time."""
    return with_overrides(
        KvlaneConfig(),
        nats={"url": f"nats://{HOST}:{free_port()}"},
        redis={"url": f"redis://{HOST}:{free_port()}/0"},
        ingress={"host": HOST, "port": free_port()},
        logging={"level": "warning"},
        tracing={"exporter": "none"},
        **{"worker.sim": {"profile": "zero"}},
    )


def _run_async(coro: Awaitable[Any]) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a kvlane dependency
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def run_benchmark(options: BenchOptions, console: Console | None = None) -> dict[str, Any]:
    """Start a fleet, measure, stop everything; returns the results (also written to `options.out`)."""
    options.check()
    console = console or Console()
    config = with_overrides(bench_config(), ingress={"processes": options.ingress_processes[0]})
    own_log_dir = options.log_dir is None
    log_dir = Path(tempfile.mkdtemp(prefix="kvlane-overhead-")) if own_log_dir else Path(options.log_dir)
    launcher = Launcher(log_dir)
    fleet: Fleet | None = None
    clean = False
    started_at = dt.datetime.now(dt.timezone.utc)
    machine = machine_info()
    try:
        _status(console, options, f"starting nats, redis, balancer, worker {WORKER_ID} (sim, profile zero), ingress; logs in {log_dir}")
        fleet = start_fleet(launcher, config, workers=1, ready_timeout=options.ready_timeout_s)
        assert fleet.ingress is not None
        ingresses = [IngressUnderTest("ingress", options.ingress_processes[0], fleet.base_url, fleet.ingress)]
        wait_all_serving(ingresses[0], options.ready_timeout_s)
        for processes in options.ingress_processes[1:]:
            _status(console, options, f"starting an ingress of {processes} processes on the same fleet")
            ingresses.append(start_ingress(launcher, fleet, processes, options.ready_timeout_s))
        if options.ingress_sends:
            _status(console, options, "starting an ingress that sends each worker its request itself")
            ingresses.append(start_ingress(launcher, fleet, 1, options.ready_timeout_s, sends=True))
        if options.http_floor:
            _status(console, options, "starting the HTTP floor (loadtest.dataplane.http_floor)")
            ingresses.append(start_http_floor(launcher, options.ready_timeout_s))
        if options.path_floor:
            _status(console, options, "starting the path floor (loadtest.dataplane.path_floor)")
            ingresses.append(start_path_floor(launcher, fleet, WORKER_ID, options.ready_timeout_s))
            ingresses.append(start_path_floor(launcher, fleet, WORKER_ID, options.ready_timeout_s, relayed=False))
        measured = _run_async(measure(fleet, options, console, ingresses))
        dead = [p.name for p in [*fleet.services(), *(p for ingress in ingresses for p in (ingress.process, *ingress.helpers))]
                if not p.alive()]
        if dead:
            raise BenchError(f"{', '.join(dead)} exited during the run; logs in {log_dir}")
        clean = True
    except BaseException:
        if fleet is not None:
            for process in fleet.services():
                tail = process.log_tail(15)
                if tail and not options.quiet:
                    console.print(f"[red]--- {process.name} log tail ---[/]\n{tail}")
        console.print(f"[red]benchmark failed; logs kept in {log_dir}[/]")
        raise
    finally:
        if fleet is not None:
            fleet.stop()
        launcher.stop_all()
        if clean and own_log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)

    results = {
        "benchmark": "kvlane-overhead",
        "timestamp": started_at.isoformat(),
        "machine": machine,
        "parameters": {
            "requests": options.requests,
            "warmup": options.warmup,
            "concurrency": options.concurrency,
            "duration_s": options.duration_s,
            "prompt": options.prompt,
            "prompt_tokens": measured["prompt_tokens"],
            "max_tokens": options.max_tokens,
            "request_timeout_s": options.request_timeout_s,
            "model": config.worker.model,
            "worker_engine": config.worker.engine,
            "worker_profile": config.worker.sim.profile,
            "workers": 1,
            "balancers": 1,
            "ingresses": len(ingresses),
            "ingress_processes": list(options.ingress_processes),
            "ingress_paths": [{"path": i.name, "processes": i.processes, "balancer_hands_over": not i.sends, "floor": i.floor}
                              for i in ingresses],
            "client_event_loop": "uvloop",
            "interleaving": "A,B,A,B (A=ingress, B=direct)" if len(ingresses) == 1 else
                            f"A1..A{len(ingresses)},B,A1... (A=each ingress, B=direct)",
        },
        "latency": measured["latency"],
        "throughput": measured["throughput"],
    }
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    if not options.quiet:
        print_report(results, console)
        console.print(f"results written to [bold]{out}[/]")
    return results


# --- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.dataplane.overhead", description=__doc__.split("\n\n")[0])
    defaults = BenchOptions()
    parser.add_argument("--requests", type=int, default=defaults.requests, help="sequential requests per path (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="closed-loop clients (default %(default)s)")
    parser.add_argument("--duration", type=float, default=defaults.duration_s, help="closed-loop seconds per path (default %(default)s)")
    parser.add_argument("--out", type=Path, default=defaults.out, help="JSON results file (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="warm-up requests per path (default %(default)s)")
    parser.add_argument("--log-dir", type=Path, help="keep the fleet's logs here (default: a temporary directory, removed after a clean run)")
    parser.add_argument("--ingress-sends", action="store_true",
                        help="also measure an ingress that sends each worker its request itself, rather than the balancer")
    parser.add_argument("--http-floor", action="store_true",
                        help="also measure an aiohttp server that answers from memory: the most requests/s any ingress on aiohttp "
                             "could serve here")
    parser.add_argument("--path-floor", action="store_true",
                        help="also measure the ingress path's hops and messages (HTTP, route request, Redis script, hand-over, "
                             "frames) with no kvlane work in them")
    parser.add_argument("--ingress-processes", type=_counts, default=defaults.ingress_processes, metavar="N[,M...]",
                        help="one ingress of each count of processes sharing its port, measured in turn, e.g. 1,2 "
                             "(default: 1; more than 1 needs Linux)")
    return parser


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_benchmark's finally, which stops the fleet


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    # This process's own Bus logs through structlog; keep routine lines (a clean
    # disconnect logs a warning) out of the report.
    configure_logging(LoggingSettings(format="console", level="error"), "loadtest")
    options = BenchOptions(requests=args.requests, concurrency=args.concurrency, duration_s=args.duration,
                           out=args.out, warmup=args.warmup, log_dir=args.log_dir, ingress_processes=args.ingress_processes,
                           ingress_sends=args.ingress_sends, http_floor=args.http_floor,
                           path_floor=args.path_floor)
    console = Console()
    try:
        options.check()
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    try:
        results = run_benchmark(options, console)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - report, exit non-zero
        console.print(f"[red]{_describe(exc)}[/]")
        return 1
    failed = results["latency"]["ingress"]["errors"] + results["latency"]["direct"]["errors"]
    failed += sum(results["latency"][path]["errors"] + results["throughput"][path]["errors"] for path in http_paths(results)[1:])
    failed += results["throughput"]["ingress"]["errors"] + results["throughput"]["direct"]["errors"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
