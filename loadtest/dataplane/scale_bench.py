"""What the control plane costs as the fleet grows: 16, 64, 256 simulated nodes on one bus.

Each size gets its own nats-server and redis-server, one balancer, one
cache-manager, one health-prober, one ingress and ONE sim worker process
hosting all the nodes (`worker.nodes`), every process with the default
cluster settings (1 s heartbeats, 50 ms KV-event batches, a probe of each
node every 2 s). Once the fleet is ready it drives a modest open-loop load
(`--rate` completions per second, prompts sharing a few system prompts so
prefix caches fill and KV events flow) and, beside it, route probes: a
`RouteRequest` straight to the balancers, withdrawn as soon as it is
answered (the full routing path: balancer, slot store, cache-manager
allocation). Over `--duration` seconds it measures:

* heartbeat and KV-event messages and bytes per second on the bus
  (this client subscribes to the subjects and counts);
* CPU per process, as a percentage of one core (/proc);
* route decisions: the probes' round trip p50/p99, and the balancer's own
  time per placement (its `kvlane_balancer_decision_seconds` histogram);
* resident memory (RSS) of the balancer, the cache-manager and the worker;
* the completions' latency and errors.

`--compare-full` runs each size a second time with every heartbeat full
(`cluster.full_heartbeat_every = 1`, as before heartbeats left out the
registration), to show what that saves. Results are printed as a table and
written as JSON (and a PNG with `--plot`).

    python -m loadtest.dataplane.scale_bench [--nodes 16,64,256] [--duration 40] [--rate 20] [--compare-full] [--out PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import random
import shutil
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats
import psutil
from rich.console import Console
from rich.table import Table

from contracts import subjects
from contracts.messages import ErrorReply, Heartbeat, HeartbeatMessage, RouteDecision, RouteReply, RouteRequest, RouteWithdrawn
from launch.fleet import Fleet, start_fleet
from launch.launcher import Launcher, free_port
from loadtest.bench.machine import CpuMeter, machine_info
from loadtest.bench.metrics import latency_summary
from shared.bus import Bus, BusError
from shared.config import (
    BalancerSettings,
    CacheManagerSettings,
    ClusterSettings,
    IngressSettings,
    KvlaneConfig,
    LoggingSettings,
    NatsSettings,
    RedisSettings,
    TracingSettings,
    WorkerSettings,
)
from shared.logging import configure_logging
from shared.telemetry import Telemetry

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "scale_bench.json"
MODEL = "kvlane-sim"
HOST = "127.0.0.1"
# Route probes per second: enough for a p99 within a run, few enough not to be the load.
PROBES_PER_S = 20.0


@dataclass
class ScaleOptions:
    sizes: list[int] = field(default_factory=lambda: [16, 64, 256])
    duration_s: float = 40.0
    warmup_s: float = 5.0
    rate: float = 20.0  # completions per second, open loop
    max_tokens: int = 16
    prefix_groups: int = 16
    full_heartbeat_every: int = ClusterSettings().full_heartbeat_every
    compare_full: bool = False
    ready_timeout_s: float = 240.0
    out: Path = DEFAULT_OUT
    plot: Path | None = None
    log_dir: Path | None = None

    def check(self) -> None:
        if not self.sizes or any(n < 1 or n > 1024 for n in self.sizes):
            raise ValueError("sizes must be 1..1024 nodes")
        if not 0 < self.duration_s <= 600 or self.warmup_s < 0:
            raise ValueError("duration must be in (0, 600] seconds, warmup at least 0")
        if not 0 < self.rate <= 500 or self.max_tokens < 1 or self.prefix_groups < 1 or self.full_heartbeat_every < 1:
            raise ValueError("rate must be in (0, 500], max_tokens, prefix_groups and full_heartbeat_every at least 1")


def scale_config(nats_port: int, redis_port: int, nodes: int, full_heartbeat_every: int, balancer_metrics_port: int) -> KvlaneConfig:
    return KvlaneConfig(
        nats=NatsSettings(url=f"nats://{HOST}:{nats_port}"),
        redis=RedisSettings(url=f"redis://{HOST}:{redis_port}/0"),
        logging=LoggingSettings(format="json", level="warning"),
        cluster=ClusterSettings(full_heartbeat_every=full_heartbeat_every),
        ingress=IngressSettings(port=free_port()),
        balancer=BalancerSettings(metrics_port=balancer_metrics_port),
        cache_manager=CacheManagerSettings(),
        worker=WorkerSettings(nodes=nodes),
    )


# --- what the bus carries ---------------------------------------------------------------


class BusCounter:
    """Messages and bytes on the heartbeat and KV-event subjects, from a subscription of its own."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._decoder = msgspec.msgpack.Decoder(HeartbeatMessage)
        self._nc: nats.NATS | None = None

    async def start(self, url: str) -> None:
        self._nc = await nats.connect(url, name="scale-bench-counter")

        async def on_heartbeat(msg) -> None:
            kind = "heartbeat_full" if isinstance(self._decoder.decode(msg.data), Heartbeat) else "heartbeat_load"
            self.counts[f"{kind}_msgs"] += 1
            self.counts[f"{kind}_bytes"] += len(msg.data)

        async def on_kv(msg) -> None:
            self.counts["kv_events_msgs"] += 1
            self.counts["kv_events_bytes"] += len(msg.data)

        await self._nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_heartbeat)
        await self._nc.subscribe(subjects.KV_EVENTS_ALL, cb=on_kv)
        await self._nc.flush()

    def snapshot(self) -> Counter[str]:
        return Counter(self.counts)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()


def bus_rates(before: Counter[str], after: Counter[str], elapsed_s: float) -> dict[str, float]:
    delta = {key: after[key] - before[key] for key in after}
    rates = {f"{key}_per_s": value / elapsed_s for key, value in sorted(delta.items())}
    for unit in ("msgs", "bytes"):
        rates[f"heartbeat_{unit}_per_s"] = (delta.get(f"heartbeat_full_{unit}", 0) + delta.get(f"heartbeat_load_{unit}", 0)) / elapsed_s
    rates.setdefault("kv_events_msgs_per_s", 0.0)
    rates.setdefault("kv_events_bytes_per_s", 0.0)
    return rates


# --- the balancer's own decision time ---------------------------------------------------------


def decision_histogram(metrics_port: int) -> dict[float, float]:
    """Cumulative bucket counts of `kvlane_balancer_decision_seconds` (upper bound -> count)."""
    with urllib.request.urlopen(f"http://{HOST}:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("kvlane_balancer_decision_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if bound == "+Inf" else float(bound)] = float(line.rsplit(" ", 1)[1])
    return buckets


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """Prometheus-style: linear within the bucket that holds the q-quantile of the observations in between."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-12)
        lower_bound, lower_count = bound, count
    return None


# --- load ----------------------------------------------------------------------------------------


def prompts(groups: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["fleet", "kernel", "cache", "token", "prefix", "node", "route", "batch", "queue", "slot"]
    return [f"System {g}: " + " ".join(rng.choice(words) for _ in range(120)) for g in range(groups)]


async def drive_load(base_url: str, options: ScaleOptions, stop_at: float) -> dict[str, Any]:
    """Open loop: completions at `options.rate` per second (Poisson arrivals) until `stop_at`."""
    systems = prompts(options.prefix_groups)
    rng = random.Random(1)
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    tasks: set[asyncio.Task] = set()

    async def one(session: aiohttp.ClientSession, prompt: str) -> None:
        started = time.perf_counter()
        try:
            async with session.post(f"{base_url}/v1/completions",
                                    json={"model": MODEL, "prompt": prompt, "max_tokens": options.max_tokens}) as response:
                await response.read()
                if response.status != 200:
                    errors[f"HTTP {response.status}"] += 1
                    return
            latencies.append(time.perf_counter() - started)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            errors[type(exc).__name__] += 1

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=256)) as session:
        while time.monotonic() < stop_at:
            prompt = f"{rng.choice(systems)} question {uuid.uuid4().hex[:8]}"
            task = asyncio.create_task(one(session, prompt))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(options.rate))
        if tasks:
            await asyncio.wait(tasks, timeout=35)
    return {"completions": latency_summary(latencies), "errors": sum(errors.values()), "error_kinds": dict(errors)}


async def route_probes(bus: Bus, stop_at: float) -> dict[str, Any]:
    """A route request every 1/PROBES_PER_S s, withdrawn once answered: the round trip of one routing decision."""
    latencies: list[float] = []
    outcomes: Counter[str] = Counter()
    for index in itertools.count():
        if time.monotonic() >= stop_at:
            break
        request_id = f"probe-{uuid.uuid4().hex[:12]}-{index}"
        request = RouteRequest(request_id=request_id, model=MODEL, prompt_tokens=64, max_tokens=16, timeout_s=5.0)
        started = time.perf_counter()
        try:
            reply = await bus.request(subjects.ROUTE, request, RouteReply, 5.0)
        except BusError as exc:
            outcomes[type(exc).__name__] += 1
        else:
            elapsed = time.perf_counter() - started
            if isinstance(reply, RouteDecision):
                latencies.append(elapsed)
                outcomes["routed"] += 1
            elif isinstance(reply, ErrorReply):
                outcomes[reply.code] += 1
        await bus.publish(subjects.ROUTE_WITHDRAWN, RouteWithdrawn(request_id=request_id))
        await asyncio.sleep(1.0 / PROBES_PER_S)
    return {"round_trip": latency_summary(latencies), "outcomes": dict(outcomes)}


# --- one size --------------------------------------------------------------------------------------


def _rss_mib(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


async def measure(fleet: Fleet, options: ScaleOptions, meter: CpuMeter, balancer_metrics_port: int) -> dict[str, Any]:
    counter = BusCounter()
    await counter.start(fleet.config.nats.url)
    telemetry = Telemetry(TracingSettings(), "scale-bench")
    bus = await Bus.connect(fleet.config.nats, "scale-bench", telemetry)
    try:
        await asyncio.sleep(options.warmup_s)
        bus_before, cpu_before = counter.snapshot(), meter.sample()
        decisions_before = await asyncio.to_thread(decision_histogram, balancer_metrics_port)
        started = time.monotonic()
        stop_at = started + options.duration_s
        load, probes = await asyncio.gather(drive_load(fleet.base_url, options, stop_at), route_probes(bus, stop_at))
        elapsed = time.monotonic() - started
        bus_after, cpu_after = counter.snapshot(), meter.sample()
        decisions_after = await asyncio.to_thread(decision_histogram, balancer_metrics_port)
    finally:
        await bus.close()
        await counter.close()
    cpu = CpuMeter.percent(cpu_before, cpu_after, elapsed)
    core = {f"p{q}_ms": _ms(histogram_quantile(decisions_before, decisions_after, q / 100)) for q in (50, 99)}
    core["count"] = int(decisions_after.get(float("inf"), 0) - decisions_before.get(float("inf"), 0))
    rss = {p.name: _rss_mib(p.pid) for p in fleet.services() if p.name.startswith(("balancer", "cache-manager", "worker"))}
    return {
        "elapsed_s": elapsed,
        "bus": bus_rates(bus_before, bus_after, elapsed),
        "cpu_percent": cpu,
        "route_probe": probes,
        "balancer_core_decision": core,
        "rss_mib": rss,
        "load": load,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def run_size(nodes: int, full_every: int, options: ScaleOptions, log_dir: Path, console: Console) -> dict[str, Any]:
    launcher = Launcher(log_dir / f"n{nodes}-full{full_every}")
    nats_port, redis_port, metrics_port = free_port(), free_port(), free_port()
    try:
        launcher.start_nats(nats_port)
        launcher.start_redis(redis_port)
        config = scale_config(nats_port, redis_port, nodes, full_every, metrics_port)
        started = time.monotonic()
        fleet = start_fleet(launcher, config, workers=1, ready_timeout=options.ready_timeout_s)
        ready_s = time.monotonic() - started
        console.print(f"{nodes} nodes (full heartbeat every {full_every}): ready in {ready_s:.1f}s, measuring {options.duration_s:.0f}s")
        meter = CpuMeter(launcher.processes)
        result = asyncio.run(measure(fleet, options, meter, metrics_port))
        return {"nodes": nodes, "full_heartbeat_every": full_every, "ready_s": ready_s, **result}
    finally:
        launcher.stop_all()


# --- report -----------------------------------------------------------------------------------------

SERVICES = ("balancer", "cache-manager-0", "health-prober", "ingress", "worker-w0", "nats-server", "redis-server")


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_tables(runs: list[dict[str, Any]], console: Console) -> None:
    bus = Table(title="Bus traffic and route decisions")
    for column in ("nodes", "full every", "heartbeats/s", "heartbeat kB/s", "KV events/s", "KV kB/s",
                   "route p50 ms", "route p99 ms", "core p50 ms", "core p99 ms", "completions p50 ms", "errors"):
        bus.add_column(column, justify="right")
    for run in runs:
        b, probe, core, load = run["bus"], run["route_probe"]["round_trip"], run["balancer_core_decision"], run["load"]
        bus.add_row(str(run["nodes"]), str(run["full_heartbeat_every"]), _fmt(b["heartbeat_msgs_per_s"]),
                    _fmt(b["heartbeat_bytes_per_s"] / 1000), _fmt(b["kv_events_msgs_per_s"]), _fmt(b["kv_events_bytes_per_s"] / 1000),
                    _fmt(probe["p50_ms"], 2), _fmt(probe["p99_ms"], 2), _fmt(core["p50_ms"], 3), _fmt(core["p99_ms"], 3),
                    _fmt(load["completions"]["p50_ms"]), str(load["errors"] + sum(v for k, v in run["route_probe"]["outcomes"].items()
                                                                             if k != "routed")))
    console.print(bus)
    cpu = Table(title="CPU (% of one core) and memory (RSS MiB)")
    for column in ("nodes", "full every", *SERVICES, "machine busy", "balancer MiB", "cache-manager MiB", "worker MiB"):
        cpu.add_column(column, justify="right")
    for run in runs:
        pct, rss = run["cpu_percent"], run["rss_mib"]
        cpu.add_row(str(run["nodes"]), str(run["full_heartbeat_every"]), *(_fmt(pct.get(name)) for name in SERVICES),
                    _fmt(pct.get("machine-busy")), _fmt(rss.get("balancer")), _fmt(rss.get("cache-manager-0")), _fmt(rss.get("worker-w0")))
    console.print(cpu)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    default = [r for r in runs if r["full_heartbeat_every"] != 1]
    full = [r for r in runs if r["full_heartbeat_every"] == 1]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in SERVICES:
        left.plot([r["nodes"] for r in default], [r["cpu_percent"].get(name) or 0 for r in default], marker="o", label=name)
    left.set(xscale="log", xlabel="simulated nodes", ylabel="CPU, % of one core", title="CPU per process")
    left.minorticks_off()
    left.set_xticks([r["nodes"] for r in default], [str(r["nodes"]) for r in default])
    left.legend(fontsize=7)
    for label, series in (("load reports between full heartbeats", default), ("every heartbeat full", full)):
        if series:
            right.plot([r["nodes"] for r in series], [r["bus"]["heartbeat_bytes_per_s"] / 1000 for r in series], marker="o", label=label)
    right.set(xscale="log", xlabel="simulated nodes", ylabel="kB/s", title="Heartbeat bytes on the bus")
    right.minorticks_off()
    right.set_xticks([r["nodes"] for r in default], [str(r["nodes"]) for r in default])
    right.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def run(options: ScaleOptions, console: Console) -> dict[str, Any]:
    options.check()
    log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="kvlane-scale-"))
    info = machine_info()
    runs = []
    modes = [options.full_heartbeat_every, *([1] if options.compare_full and options.full_heartbeat_every != 1 else [])]
    for nodes in options.sizes:
        for full_every in modes:
            runs.append(run_size(nodes, full_every, options, log_dir, console))
    print_tables(runs, console)
    result = {
        "benchmark": "scale_bench",
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m loadtest.dataplane.scale_bench", *sys.argv[1:]]),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        "machine": info,
        "runs": runs,
    }
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(result, indent=2, default=str))
    console.print(f"wrote {options.out}")
    if options.plot is not None:
        plot(runs, options.plot)
        console.print(f"wrote {options.plot}")
    if options.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    return result


def parse_args(argv: list[str] | None = None) -> ScaleOptions:
    parser = argparse.ArgumentParser(prog="python -m loadtest.dataplane.scale_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="16,64,256", help="fleet sizes, comma-separated (default 16,64,256)")
    parser.add_argument("--duration", type=float, default=40.0, help="measured seconds per size (default 40)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds after ready before measuring (default 5)")
    parser.add_argument("--rate", type=float, default=20.0, help="completions per second (default 20)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--full-heartbeat-every", type=int, default=ClusterSettings().full_heartbeat_every,
                        help="cluster.full_heartbeat_every of the fleet (default: the configuration's default)")
    parser.add_argument("--compare-full", action="store_true", help="run each size again with every heartbeat full")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=Path, help="write the growth curves as a PNG here")
    parser.add_argument("--log-dir", type=Path, help="keep the services' logs here (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(part) for part in args.nodes.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--nodes: {args.nodes!r} is not a comma-separated list of numbers")
    return ScaleOptions(sizes=sizes, duration_s=args.duration, warmup_s=args.warmup, rate=args.rate, max_tokens=args.max_tokens,
                        full_heartbeat_every=args.full_heartbeat_every, compare_full=args.compare_full, out=args.out,
                        plot=args.plot, log_dir=args.log_dir)


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    configure_logging(LoggingSettings(format="console", level="error"), "scale-bench")
    console = Console(width=200)
    try:
        run(options, console)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        raise SystemExit(2) from exc


if __name__ == "__main__":
    main()
