"""Routing decision latency and throughput, for every policy, at 4 to 256 nodes.

Two measurements:

* pure core: `Router.admit` over N nodes (measured speeds, cached
  prefixes in the prefix index), then the slot's release, in one process;
  no I/O. Each policy is measured as the balancer routes (on the chain
  index, for the policies that support it) and, side by side, on a fresh
  snapshot per decision (the reference the index is checked against;
  `--no-snapshot` skips it).
  `--heartbeat-every N` replaces one node's heartbeat every N decisions.
* through NATS: a real nats-server, redis-server, balancer and
  cache-manager process (slots in Redis and a KV allocation per decision,
  the defaults; `--no-kv` leaves the cache-manager out), N fake-but-real
  workers heartbeating on NATS; route requests over request/reply, each
  followed by its RequestFinished. Latency from sequential requests,
  decisions per second from `--concurrency` requests in flight.

    python -m benchmarks.balancer_bench [--quick] [--skip-nats] [--policies jffc,least_loaded] [--sizes 16,256]

Writes benchmarks/results/balancer_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import nats

from contracts import subjects
from contracts.messages import EngineStats, Heartbeat, RequestFinished, RouteDecision, RouteReply, RouteRequest, Usage, WorkerRegistration
from kvlane.launcher import Launcher, free_port
from services.balancer.main import build_router, fallback_step_model
from services.balancer.policies import POLICY_NAMES
from shared.block_hash import chained_block_hashes
from shared.config import BalancerSettings, ClusterSettings, KvlaneConfig, LoggingSettings, NatsSettings, RedisSettings, to_env

SIZES = (4, 16, 64, 256)
MODEL = "bench-model"
BLOCK_SIZE = 16
PREFIXES = 8  # distinct shared system prompts


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


async def bench_nats(policy: str, sizes: tuple[int, ...], sequential: int, concurrent: int, concurrency: int, log_dir: Path,
                     allocate_kv: bool = True) -> dict:
    launcher = Launcher(log_dir / policy)
    nats_port, redis_port = free_port(), free_port()
    results: dict[int, dict] = {}
    try:
        launcher.start_nats(nats_port)
        launcher.start_redis(redis_port)
        config = KvlaneConfig(
            nats=NatsSettings(url=f"nats://127.0.0.1:{nats_port}"),
            redis=RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0"),
            logging=LoggingSettings(level="warning"),
            cluster=ClusterSettings(heartbeat_interval_s=1.0, heartbeat_ttl_s=30.0, resync_interval_s=30.0),
            balancer=BalancerSettings(policy=policy, allocate_kv=allocate_kv),  # type: ignore[arg-type]
        )
        balancer = launcher.start_service("balancer", to_env(config))
        nc = await nats.connect(config.nats.url)
        encode = msgspec.msgpack.encode
        decoder = msgspec.msgpack.Decoder(RouteReply)
        await _wait_for(nc, balancer, subjects.BALANCER_STATUS, {"type": "balancer_status_request"})
        if allocate_kv:
            # Up before the heartbeats below, or it would not know the nodes it is asked to allocate on.
            cache_manager = launcher.start_service("cache_manager", to_env(config))
            await _wait_for(nc, cache_manager, subjects.CACHE_REQUEST, {"type": "status"})
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
            now = time.time()
            for i in range(nodes):
                await nc.publish(subjects.heartbeat(f"n{i:03d}"), encode(make_heartbeat(i, now)))
            await nc.flush()
            await asyncio.sleep(0.3)
            for _ in range(20):  # warm up
                await route_once()
            latencies = [await route_once() for _ in range(sequential)]
            in_flight = asyncio.Semaphore(concurrency)

            async def limited() -> None:
                async with in_flight:
                    await route_once()

            started = time.perf_counter()
            await asyncio.gather(*(limited() for _ in range(concurrent)))
            per_second = concurrent / (time.perf_counter() - started)
            results[nodes] = _summary(latencies, per_second)
            print(f"  nats {policy:17s} {nodes:4d} nodes  p50 {results[nodes]['p50_us']:8.0f} us  "
                  f"p99 {results[nodes]['p99_us']:8.0f} us  {results[nodes]['decisions_per_s']:6d}/s", flush=True)
        await nc.close()
    finally:
        launcher.stop_all()
    return results


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
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "balancer_bench.json"))
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    sizes = tuple(int(s) for s in args.sizes.split(","))
    core_decisions, sequential, concurrent = (300, 100, 300) if args.quick else (3000, 400, 2000)
    report: dict = {"sizes": sizes, "core": {}, "core_snapshot": {}, "nats": {}, "concurrency": args.concurrency,
                    "allocate_kv": not args.no_kv, "heartbeat_every": args.heartbeat_every}
    print("pure core (admit + release, no I/O): as the balancer routes (on the chain index where the policy supports it),"
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
                    bench_nats(policy, sizes, sequential, concurrent, args.concurrency, Path(log_dir), not args.no_kv))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
