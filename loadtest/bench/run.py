"""One benchmark run: a fresh fleet for one routing policy, one workload, then everything stopped.

Every run gets its own nats-server and redis-server on free ports, one
balancer with `balancer.policy` set, N sim workers sharing one profile,
speed and seed (aggregated, or prefill and decode pools), and one ingress;
nothing carries over between runs (no warm prefix cache, no learnt node
speeds), so policies and layouts are compared on equal terms. A workload
with LoRA adapters has them published to each fleet's bus before it starts
(`loadtest/bench/adapters.py`), and each fleet's workers fetch them afresh.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import redis.asyncio as redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from contracts.messages import Heartbeat
from launch.fleet import Fleet, start_fleet, with_overrides
from launch.fleet_mix import FleetNode
from launch.launcher import Launcher, free_port
from loadtest.bench.adapters import ensure_tiny_adapters, publish_adapters
from loadtest.bench.client import RequestRecord, StreamingClient
from loadtest.bench.driver import DriveLimits, WorkloadDriver
from loadtest.bench.events import FinishedEvents
from loadtest.bench.lora import adapter_summary
from loadtest.bench.metrics import Slo, WorkerRun, summarize
from loadtest.bench.workloads import WorkloadSpec, adapter_names, sessions
from shared.state import ClusterState
from shared.config import (
    IngressSettings,
    KvlaneConfig,
    LoggingSettings,
    NatsSettings,
    RedisSettings,
    SimSettings,
    WorkerSettings,
)

HOST = "127.0.0.1"
# RequestFinished is published just after the stream's last frame: give stragglers a moment.
_EVENTS_SETTLE_S = 0.5


class PolicyRejected(ValueError):
    """The current configuration schema does not accept this policy name."""


@dataclass(frozen=True)
class FleetSpec:
    workers: int = 4  # aggregated workers: w0, w1...
    profile: str = "h100-80g-llama3-8b"
    speed: float = 1.0
    seed: int = 0
    max_model_len: int = 4096
    num_blocks: int | None = None  # None: the sim default, raised to hold a max-length request
    block_size: int = 16
    ready_timeout_s: float = 90.0
    # Prefill/decode disaggregation: prefill workers p0... and decode workers d0..., besides the aggregated ones.
    prefill_workers: int = 0
    decode_workers: int = 0
    # Further config fields, applied last: {"worker.sim": {"kv_link": "pcie5"}, "balancer.disaggregation": {...}}.
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    # A mixed fleet: these nodes are the aggregated workers, each with its own profile and speed.
    mix: tuple[FleetNode, ...] = ()

    def worker_ids(self) -> list[str]:
        """The ids start_fleet gives the workers."""
        if self.mix:
            return [node.worker_id for node in self.mix]
        return [f"{prefix}{index}" for prefix, count in
                (("w", self.workers), ("p", self.prefill_workers), ("d", self.decode_workers)) for index in range(count)]

    def sim_settings(self) -> dict[str, Any]:
        sim: dict[str, Any] = {"profile": self.profile, "speed": self.speed, "seed": self.seed,
                               "max_model_len": self.max_model_len, "block_size": self.block_size}
        blocks = self.num_blocks
        if blocks is None:
            # A KV cache smaller than one max-length request would refuse the long-context mix.
            blocks = max(SimSettings().num_blocks, -(-2 * self.max_model_len // self.block_size))
        sim["num_blocks"] = blocks
        return sim


@dataclass(frozen=True)
class RunSpec:
    policy: str
    workload: WorkloadSpec
    fleet: FleetSpec
    slo: Slo
    limits: DriveLimits
    request_timeout_s: float
    log_dir: Path
    warmup_s: float = 0.0  # requests the workload schedules before this are served but not measured
    # Where the workload's LoRA adapters are made, once for every run that shares it (None: under `log_dir`).
    adapters_dir: Path | None = None


# `--policies naive:round_robin`: the policy behind a plain load balancer, without kvlane's admission
# (slots and central queue), KV leases or cache-aware dequeue: what a gateway without them does.
NAIVE_PREFIX = "naive:"
NAIVE_OVERRIDES: dict[str, dict[str, Any]] = {
    "balancer": {"allocate_kv": False}, "balancer.slots": {"bounded": False}, "balancer.queue": {"cache_aware_dequeue": False},
}


def policy_sections(label: str) -> dict[str, dict[str, Any]]:
    """Config sections that run the policy a `--policies` label names (`naive:` prefix included)."""
    naive = label.startswith(NAIVE_PREFIX)
    policy = label[len(NAIVE_PREFIX):] if naive else label
    sections: dict[str, dict[str, Any]] = dict(NAIVE_OVERRIDES) if naive else {}
    sections["balancer"] = {**sections.get("balancer", {}), "policy": policy}
    return sections


def fleet_config(fleet: FleetSpec, policy: str, request_timeout_s: float) -> KvlaneConfig:
    """tests/integration/conftest.py's fleet config with default heartbeats, quiet logs and the policy set."""
    base = KvlaneConfig(
        nats=NatsSettings(url=f"nats://{HOST}:{free_port()}"),
        redis=RedisSettings(url=f"redis://{HOST}:{free_port()}/0"),
        # warning: on a small machine every info line per request is CPU taken from the fleet.
        logging=LoggingSettings(format="json", level="warning"),
        ingress=IngressSettings(host=HOST, port=free_port(), request_timeout_s=request_timeout_s),
        worker=WorkerSettings(drain_timeout_s=10.0),
    )
    try:
        config = with_overrides(base, **policy_sections(policy), **{"worker.sim": fleet.sim_settings()})
    except (msgspec.ValidationError, KeyError, TypeError) as exc:
        raise PolicyRejected(f"policy {policy!r} rejected by the current config: {exc}") from exc
    if not fleet.overrides:
        return config
    try:
        return with_overrides(config, **fleet.overrides)
    except (msgspec.ValidationError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"config overrides {fleet.overrides} rejected: {exc}") from exc


class PlannedRun(NamedTuple):
    label: str  # progress line
    header: dict[str, Any]  # what identifies the run in the results
    spec: Any  # RunSpec, or what the `run` given to run_each takes


def run_each(
    planned: Sequence[PlannedRun],
    console: Console,
    quiet: bool,
    after_each: Callable[[list[dict[str, Any]]], None] = lambda done: None,
    derive: Callable[[PlannedRun, dict[str, Any]], dict[str, Any]] = lambda item, run: run,
    run: Callable[[Any, Callable[[RequestRecord], None]], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """`run` (default `run_once`) for each planned run, with a progress bar; `derive` adds figures to a run's result.

    A run that fails is recorded with its error and the sweep goes on:
    one broken policy or layout must not cost the others.
    """
    run = run or run_once
    results: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=quiet, transient=False) as progress:
        for item in planned:
            task = progress.add_task(item.label, total=item.spec.workload.max_requests)
            try:
                outcome = derive(item, run(item.spec, lambda record: progress.advance(task)))
                results.append(item.header | outcome)
                progress.update(task, total=outcome["summary"]["requests"], completed=outcome["summary"]["requests"])
            except Exception as exc:  # noqa: BLE001 - see the docstring
                failure = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                if hasattr(item.spec, "log_dir"):
                    failure["log_dir"] = str(item.spec.log_dir)
                results.append(item.header | failure)
                progress.update(task, description=f"{item.label} [red]failed[/]")
            after_each(results)
    return results


def after_warmup(records: list[RequestRecord], warmup_s: float) -> list[RequestRecord]:
    """The records a run measures: those the workload scheduled once the warm-up was over."""
    return [r for r in records if r.scheduled_s >= warmup_s]


def run_once(spec: RunSpec, on_record: Callable[[RequestRecord], None]) -> dict[str, Any]:
    """Start the fleet, send the workload, stop the fleet; the run's metrics and records."""
    config = fleet_config(spec.fleet, spec.policy, spec.request_timeout_s)
    if spec.workload.tenants:
        config = with_overrides(config, ingress={"tenant_weights": spec.workload.tenant_weights()})
    adapters: dict[str, Path] = {}
    if spec.workload.adapters:
        adapters = ensure_tiny_adapters(spec.adapters_dir or spec.log_dir / "adapters", adapter_names(spec.workload.adapters))
        # Each run's workers fetch the adapters themselves: nothing carries over between runs.
        config = with_overrides(config, **{"worker.lora": {"cache_dir": str(spec.log_dir / "adapter-cache")}})
    launcher = Launcher(spec.log_dir)
    fleet: Fleet | None = None
    started = time.monotonic()
    try:
        fleet = start_fleet(launcher, config, spec.fleet.workers, ready_timeout=spec.fleet.ready_timeout_s,
                            prefill_workers=spec.fleet.prefill_workers, decode_workers=spec.fleet.decode_workers,
                            mix=spec.fleet.mix)
        startup_s = time.monotonic() - started
        measured = _run_async(_measure(fleet, spec, on_record, adapters))
        dead = [f"{p.name} (exit {p.popen.returncode})" for p in fleet.services() if not p.alive()]
    finally:
        if fleet is not None:
            fleet.stop()
        launcher.stop_all()
    worker_ids = spec.fleet.worker_ids()
    counted = after_warmup(measured.records, spec.warmup_s)
    result = {
        "policy": spec.policy,
        "fleet_startup_s": startup_s,
        "processes_died": dead,
        "summary": summarize(counted, spec.slo, measured.runs, worker_ids, spec.workload.tenant_weights()),
        "warmup_requests": len(measured.records) - len(counted),
        # KV pulls the nodes made during the workload: requests prefilled on a prefill node, prefixes pulled from a busy node.
        "kv_pulls": measured.whole_run.kv_pulls,
        "records": [r.to_json() for r in counted],
        "log_dir": str(spec.log_dir),
    }
    if spec.workload.adapters:
        result["adapters"] = adapter_summary(measured.after_warmup.adapter_loads, len(counted),
                                             measured.whole_run.adapter_loads, len(measured.records))
    return result


class WorkerCounters(NamedTuple):
    """Counts the workers' heartbeats carry (each since its worker started), summed over the fleet."""

    kv_pulls: int = 0
    adapter_loads: int = 0

    def since(self, earlier: WorkerCounters) -> WorkerCounters:
        return WorkerCounters(*(now - then for now, then in zip(self, earlier, strict=True)))


def counters_of(heartbeats: Iterable[Heartbeat]) -> WorkerCounters:
    stats = [heartbeat.stats for heartbeat in heartbeats]
    return WorkerCounters(kv_pulls=sum(s.kv_pulls for s in stats), adapter_loads=sum(s.adapter_loads for s in stats))


class Measured(NamedTuple):
    records: list[RequestRecord]
    runs: dict[str, WorkerRun]  # by request id: the worker that ran it
    whole_run: WorkerCounters  # what the workers did while the workload ran, warm-up included
    after_warmup: WorkerCounters  # the same from the warm-up's end on (as of the first heartbeats after it)


async def _measure(fleet: Fleet, spec: RunSpec, on_record: Callable[[RequestRecord], None],
                   adapters: Mapping[str, Path]) -> Measured:
    model = fleet.config.worker.model
    async with FinishedEvents(fleet.config.nats.url) as events:
        async with StreamingClient(fleet.base_url, model, spec.request_timeout_s, time.perf_counter()) as setup:
            await _wait_until_served(setup, timeout_s=30.0)
            if adapters:
                await publish_adapters(fleet.config.nats, model, adapters)
                await _wait_until_listed(setup, set(adapters), timeout_s=30.0)
        # Nothing has run since the warm-up request, and the workers have sent heartbeats since: these hold the start.
        before = await _worker_counters(fleet)
        # A fresh clock: the run starts at 0 after warm-up, whatever it took.
        async with StreamingClient(fleet.base_url, model, spec.request_timeout_s, time.perf_counter()) as client:
            warmup_end = asyncio.ensure_future(_counters_at(fleet, client, spec.warmup_s)) if spec.warmup_s else None
            try:
                records = await WorkloadDriver(client, spec.limits, on_record).run(sessions(spec.workload))
                measured_from = await warmup_end if warmup_end is not None else before
            finally:
                if warmup_end is not None:
                    warmup_end.cancel()
        await asyncio.sleep(_EVENTS_SETTLE_S)
        runs = dict(events.runs)
        # Heartbeats sent after the last request ended count everything it did.
        after = await _worker_counters(fleet, sent_after=time.time())
    return Measured(records, runs, after.since(before), after.since(measured_from))


async def _counters_at(fleet: Fleet, client: StreamingClient, at_s: float) -> WorkerCounters:
    """The workers' counters at second `at_s` of the run (from the first heartbeats after it)."""
    await asyncio.sleep(max(0.0, at_s - client.now()))
    return await _worker_counters(fleet, sent_after=time.time())


async def _worker_counters(fleet: Fleet, sent_after: float | None = None) -> WorkerCounters:
    """The live workers' counters; with `sent_after` (epoch seconds), from heartbeats every worker sent after it.

    A worker that sends none by the time its key would expire has left: the counters are then those of the rest.
    """
    cluster = fleet.config.cluster
    deadline = time.monotonic() + cluster.heartbeat_ttl_s + cluster.heartbeat_interval_s
    client = redis.Redis.from_url(fleet.config.redis.url)
    try:
        state = ClusterState(client, cluster.heartbeat_ttl_s)
        while True:
            live = [item.heartbeat for item in await state.live_heartbeats()]
            if sent_after is None or all(h.sent_at > sent_after for h in live) or time.monotonic() >= deadline:
                return counters_of(live)
            await asyncio.sleep(cluster.heartbeat_interval_s / 10)
    finally:
        await client.aclose()


async def _wait_until_listed(client: StreamingClient, names: set[str], timeout_s: float) -> None:
    """The ingress reads the bus's adapter listing again at most once a second: wait until it lists them all."""
    deadline = time.monotonic() + timeout_s
    while not names <= await client.served_models():
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the ingress did not list the {len(names)} adapters published within {timeout_s:.0f}s")
        await asyncio.sleep(0.2)


async def _wait_until_served(client: StreamingClient, timeout_s: float) -> None:
    """/ready can answer a moment before the balancer has heard every worker."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        record = RequestRecord("warmup", "warmup", 0, "completions", 1, 0.0)
        await client.send(record, {"prompt": " warm up"})
        if record.ok:
            # One heartbeat interval more, so that the balancer knows every worker, not just one.
            await asyncio.sleep(1.5)
            return
        last = record.error or ""
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the fleet served no request within {timeout_s:.0f}s: {last}")


def _run_async(coro: Awaitable[Any]) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a kvlane dependency
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)
