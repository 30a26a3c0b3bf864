"""What releasing a finished request costs in Redis: its slot's script and then the ledger's lease script (as when
the balancer freed slots and the cache-manager leases, each a round trip: `SlotsAlone`), against the lease freed
inside the slot's script (`RedisSlotStore`, as the balancers do now), on a real redis-server.

Requests are placed first (slot and lease in one script each, on 64 nodes), then released in bursts of 64, as
one burst of `RequestFinished` is: by the replica that placed them (their chains known), then again by another
replica, which finds them gone (it reads the slot's key, and with leases inside also the lease's, in one
pipeline). The ways alternate in rounds, so a machine busy with other work slows them alike. Per release: this
process's CPU (the client side of every service involved), the Redis server's CPU, and the wall time.

    python -m benchmarks.lease_release_bench [--requests 4000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as redis

from launch.launcher import Launcher, free_port
from services.balancer.slot_store import RedisSlotStore
from shared.kv.block_ledger import BlockLedger
from shared.kv.allocation import NodeAsk

NODES = 64
BURST = 64
ASK = NodeAsk(blocks=4, cached_blocks=0, pool="general", general_capacity=1 << 30, short_capacity=0)

Release = Callable[[list[tuple[str, str]], list[str | None] | None], Awaitable[None]]


class SlotsAlone(RedisSlotStore):
    """The slot store as it was while the cache-managers freed leases: its scripts never touch the ledger."""

    def _lease_keys(self, request_id: str, worker_id: str) -> list[str]:
        return []


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measured(release: Release, finished: list[tuple[str, str]], chains: list[str | None] | None,
                   redis_pid: int) -> dict:
    """Per release: client CPU, Redis CPU and wall time (µs), releasing `finished` a burst at a time."""
    client_cpu, redis_cpu, started = time.process_time(), cpu_seconds(redis_pid), time.perf_counter()
    for start in range(0, len(finished), BURST):
        await release(finished[start:start + BURST], None if chains is None else chains[start:start + BURST])
    wall = time.perf_counter() - started
    client_cpu, redis_cpu = time.process_time() - client_cpu, cpu_seconds(redis_pid) - redis_cpu
    count = len(finished)
    return {"client_us": 1e6 * client_cpu / count, "redis_us": 1e6 * redis_cpu / count, "wall_us": 1e6 * wall / count}


async def bench(requests: int, rounds: int, folder: Path) -> None:
    launcher = Launcher(folder)
    port = free_port()
    redis_pid = launcher.start_redis(port).popen.pid
    client = redis.Redis(port=port)
    try:
        ledger = BlockLedger(client, lease_ttl_s=60)
        apart, inside = SlotsAlone(client), RedisSlotStore(client)
        deadline = time.time() + 3600

        async def place(tag: str) -> tuple[list[tuple[str, str]], list[str | None]]:
            finished = [(f"{tag}-{i}", f"w{i % NODES}") for i in range(requests)]
            for start in range(0, requests, BURST):
                await asyncio.gather(*(
                    inside.reserve_with_lease(request_id, f"{worker_id}@1", 1 << 20, deadline,
                                              ledger.asked_call(request_id, worker_id, ASK, 1.0, 64))
                    for request_id, worker_id in finished[start:start + BURST]))
            return finished, [f"{worker_id}@1" for _, worker_id in finished]

        async def slot_then_lease(batch: list[tuple[str, str]], chains: list[str | None] | None) -> None:
            await apart.release_many(batch, chains)
            await ledger.release_many(batch)

        async def lease_inside(batch: list[tuple[str, str]], chains: list[str | None] | None) -> None:
            await inside.release_many(batch, chains)

        async def read_slot(batch: list[tuple[str, str]], chains: list[str | None] | None) -> None:
            await apart.release_many(batch, chains)

        ways: list[tuple[str, Release, Release]] = [
            ("slot, then lease", slot_then_lease, read_slot), ("lease inside the slot's", lease_inside, lease_inside)]
        print(f"{requests} releases per way and round, in bursts of {BURST}, {NODES} nodes; µs per release")
        print(f"{'round':>5} {'way':<24} {'replica':<8} {'client CPU':>10} {'redis CPU':>10} {'wall':>8}")
        for round_ in range(1, rounds + 1):
            for name, placer, other in ways:
                finished, chains = await place(f"{name[:4]}{round_}")
                for replica, release, known in (("placed", placer, chains), ("other", other, None)):
                    r = await measured(release, finished, known, redis_pid)
                    print(f"{round_:>5} {name:<24} {replica:<8} {r['client_us']:10.1f} {r['redis_us']:10.1f} "
                          f"{r['wall_us']:8.1f}", flush=True)
                usage = await ledger.usage([f"w{i}" for i in range(NODES)])
                assert all(u == (0, 0, 0) for u in usage.values()), "a lease was left behind"
    finally:
        await client.aclose()
        launcher.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvlane-bench-") as folder:
        asyncio.run(bench(args.requests, args.rounds, Path(folder)))


if __name__ == "__main__":
    main()
