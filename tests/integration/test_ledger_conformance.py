"""The Redis block ledger (Lua scripts) and the simulator's in-memory copy run the same operation sequences and end
in the same state, on a real redis-server and a real Redis Cluster.

Each step is what a service does to the ledger: the balancer's lease on the node it chose, then, when refused, the
cache-manager's preemption there (`plan_preemption` and the preemption script) against `SimAllocator.allocate`;
releases naming the node or only the request; a worker's renewal (the progress preemption weighs); a departed
node's leases all going. After every step both hold the same leases (node, request, blocks, pool, priority,
max_tokens) and the same blocks in use per pool, and every step answered alike (granted or refused, the victims,
the blocks given back).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import Struct

from loadtest.simulation.ledger import MemoryLedger, SimAllocator
from shared.config import CacheManagerSettings, RedisSettings
from shared.kv.allocation import Demand, NodeCapacity, ask_on_node, plan_preemption
from shared.kv.block_ledger import BlockLedger
from shared.state import connect_redis

pytestmark = pytest.mark.integration

BLOCK_SIZE = 4
NODES = {"n0": 12, "n1": 20, "n2": 8}  # node: its KV blocks
REQUESTS = [f"r{i}" for i in range(8)]
POLICY = CacheManagerSettings(short_request_tokens=16, short_pool_share=0.25, prewarm=False)


class Lease(Struct, frozen=True):
    node: str
    request_id: str
    prompt_tokens: int
    max_tokens: int
    priority: float
    cached_blocks: int


class Release(Struct, frozen=True):
    request_id: str
    node: str | None  # None: only the request is known (a withdrawn route)


class Renew(Struct, frozen=True):
    node: str
    request_id: str
    generated: int


class NodeGone(Struct, frozen=True):
    node: str


nodes = st.sampled_from(sorted(NODES))
requests = st.sampled_from(REQUESTS)
leases = st.builds(Lease, nodes, requests, st.integers(0, 40), st.integers(1, 16), st.sampled_from([1.0, 2.0, 3.0]),
                   st.integers(0, 4))
steps_by_kind = {
    "lease": leases,
    "release": st.builds(Release, requests, st.one_of(st.none(), nodes)),
    "renew": st.builds(Renew, nodes, requests, st.integers(0, 16)),
    "node_gone": st.builds(NodeGone, nodes),
}
# Mostly leases, so that nodes fill and preemptions find victims; a departed node empties one now and then.
operations = st.sampled_from(["lease"] * 6 + ["release"] * 2 + ["renew"] * 2 + ["node_gone"]).flatmap(
    steps_by_kind.__getitem__)

Answer = tuple  # (what the step did, what it gave back)


class RedisSide:
    """The services' steps on the Lua ledger."""

    def __init__(self, ledger: BlockLedger) -> None:
        self.ledger = ledger

    async def apply(self, step: object) -> Answer:
        ledger = self.ledger
        match step:
            case Lease(node, request_id, prompt, max_tokens, priority, cached):
                demand = Demand(request_id, prompt, max_tokens, priority)
                ask = ask_on_node(demand, NODES[node], BLOCK_SIZE, cached, POLICY)
                # The balancer's lease on the node it chose.
                if (await ledger.reserve_asked(request_id, node, ask, priority, max_tokens)).granted:
                    return ("granted", ())
                # Refused: the cache-manager's preemption on that node.
                general, short, _ = (await ledger.usage([node]))[node]
                capacity = NodeCapacity(node, NODES[node], BLOCK_SIZE, general, short)
                plan = plan_preemption(demand, [(capacity, await ledger.leases_on(node))], {node: cached}, POLICY)
                if plan is None:
                    return ("refused", ())
                preemption = await ledger.preempt(request_id, node, plan.blocks, plan.pool, ask.general_capacity,
                                                  ask.short_capacity, priority, max_tokens,
                                                  [victim.request_id for victim in plan.victims])
                granted = "granted" if preemption.reservation.granted else "refused"
                return (granted, tuple(sorted(preemption.preempted)))
            case Release(request_id, None):
                return ("freed", await ledger.release_on_any(request_id, sorted(NODES)))
            case Release(request_id, node):
                return ("freed", await ledger.release(request_id, node))
            case Renew(node, request_id, generated):
                return ("renewed", await ledger.renew(node, [(request_id, generated)]))
            case NodeGone(node):
                leases = await ledger.leases_on(node)
                await ledger.release_many([(lease.request_id, node) for lease in leases])
                return ("gone", len(leases))
        raise AssertionError(step)

    async def state(self) -> tuple[dict, dict]:
        usage = await self.ledger.usage(sorted(NODES))
        leases = {node: {(lease.request_id, lease.blocks, lease.pool, lease.priority, lease.max_tokens, lease.generated)
                         for lease in await self.ledger.leases_on(node)} for node in NODES}
        return {node: used[:2] for node, used in usage.items()}, leases


class MemorySide:
    """The same steps on the simulator's ledger, as the simulated balancer takes them."""

    def __init__(self) -> None:
        self.ledger = MemoryLedger()
        self.allocator = SimAllocator(self.ledger, POLICY)
        # What workers reported per lease (the Redis ledger keeps it in the lease, so a new lease starts at 0).
        self.generated: dict[tuple[str, str], int] = {}
        self.now = 0.0

    def progress(self, node: str) -> Callable[[str], int]:
        return lambda request_id: self.generated.get((node, request_id), 0)

    def apply(self, step: object) -> Answer:
        self.now += 1.0
        match step:
            case Lease(node, request_id, prompt, max_tokens, priority, cached):
                demand = Demand(request_id, prompt, max_tokens, priority)
                grant = self.allocator.allocate(demand, node, NODES[node], BLOCK_SIZE, cached, self.progress(node),
                                                self.now)
                answer: Answer = ("granted" if grant.granted else "refused", tuple(sorted(grant.preempted)))
            case Release(request_id, node):
                answer = ("freed", self.ledger.release(request_id, node))
            case Renew(node, request_id, generated):
                held = any(lease.request_id == request_id for lease in self.ledger.leases_on(node, self.progress(node)))
                if held:
                    self.generated[(node, request_id)] = generated
                answer = ("renewed", int(held))
            case NodeGone(node):
                count = len(self.ledger.leases_on(node, self.progress(node)))
                self.ledger.release_node(node)
                answer = ("gone", count)
            case _:
                raise AssertionError(step)
        held = {(node, lease.request_id) for node in NODES for lease in self.ledger.leases_on(node, self.progress(node))}
        self.generated = {key: value for key, value in self.generated.items() if key in held}
        return answer

    def state(self) -> tuple[dict, dict]:
        used = {node: self.ledger.used(node) for node in NODES}
        leases = {node: {(lease.request_id, lease.blocks, lease.pool, lease.priority, lease.max_tokens, lease.generated)
                         for lease in self.ledger.leases_on(node, self.progress(node))} for node in NODES}
        return used, leases


def test_the_lua_ledger_and_the_simulators_end_in_the_same_state(redis_backend: RedisSettings) -> None:
    loop = asyncio.new_event_loop()
    client = connect_redis(redis_backend)
    redis_side = RedisSide(BlockLedger(client, lease_ttl_s=600))

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(steps=st.lists(operations, min_size=15, max_size=40))
    def same_state(steps: list) -> None:
        loop.run_until_complete(client.flushall())
        memory_side = MemorySide()
        for number, step in enumerate(steps):
            redis_answer = loop.run_until_complete(redis_side.apply(step))
            memory_answer = memory_side.apply(step)
            assert redis_answer == memory_answer, f"step {number} {step}: Redis {redis_answer}, memory {memory_answer}"
            redis_state = loop.run_until_complete(redis_side.state())
            assert redis_state == memory_side.state(), f"after step {number} {step}"

    try:
        same_state()
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
