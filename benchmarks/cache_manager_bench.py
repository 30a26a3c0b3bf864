"""Cache-manager benchmark: allocation decisions and prefix lookups, pure core and through NATS.

    python -m benchmarks.cache_manager_bench [--quick] [--out PATH]

Pure core: `rank` (the greedy choice) over 4-256 nodes, and
`PrefixIndex.match` over indexes of 10^4-10^6 blocks, with the index's
memory per million blocks. Through NATS: a real nats-server, redis-server
and cache-manager process, with heartbeats of N fake nodes published the
way workers publish them; allocate+release pairs (on a given node, as the
balancer asks) and lookups from 32 concurrent clients, then allocates and
releases from one client, one request at a time (the latency of one
allocation with nothing queued, and the cache-manager's CPU per request).
Prints a table and writes JSON.

    python -m benchmarks.cache_manager_bench --nats-only --nodes 16 --sequential 5000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import msgspec
import nats
import nats.errors
import psutil
from rich.console import Console
from rich.table import Table

from contracts import subjects
from contracts.cache import AllocateRequest, CacheReply, LookupRequest, ReleaseRequest
from contracts.messages import EngineStats, Heartbeat, WorkerRegistration
from launch.launcher import Launcher, free_port
from shared.kv.allocation import Demand, NodeCapacity, rank
from shared.config import CacheManagerSettings, KvlaneConfig, NatsSettings, RedisSettings, to_env
from shared.kv.prefix_index import PrefixIndex
from shared.state import ClusterState, connect_redis

NODE_COUNTS = (4, 16, 64, 256)
INDEX_SIZES = (10_000, 100_000, 1_000_000)
QUERY_BLOCKS = 128  # a 2048-token prompt in 16-token blocks


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6  # noqa: E731
    return {"p50_us": pick(0.5), "p99_us": pick(0.99), "mean_us": statistics.fmean(ordered) * 1e6}


def bench_rank(nodes: int, decisions: int) -> dict:
    rng = random.Random(nodes)
    settings = CacheManagerSettings()
    capacities = [NodeCapacity(f"w{i}", 4096, 16, rng.randint(0, 3000), rng.randint(0, 400)) for i in range(nodes)]
    cached = {f"w{i}": rng.randint(0, 64) for i in range(0, nodes, 3)}
    samples = []
    for k in range(decisions):
        demand = Demand(f"r{k}", rng.randint(16, 4096), rng.randint(16, 512))
        started = time.perf_counter()
        rank(demand, capacities, cached, settings)
        samples.append(time.perf_counter() - started)
    return {"nodes": nodes, "decisions_per_s": decisions / sum(samples), **percentiles(samples)}


def build_index(blocks: int, nodes: int = 16) -> tuple[PrefixIndex, list[list[int]]]:
    """`blocks` hashes in chains of QUERY_BLOCKS, each chain held by 1-3 nodes."""
    rng = random.Random(blocks)
    index = PrefixIndex(max_blocks=blocks)
    chains = []
    for start in range(0, blocks, QUERY_BLOCKS):
        chain = list(range(start, min(start + QUERY_BLOCKS, blocks)))
        for node in rng.sample(range(nodes), rng.randint(1, 3)):
            index.apply(f"w{node}", stored=chain)
        chains.append(chain)
    return index, chains


def bench_lookup(blocks: int, lookups: int) -> dict:
    gc.collect()
    tracemalloc.start()
    index, chains = build_index(blocks)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rng = random.Random(7)
    samples = []
    for _ in range(lookups):
        chain = rng.choice(chains)
        # Half the queries share only part of a cached prefix, as real prompts do.
        query = chain[: rng.randint(1, len(chain))] + [10**12 + rng.randint(0, 10**6)] * rng.randint(0, 32)
        started = time.perf_counter()
        index.match(query)
        samples.append(time.perf_counter() - started)
    return {"indexed_blocks": len(index), "bytes_per_block": memory / blocks,
            "mb_per_million_blocks": memory / blocks * 1e6 / 2**20, "lookups_per_s": lookups / sum(samples), **percentiles(samples)}


def fake_heartbeat(worker_id: str, seq: int) -> Heartbeat:
    registration = WorkerRegistration(worker_id, "aggregated", "bench", "sim", subjects.worker_inbox(worker_id), 16, 32768, "sim", 0.0)
    return Heartbeat(registration, EngineStats(kv_blocks_total=4096), time.time(), seq)


async def bench_nats(nodes: int, pairs: int, concurrency: int, sequential: int, log_dir: Path) -> dict:
    launcher = Launcher(log_dir)
    nats_port, redis_port = free_port(), free_port()
    try:
        launcher.start_nats(nats_port)
        launcher.start_redis(redis_port)
        config = KvlaneConfig(nats=NatsSettings(url=f"nats://127.0.0.1:{nats_port}"),
                              redis=RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0"))
        env = to_env(config) | {"KVLANE__LOGGING__LEVEL": '"warning"', "KVLANE__CACHE_MANAGER__PREWARM": "false"}
        manager = psutil.Process(launcher.start_service("cache_manager", env).pid)
        nc = await nats.connect(config.nats.url)
        redis_client = connect_redis(config.redis)
        state = ClusterState(redis_client, config.cluster.heartbeat_ttl_s)
        encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CacheReply)

        async def heartbeats() -> None:
            seq = 0
            while True:
                seq += 1
                for i in range(nodes):
                    beat = fake_heartbeat(f"w{i}", seq)
                    await nc.publish(subjects.heartbeat(f"w{i}"), encoder.encode(beat))
                    await state.put_heartbeat(beat)
                await asyncio.sleep(1.0)

        beating = asyncio.create_task(heartbeats())
        await asyncio.sleep(1.0)

        async def ask(message) -> object:
            return decoder.decode((await nc.request(subjects.CACHE_REQUEST, encoder.encode(message), timeout=10)).data)

        for _ in range(200):  # until the manager is up and sees the nodes
            try:
                reply = await ask(AllocateRequest("probe", "bench", 16, 1))
            except nats.errors.NoRespondersError:
                reply = None
            if reply is not None and not hasattr(reply, "code"):
                await ask(ReleaseRequest("probe"))
                break
            await asyncio.sleep(0.1)
        rng = random.Random(nodes)
        alloc_samples: list[float] = []
        lookup_samples: list[float] = []
        counter = iter(range(10**9))

        async def client() -> None:
            for _ in range(pairs // concurrency):
                rid = f"r{next(counter)}"
                started = time.perf_counter()
                # As the balancer asks: on the node it chose.
                await ask(AllocateRequest(rid, "bench", rng.randint(16, 2048), rng.randint(16, 256),
                                          block_hashes=[rng.randint(0, 1000)] * 8, worker_id=f"w{rng.randrange(nodes)}",
                                          may_preempt=False))
                await ask(ReleaseRequest(rid))
                alloc_samples.append(time.perf_counter() - started)
                started = time.perf_counter()
                await ask(LookupRequest([rng.randint(0, 1000) for _ in range(QUERY_BLOCKS)]))
                lookup_samples.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        # One at a time: what one allocation costs with nothing queued ahead of it.
        one_alloc: list[float] = []
        one_release: list[float] = []
        # An empty lookup touches neither Redis nor the index: the round trip through NATS and the bus alone.
        one_floor: list[float] = []
        # And one Redis round trip from here, the other hop an allocation takes.
        redis_samples: list[float] = []
        cpu_before = manager.cpu_times()
        for k in range(sequential):
            rid = f"s{k}"
            started = time.perf_counter()
            await ask(LookupRequest([]))
            one_floor.append(time.perf_counter() - started)
            started = time.perf_counter()
            await redis_client.ping()
            redis_samples.append(time.perf_counter() - started)
            started = time.perf_counter()
            await ask(AllocateRequest(rid, "bench", rng.randint(16, 2048), rng.randint(16, 256),
                                      block_hashes=[rng.randint(0, 1000)] * 8, worker_id=f"w{rng.randrange(nodes)}", may_preempt=False))
            one_alloc.append(time.perf_counter() - started)
            started = time.perf_counter()
            await ask(ReleaseRequest(rid))
            one_release.append(time.perf_counter() - started)
        cpu_after = manager.cpu_times()
        manager_cpu_s = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
        beating.cancel()
        await nc.close()
        return {"nodes": nodes, "allocate_release_pairs_per_s": len(alloc_samples) / elapsed,
                "allocate_release": percentiles(alloc_samples), "lookup": percentiles(lookup_samples),
                "sequential": {"allocate": percentiles(one_alloc), "release": percentiles(one_release),
                               "empty_lookup": percentiles(one_floor), "redis_ping": percentiles(redis_samples),
                               # Per request of the three; heartbeats and maintenance included (a small share at one beat a second).
                               "manager_cpu_us_per_request": manager_cpu_s / (3 * sequential) * 1e6 if sequential else 0.0}}
    finally:
        launcher.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cache_manager_bench")
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    parser.add_argument("--out", default="benchmarks/results/cache_manager_bench.json")
    parser.add_argument("--nats-only", action="store_true", help="only the runs through NATS, not the pure core")
    parser.add_argument("--nodes", type=int, nargs="+", default=list(NODE_COUNTS), help="fake node counts of the NATS runs")
    parser.add_argument("--sequential", type=int, help="rounds of an empty lookup, an allocate and its release, one request at a time (default 2000, quick 200)")
    args = parser.parse_args(argv)
    decisions, lookups, pairs = (500, 2000, 128) if args.quick else (5000, 20000, 1024)
    sequential = args.sequential if args.sequential is not None else (200 if args.quick else 2000)
    console = Console()
    pure_rank = [] if args.nats_only else [bench_rank(n, decisions) for n in NODE_COUNTS]
    pure_lookup = [] if args.nats_only else [bench_lookup(b, lookups) for b in (INDEX_SIZES[:2] if args.quick else INDEX_SIZES)]
    with tempfile.TemporaryDirectory(prefix="kvlane-cm-bench-") as log_dir:
        through_nats = [asyncio.run(bench_nats(n, pairs, 32, sequential, Path(log_dir) / str(n))) for n in args.nodes]
    table = Table(title="cache-manager: allocation (rank) and prefix lookup")
    for column in ("case", "per s", "p50 us", "p99 us", "extra"):
        table.add_column(column)
    for row in pure_rank:
        table.add_row(f"rank, {row['nodes']} nodes (pure)", f"{row['decisions_per_s']:,.0f}", f"{row['p50_us']:.1f}", f"{row['p99_us']:.1f}", "")
    for row in pure_lookup:
        table.add_row(f"lookup, {row['indexed_blocks']:,} blocks (pure)", f"{row['lookups_per_s']:,.0f}", f"{row['p50_us']:.1f}",
                      f"{row['p99_us']:.1f}", f"{row['mb_per_million_blocks']:.0f} MB per 10^6 blocks")
    for row in through_nats:
        a, lk = row["allocate_release"], row["lookup"]
        table.add_row(f"allocate+release, {row['nodes']} nodes (NATS)", f"{row['allocate_release_pairs_per_s']:,.0f}",
                      f"{a['p50_us']:.0f}", f"{a['p99_us']:.0f}", f"lookup p50 {lk['p50_us']:.0f} p99 {lk['p99_us']:.0f} us")
    for row in through_nats:
        one = row["sequential"]
        for kind in ("allocate", "release", "empty_lookup", "redis_ping"):
            where = "" if kind == "redis_ping" else " (NATS)"
            table.add_row(f"{kind.replace('_', ' ')}, one at a time, {row['nodes']} nodes{where}", f"{1e6 / one[kind]['mean_us']:,.0f}",
                          f"{one[kind]['p50_us']:.0f}", f"{one[kind]['p99_us']:.0f}",
                          f"manager CPU {one['manager_cpu_us_per_request']:.0f} us per request" if kind == "allocate" else "")
    console.print(table)
    result = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()},
              "timestamp": time.time(), "pure_rank": pure_rank, "pure_lookup": pure_lookup, "through_nats": through_nats}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
