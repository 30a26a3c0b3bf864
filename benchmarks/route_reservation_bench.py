"""What a route decision costs in Redis: the slot, then the KV lease (two round trips), against
both in one script (`RedisSlotStore.reserve_with_lease`), on a real redis-server.

Each decision reserves a slot and a lease for a new request on one of 64
nodes, and its release follows in batches of finished requests: the slot,
then the lease, for the first way (as when the cache-manager freed leases:
`lease_release_bench.SlotsAlone`); both in the slot's release script for the
second (`RedisSlotStore`, as the balancers do now). The two ways alternate in rounds, so a
machine busy with other work slows both alike. Latency from sequential
decisions, decisions per second and the Redis server's CPU per decision
from `--concurrency` in flight.

    python -m benchmarks.route_reservation_bench [--decisions 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as redis

from launch.launcher import Launcher, free_port
from benchmarks.lease_release_bench import SlotsAlone
from services.balancer.slot_store import RedisSlotStore
from shared.kv.block_ledger import BlockLedger
from shared.kv.allocation import NodeAsk

NODES = 64
ASK = NodeAsk(blocks=4, cached_blocks=0, pool="general", general_capacity=1 << 30, short_capacity=0)

Decide = Callable[[str, str], Awaitable[None]]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_way(decide: Decide, release: Callable[[list[tuple[str, str]]], Awaitable[None]], tag: str, decisions: int,
                  concurrency: int, redis_pid: int) -> dict:
    latencies = []
    for i in range(decisions // 4):
        started = time.perf_counter()
        await decide(f"{tag}-s{i}", f"w{i % NODES}")
        latencies.append(time.perf_counter() - started)
    await release([(f"{tag}-s{i}", f"w{i % NODES}") for i in range(decisions // 4)])
    queue = iter(range(decisions))
    done: list[tuple[str, str]] = []

    async def client() -> None:
        for i in queue:
            await decide(f"{tag}-c{i}", f"w{i % NODES}")
            done.append((f"{tag}-c{i}", f"w{i % NODES}"))

    cpu, started = cpu_seconds(redis_pid), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - started, cpu_seconds(redis_pid) - cpu
    await release(done)
    latencies.sort()
    return {"p50_us": 1e6 * statistics.median(latencies), "p99_us": 1e6 * latencies[int(0.99 * (len(latencies) - 1))],
            "per_s": decisions / elapsed, "redis_cpu_us": 1e6 * cpu / decisions}


async def bench(decisions: int, rounds: int, concurrency: int, folder: Path) -> None:
    launcher = Launcher(folder)
    port = free_port()
    redis_pid = launcher.start_redis(port).popen.pid
    client = redis.Redis(port=port, max_connections=concurrency + 4)
    try:
        slots, ledger = SlotsAlone(client), BlockLedger(client, lease_ttl_s=60)
        slots_and_leases = RedisSlotStore(client)
        deadline = time.time() + 3600

        async def two_trips(request_id: str, worker_id: str) -> None:
            taken, _ = await slots.reserve(request_id, f"{worker_id}@1", 1 << 20, deadline)
            assert taken and (await ledger.reserve_asked(request_id, worker_id, ASK, 1.0, 64)).granted

        async def one_script(request_id: str, worker_id: str) -> None:
            both = await slots.reserve_with_lease(request_id, f"{worker_id}@1", 1 << 20, deadline,
                                                  ledger.asked_call(request_id, worker_id, ASK, 1.0, 64))
            assert both.slot_taken

        async def release_apart(finished: list[tuple[str, str]]) -> None:
            for start in range(0, len(finished), 64):  # as one burst of RequestFinished each
                batch = finished[start:start + 64]
                await slots.release_many(batch)
                await ledger.release_many(batch)

        async def release_together(finished: list[tuple[str, str]]) -> None:
            for start in range(0, len(finished), 64):
                batch = finished[start:start + 64]
                await slots_and_leases.release_many(batch, [f"{worker_id}@1" for _, worker_id in batch])

        print(f"{decisions} decisions per way and round ({decisions // 4} sequential), {concurrency} in flight, {NODES} nodes")
        print(f"{'round':>5} {'way':<24} {'p50 us':>8} {'p99 us':>8} {'decisions/s':>12} {'redis CPU us/decision':>22}")
        for round_ in range(1, rounds + 1):
            for name, decide, release in (("slot, then lease", two_trips, release_apart),
                                          ("slot + lease, one script", one_script, release_together)):
                r = await run_way(decide, release, f"{name[:4]}{round_}", decisions, concurrency, redis_pid)
                print(f"{round_:>5} {name:<24} {r['p50_us']:8.0f} {r['p99_us']:8.0f} {r['per_s']:12.0f} {r['redis_cpu_us']:22.1f}",
                      flush=True)
    finally:
        await client.aclose()
        launcher.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvlane-bench-") as folder:
        asyncio.run(bench(args.decisions, args.rounds, args.concurrency, Path(folder)))


if __name__ == "__main__":
    main()
