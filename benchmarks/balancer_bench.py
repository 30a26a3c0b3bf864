"""Routing decision latency and throughput, for every policy, at 4 to 256 nodes.

Two measurements:

* pure core: `Router.admit` over N nodes (measured speeds, cached
  prefixes in the prefix index), then the slot's release, in one process;
  no I/O. Each policy is measured as the balancer routes (on the chain
  index, where every policy decides for a fleet without decode nodes) and,
  side by side, on a fresh snapshot per decision (the reference the index
  is checked against; `--no-snapshot` skips it).
  `--heartbeat-every N` replaces one node's heartbeat every N decisions.
  What exists once the router is built is frozen out of the garbage
  collector, as a balancer process freezes its startup heap.
* through NATS: a real nats-server, redis-server, balancer and
  cache-manager process (slots in Redis and a KV lease per decision, the
  defaults: the balancer takes the lease with the slot in one Redis script
  and asks the cache-manager only when the ledger has no room on the node;
  `--no-kv` leaves both out), N fake-but-real
  workers heartbeating on NATS (each second, as real nodes do: a full
  heartbeat every `cluster.full_heartbeat_every`th beat, load reports
  between); route requests over request/reply, each
  followed by its RequestFinished. Latency from sequential requests,
  decisions per second from `--concurrency` requests in flight (kept full
  by `benchmarks.route_window`, lean so that on a small machine the
  balancer rather than its client sets the rate; `--client request`: one
  `nc.request` per decision instead), and the balancer process's CPU
  meanwhile: per decision, and beyond what it uses with the fleet
  heartbeating and no requests (what one core of its own would sustain, on
  a machine busy with other work); then every process's CPU per decision
  (client, nats-server, redis-server, balancer, cache-manager, the rest of
  the machine) and its time waiting for a core.

    python -m benchmarks.balancer_bench [--quick] [--skip-nats] [--policies jffc,least_loaded] [--sizes 16,256]

Writes benchmarks/results/balancer_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import nats
import psutil

from benchmarks.route_window import RouteWindow
from contracts import subjects
from contracts.balancer import BalancerStatus, BalancerStatusReply, BalancerStatusRequest
from contracts.messages import EngineStats, Heartbeat, RequestFinished, RouteDecision, RouteReply, RouteRequest, Usage, WorkerRegistration
from launch.launcher import Launcher, free_port
from services.balancer.building import build_router, fallback_step_model
from services.balancer.policies import POLICY_NAMES
from shared.kv.block_hash import chained_block_hashes
from shared.config import BalancerSettings, ClusterSettings, KvlaneConfig, LoggingSettings, NatsSettings, RedisSettings, to_env
from shared.heartbeats import HeartbeatSender
from shared.runner import freeze_startup_heap

SIZES = (4, 16, 64, 256)
MODEL = "bench-model"
BLOCK_SIZE = 16
PREFIXES = 8  # distinct shared system prompts
IDLE_SAMPLE_S = 2.0  # through NATS: how long the balancer's CPU is read with the fleet heartbeating and no requests
CLIENTS = ("window", "request")  # through NATS: the throughput run's load generator (see bench_nats)


def make_heartbeat(index: int, sent_at: float) -> Heartbeat:
    worker_id = f"n{index:03d}"
    registration = WorkerRegistration(
        worker_id=worker_id, role="aggregated", model=MODEL, engine="sim", inbox=subjects.worker_inbox(worker_id),
        block_size=BLOCK_SIZE, max_model_len=8192, tokenizer="sim", started_at=1.0,
    )
    running = index % 7
    stats = EngineStats(
        running=running, waiting=index % 3, kv_blocks_total=8192, kv_blocks_used=100 * running,
        decode_tokens_per_s=(50.0 + 10 * (index % 5)) * running, prefill_tokens_per_s=1000.0,
    )
    return Heartbeat(registration=registration, stats=stats, sent_at=sent_at, seq=int(sent_at), draining=False)


def prompt_tokens(i: int) -> list[int]:
    # A shared system prompt (one of PREFIXES) plus a unique tail: prefix-aware policies have something to find.
    return [1000 + i % PREFIXES] * 256 + [i % 4000 + 1] * 64


def route_request(i: int, timeout_s: float) -> RouteRequest:
    tokens = prompt_tokens(i)
    return RouteRequest(
        request_id=f"b{i}", model=MODEL, prompt_tokens=len(tokens), max_tokens=128, timeout_s=timeout_s,
        block_hashes=chained_block_hashes(tokens, BLOCK_SIZE),
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_core(policy: str, nodes: int, decisions: int, use_index: bool = True, heartbeat_every: int = 0) -> dict:
    """`use_index=False`: every decision on a fresh snapshot. `heartbeat_every`: a new heartbeat from the next node every that many decisions."""
    settings = BalancerSettings(policy=policy, slots=msgspec.structs.replace(BalancerSettings().slots, store="local"))  # type: ignore[arg-type]
    router = build_router(settings, fallback_step_model(settings.speed.fallback_profile), use_index=use_index)
    # As a balancer process does once started: what exists now is left out of every garbage collection,
    # which would otherwise scan this process's whole heap (compiler and all) every few thousand decisions.
    freeze_startup_heap()
    now = time.time()
    heartbeats = [make_heartbeat(i, now) for i in range(nodes)]
    for hb in heartbeats:
        router.builder.observe(hb)
    for i in range(PREFIXES):  # each system prompt cached on a few nodes
        hashes = chained_block_hashes(prompt_tokens(i), BLOCK_SIZE)[:16]
        for node in range(i, nodes, max(1, nodes // 3)):
            router.index.apply(heartbeats[node].registration.worker_id, stored=hashes)
    requests = [route_request(i, 3600.0) for i in range(decisions)]
    latencies, cpu_latencies = [], []
    started, cpu_started = time.perf_counter(), time.thread_time()
    for i, req in enumerate(requests):
        if heartbeat_every and i % heartbeat_every == 0:
            node = (i // heartbeat_every) % nodes
            heartbeats[node] = make_heartbeat(node, now + 1e-3 * (i + 1))
            router.observe(heartbeats[node])
        t0, c0 = time.perf_counter(), time.thread_time()
        router.admit(req, heartbeats, now)
        cpu_latencies.append(time.thread_time() - c0)
        latencies.append(time.perf_counter() - t0)
        router.table.release(req.request_id)
    elapsed, cpu_elapsed = time.perf_counter() - started, time.thread_time() - cpu_started
    summary = _summary(latencies, decisions / elapsed)
    # CPU time is what the core costs whatever else the machine runs; wall time is what a caller waits.
    cpu = _summary(cpu_latencies, decisions / cpu_elapsed)
    summary.update({f"cpu_{key}": value for key, value in cpu.items()})
    return summary


def _core_figures(r: dict) -> str:
    return (f"{r['decisions_per_s']:6d}/s (p50 {r['p50_us']:6.1f} p99 {r['p99_us']:7.1f} us), "
            f"CPU {r['cpu_decisions_per_s']:6d}/s (p50 {r['cpu_p50_us']:6.1f} p99 {r['cpu_p99_us']:7.1f} us)")


def _summary(latencies: list[float], per_second: float) -> dict:
    return {
        "p50_us": round(percentile(latencies, 0.5) * 1e6, 1),
        "p99_us": round(percentile(latencies, 0.99) * 1e6, 1),
        "mean_us": round(statistics.fmean(latencies) * 1e6, 1),
        "decisions_per_s": round(per_second),
    }


class FakeFleet:
    """Nodes that heartbeat on NATS like real workers for as long as the benchmark runs: every node once per
    interval, all of them in one burst, a full heartbeat every `full_every`th beat and load reports between."""

    def __init__(self, nc, interval_s: float, full_every: int) -> None:
        self._nc = nc
        self._interval_s = interval_s
        self._full_every = full_every
        self._senders: list[HeartbeatSender] = []
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    async def grow(self, nodes: int) -> None:
        """Heartbeat `nodes` nodes from now on, their first (full) heartbeats sent at once."""
        self._senders += [HeartbeatSender(self._full_every) for _ in range(nodes - len(self._senders))]
        await self.beat()

    async def beat(self) -> None:
        self._seq += 1
        now = time.time()
        for index, sender in enumerate(self._senders):
            heartbeat = make_heartbeat(index, now)
            _, message = sender.beat(heartbeat.registration, heartbeat.stats, now, self._seq, False)
            await self._nc.publish(subjects.heartbeat(heartbeat.registration.worker_id), self._encoder.encode(message))
        await self._nc.flush()

    async def run(self) -> None:
        next_beat = time.monotonic()
        while True:
            next_beat += self._interval_s
            await asyncio.sleep(max(0.0, next_beat - time.monotonic()))
            await self.beat()


async def _wait_for_nodes(nc, nodes: int) -> None:
    """Until the balancer routes on all `nodes` nodes."""
    decoder = msgspec.msgpack.Decoder(BalancerStatusReply)
    for _ in range(100):
        reply = decoder.decode((await nc.request(subjects.BALANCER_STATUS, msgspec.msgpack.encode(BalancerStatusRequest()), timeout=5)).data)
        if isinstance(reply, BalancerStatus) and len(reply.chains) >= nodes:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the balancer did not learn all {nodes} nodes")


async def bench_nats(policy: str, sizes: tuple[int, ...], sequential: int, concurrent: int, concurrency: int, log_dir: Path,
                     allocate_kv: bool = True, client: str = "window") -> dict:
    """`client`: how the throughput run sends its requests. "window": `RouteWindow`, lean enough that the balancer
    sets the rate; "request": one `nc.request` per decision under a semaphore, as a plain caller would (on a small
    machine its own CPU then caps the rate)."""
    launcher = Launcher(log_dir / policy)
    nats_port, redis_port = free_port(), free_port()
    results: dict[int, dict] = {}
    try:
        processes = {"client": psutil.Process(os.getpid()),
                     "nats-server": psutil.Process(launcher.start_nats(nats_port).pid),
                     "redis-server": psutil.Process(launcher.start_redis(redis_port).pid)}
        config = KvlaneConfig(
            nats=NatsSettings(url=f"nats://127.0.0.1:{nats_port}"),
            redis=RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0"),
            logging=LoggingSettings(level="warning"),
            cluster=ClusterSettings(),  # a node is stale after the default 3 s without a heartbeat, as in production
            balancer=BalancerSettings(policy=policy, allocate_kv=allocate_kv),  # type: ignore[arg-type]
        )
        balancer = launcher.start_service("balancer", to_env(config))
        processes["balancer"] = psutil.Process(balancer.pid)
        nc = await nats.connect(config.nats.url)
        encode = msgspec.msgpack.encode
        decoder = msgspec.msgpack.Decoder(RouteReply)
        await _wait_for(nc, balancer, subjects.BALANCER_STATUS, {"type": "balancer_status_request"})
        if allocate_kv:
            # Up before the heartbeats below, or it would not know the nodes it is asked to allocate on.
            cache_manager = launcher.start_service("cache_manager", to_env(config))
            await _wait_for(nc, cache_manager, subjects.CACHE_REQUEST, {"type": "status"})
            processes["cache-manager"] = psutil.Process(cache_manager.pid)
        fleet = FakeFleet(nc, config.cluster.heartbeat_interval_s, config.cluster.full_heartbeat_every)
        heartbeats = asyncio.ensure_future(fleet.run())
        counter = 0

        async def route_once() -> float:
            nonlocal counter
            counter += 1
            i = counter
            req = route_request(i, 600.0)
            t0 = time.perf_counter()
            reply = decoder.decode((await nc.request(subjects.ROUTE, encode(req), timeout=30)).data)
            took = time.perf_counter() - t0
            if not isinstance(reply, RouteDecision):
                raise RuntimeError(f"{policy}: {reply}")
            finished = RequestFinished(request_id=req.request_id, worker_id=reply.worker_id, finish_reason="stop", usage=Usage(1, 1), duration_s=0.0)
            await nc.publish(subjects.REQUEST_FINISHED, encode(finished))
            return took

        for nodes in sizes:
            await fleet.grow(nodes)
            await _wait_for_nodes(nc, nodes)
            for _ in range(20):  # warm up
                await route_once()
            latencies = [await route_once() for _ in range(sequential)]
            in_flight = asyncio.Semaphore(concurrency)

            async def limited() -> None:
                async with in_flight:
                    await route_once()

            # The balancer's CPU with no requests (the fleet's heartbeats, housekeeping), then under load: what a
            # decision costs it whatever else the machine runs, and the rate one core of its own would sustain.
            balancer_process = processes["balancer"]
            idle_cpu, idle_started = _cpu_seconds(balancer_process), time.perf_counter()
            await asyncio.sleep(IDLE_SAMPLE_S)
            idle_share = (_cpu_seconds(balancer_process) - idle_cpu) / (time.perf_counter() - idle_started)
            if client == "window":
                requests = [route_request(counter + 1 + i, 600.0) for i in range(concurrent)]
                counter += concurrent
                window = RouteWindow(nc, [encode(req) for req in requests], [req.request_id for req in requests], concurrency)
            cpu_before = {name: _cpu_seconds(process) for name, process in processes.items()}
            machine_before = _machine_busy_seconds()
            waited_before = {name: _runqueue_wait_seconds(process) for name, process in processes.items()}
            busy_cpu, started = cpu_before["balancer"], time.perf_counter()
            io_before = balancer_process.io_counters()
            if client == "window":
                await window.run(timeout_s=60 + concurrent / 100)
            else:
                await asyncio.gather(*(limited() for _ in range(concurrent)))
            elapsed = time.perf_counter() - started
            cpu_used = {name: _cpu_seconds(process) - cpu_before[name] for name, process in processes.items()}
            waited = {name: _runqueue_wait_seconds(process) - waited_before[name] for name, process in processes.items()}
            # Everything else the machine ran meanwhile (other work on a shared machine, the kernel's own threads).
            cpu_used["other"] = max(0.0, _machine_busy_seconds() - machine_before - sum(cpu_used.values()))
            busy_cpu = cpu_used["balancer"]
            io_after = balancer_process.io_counters()
            results[nodes] = r = _summary(latencies, concurrent / elapsed)
            r["balancer_idle_cpu_share"] = round(idle_share, 3)
            r["balancer_cpu_us_per_decision"] = round(busy_cpu / concurrent * 1e6, 1)
            r["balancer_marginal_cpu_us_per_decision"] = round(max(0.0, busy_cpu - idle_share * elapsed) / concurrent * 1e6, 1)
            # Below one core: the rate was set by the rest of the machine (the client, nats-server, Redis, the cache-manager).
            r["balancer_busy_cpu_share"] = round(busy_cpu / elapsed, 3)
            # Socket reads and writes (on a loopback socket each write also runs the receiver's side of TCP): how
            # well the replies and the Redis scripts of concurrent decisions share them.
            r["balancer_reads_per_decision"] = round((io_after.read_count - io_before.read_count) / concurrent, 2)
            r["balancer_writes_per_decision"] = round((io_after.write_count - io_before.write_count) / concurrent, 2)
            # Where the machine's CPU went meanwhile (the client: this process, the fleet's heartbeats included).
            r["client"] = client
            r["cpu_us_per_decision"] = {name: round(used / concurrent * 1e6, 1) for name, used in cpu_used.items()}
            r["cpu_busy_share"] = {name: round(used / elapsed, 3) for name, used in cpu_used.items()}
            # Time ready to run but waiting for a core: on a machine with other work, what a handoff costs beyond CPU.
            r["runqueue_wait_us_per_decision"] = {name: round(w / concurrent * 1e6, 1) for name, w in waited.items()}
            print(f"  nats {policy:17s} {nodes:4d} nodes  p50 {r['p50_us']:8.0f} us  p99 {r['p99_us']:8.0f} us  "
                  f"{r['decisions_per_s']:6d}/s  balancer CPU {r['balancer_cpu_us_per_decision']:5.0f} us/decision, "
                  f"{r['balancer_marginal_cpu_us_per_decision']:5.0f} beyond its idle {100 * idle_share:4.1f}% of a core "
                  f"({(1 - idle_share) * 1e6 / max(r['balancer_marginal_cpu_us_per_decision'], 1e-3):6.0f}/s per core; "
                  f"{100 * r['balancer_busy_cpu_share']:3.0f}% of a core busy), "
                  f"{r['balancer_reads_per_decision']:.2f} reads and {r['balancer_writes_per_decision']:.2f} writes per decision",
                  flush=True)
            print(f"    {client} client, CPU per decision: "
                  + ", ".join(f"{name} {us:.0f} us ({100 * r['cpu_busy_share'][name]:.0f}%)" for name, us in r["cpu_us_per_decision"].items())
                  + "; waiting for a core: " + ", ".join(f"{name} {us:.0f} us" for name, us in r["runqueue_wait_us_per_decision"].items()),
                  flush=True)
        heartbeats.cancel()
        await nc.close()
    finally:
        launcher.stop_all()
    return results


def _machine_busy_seconds() -> float:
    """CPU seconds all cores together have spent on anything but idling since boot."""
    times = psutil.cpu_times()._asdict()
    # Linux counts guest time within user time already; steal is time the hypervisor gave to someone else.
    return sum(seconds for field, seconds in times.items() if field not in ("idle", "iowait", "steal", "guest", "guest_nice"))


def _runqueue_wait_seconds(process: psutil.Process) -> float:
    """How long the process's threads have been ready to run but waiting for a core (Linux schedstat; 0 elsewhere)."""
    waited_ns = 0
    for thread in process.threads():
        try:
            waited_ns += int(Path(f"/proc/{process.pid}/task/{thread.id}/schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return waited_ns / 1e9


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def _wait_for(nc, service, subject: str, status_request: dict) -> None:
    for _ in range(200):
        if not service.alive():
            raise RuntimeError(f"{service.name} exited:\n{service.log_tail()}")
        try:
            await nc.request(subject, msgspec.msgpack.encode(status_request), timeout=0.5)
            return
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{service.name} did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--skip-nats", "--pure-only", action="store_true", help="measure the pure core only")
    parser.add_argument("--no-snapshot", action="store_true", help="skip the snapshot-per-decision reference in the pure core")
    parser.add_argument("--heartbeat-every", type=int, default=0, help="pure core: a new heartbeat every N decisions (0: none)")
    parser.add_argument("--no-kv", action="store_true", help="through NATS without the cache-manager's KV allocation")
    parser.add_argument("--decisions", type=int, default=0,
                        help="through NATS: route requests in the throughput run (default 2000, 300 with --quick); more gives a profiler time")
    parser.add_argument("--client", choices=CLIENTS, default=CLIENTS[0],
                        help="through NATS: the throughput run's load generator (window: lean, the default; request: nc.request per decision)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "balancer_bench.json"))
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    sizes = tuple(int(s) for s in args.sizes.split(","))
    core_decisions, sequential, concurrent = (300, 100, 300) if args.quick else (3000, 400, 2000)
    concurrent = args.decisions or concurrent
    report: dict = {"sizes": sizes, "core": {}, "core_snapshot": {}, "nats": {}, "concurrency": args.concurrency,
                    "allocate_kv": not args.no_kv, "heartbeat_every": args.heartbeat_every, "client": args.client}
    print("pure core (admit + release, no I/O): as the balancer routes (on the chain index),"
          " and on a snapshot per decision")
    for policy in policies:
        report["core"][policy] = {}
        report["core_snapshot"][policy] = {}
        for nodes in sizes:
            r = report["core"][policy][nodes] = bench_core(policy, nodes, core_decisions, True, args.heartbeat_every)
            line = f"  core {policy:17s} {nodes:4d} nodes  as routed: {_core_figures(r)}"
            if not args.no_snapshot:
                s = report["core_snapshot"][policy][nodes] = bench_core(policy, nodes, core_decisions, False, args.heartbeat_every)
                line += f"   snapshot: {_core_figures(s)}"
            print(line, flush=True)
    if not args.skip_nats:
        kv = "no KV allocation" if args.no_kv else "a KV allocation from the cache-manager per decision"
        print(f"through NATS (real balancer process, slots in Redis, {kv}, {args.concurrency} in flight for throughput):")
        with tempfile.TemporaryDirectory(prefix="kvlane-bench-") as log_dir:
            for policy in policies:
                report["nats"][policy] = asyncio.run(
                    bench_nats(policy, sizes, sequential, concurrent, args.concurrency, Path(log_dir), not args.no_kv, args.client))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
