"""The Redis block ledger (Lua scripts) under random operation sequences, on a real redis-server
and on a real three-master Redis Cluster.

With the balancer's slot-and-lease script too: a chain's slot and a node's
blocks are taken together or not at all.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.balancer.slot_store import RedisSlotStore
from shared.kv.block_ledger import LEDGER_NODES_KEY, BlockLedger, expiry_key, lease_key
from shared.config import RedisSettings
from shared.state import connect_redis

pytestmark = pytest.mark.integration

CAPACITY = {"n0": (30, 10), "n1": (12, 4), "n2": (50, 0)}  # node: (general, short)
SLOTS = {"n0": 3, "n1": 2, "n2": 4}  # node: slots of its chain
FAR = 4_000_000_000.0  # a slot's expiry: never within a test


def chain_of(node: str) -> str:
    return f"{node}@1"


class LedgerMachine(RuleBasedStateMachine):
    """Allocate, release, expire, and nodes joining and leaving, against one real Redis or Redis Cluster."""

    redis_settings = RedisSettings()

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.client = connect_redis(self.redis_settings)
        self.run(self.client.flushall())
        self.ledger = BlockLedger(self.client, lease_ttl_s=60)
        self.live_nodes = {"n0", "n1"}
        # As the cache-managers' maintenance does: the nodes alive join the ledger's index of nodes to reap.
        self.run(self.ledger.reap(sorted(self.live_nodes)))
        self.leases: dict[str, tuple[str, int, str]] = {}
        # A balancer's store: a slot's release frees its request's lease on the node too.
        self.slot_store = RedisSlotStore(self.client)
        self.slots: dict[str, str] = {}  # request id -> its node, for the slots taken with a lease
        self.counter = 0

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    @rule(node=st.sampled_from(sorted(CAPACITY)), blocks=st.integers(1, 15), pool=st.sampled_from(["general", "short", "short_first"]))
    def allocate(self, node: str, blocks: int, pool: str) -> None:
        if node not in self.live_nodes:
            return
        self.counter += 1
        rid = f"r{self.counter}"
        general, short_cap = CAPACITY[node]
        free = self.free(node)
        result = self.run(self.ledger.reserve(rid, node, blocks, pool, general, short_cap, 1.0, 10))
        # Granted exactly when the blocks fit; short_first prefers the short pool, as allocator.pool_for does.
        fits = {p: blocks <= free[p] for p in ("general", "short")}
        expected = {"general": "general" if fits["general"] else None, "short": "short" if fits["short"] else None,
                    "short_first": "short" if fits["short"] else "general" if fits["general"] else None}[pool]
        assert (result.pool if result.granted else None) == expected
        if result.granted:
            self.leases[rid] = (node, blocks, result.pool)

    @rule(node=st.sampled_from(sorted(CAPACITY)), blocks=st.integers(1, 15), pool=st.sampled_from(["general", "short_first"]))
    def reserve_slot_with_lease(self, node: str, blocks: int, pool: str) -> None:
        if node not in self.live_nodes:
            return
        self.counter += 1
        rid = f"r{self.counter}"
        general, short_cap = CAPACITY[node]
        free = self.free(node)
        slot_free = sum(1 for n in self.slots.values() if n == node) < SLOTS[node]
        lease_call = self.ledger.allocate_call(rid, node, blocks, pool, general, short_cap, 1.0, 10)
        both = self.run(self.slot_store.reserve_with_lease(rid, chain_of(node), SLOTS[node], FAR, lease_call))
        fits = blocks <= free["short"] if pool == "short_first" and blocks <= free["short"] else blocks <= free["general"]
        # The slot is judged first; the lease only when the slot is free; either refusal takes nothing.
        assert both.slot_taken == (slot_free and fits)
        assert (both.lease is None) == (not slot_free)
        if both.slot_taken:
            assert both.lease is not None and both.lease.granted and both.lease.blocks == blocks
            self.leases[rid] = (node, blocks, both.lease.pool)
            self.slots[rid] = node

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), blocks=st.integers(1, 30), pool=st.sampled_from(["general", "short"]))
    def preempt(self, data, blocks: int, pool: str) -> None:
        # Victims as a plan read a moment ago names them: some may have ended since, some are in the other pool.
        node = data.draw(st.sampled_from(sorted({n for n, _, _ in self.leases.values()})))
        named = data.draw(st.lists(st.sampled_from(sorted(self.leases)), max_size=3, unique=True))
        named += data.draw(st.lists(st.sampled_from(["ended-1", "ended-2"]), max_size=1))
        self.counter += 1
        rid = f"r{self.counter}"
        general, short_cap = CAPACITY[node]
        freed = [r for r in named if r in self.leases and self.leases[r][0] == node and self.leases[r][2] == pool]
        room = self.free(node)[pool] + sum(self.leases[r][1] for r in freed)
        result = self.run(self.ledger.preempt(rid, node, blocks, pool, general, short_cap, 2.0, 10, named))
        # All or nothing: the newcomer's blocks and the victims' release together, or neither.
        assert result.reservation.granted == (blocks <= room)
        if result.reservation.granted:
            assert sorted(result.preempted) == sorted(freed)
            for victim in freed:
                self.leases.pop(victim)
            self.leases[rid] = (node, blocks, pool)
        else:
            assert result.preempted == [] and result.reservation.blocks == room

    @precondition(lambda self: self.slots)
    @rule(data=st.data(), placed_here=st.booleans())
    def release_slots(self, data, placed_here: bool) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.slots)), min_size=1, max_size=3, unique=True))
        nodes = [self.slots[rid] for rid in rids]
        others = [next(n for n in sorted(CAPACITY) if n != node) for node in nodes]
        # Each as another node's end says (no slot there; a lease only if the request moved there), then as its own
        # node's, by the replica that placed it (its chain known) or another (read first).
        chains = [None] * len(rids) + ([chain_of(node) for node in nodes] if placed_here else [None] * len(rids))
        released = self.run(self.slot_store.release_many([*zip(rids, others), *zip(rids, nodes)], chains))
        assert released[:len(rids)] == [None] * len(rids)
        assert [chain for chain, _ in released[len(rids):]] == [chain_of(node) for node in nodes]
        for rid, node, other in zip(rids, nodes, others, strict=True):
            self.slots.pop(rid)
            if rid in self.leases and self.leases[rid][0] in (node, other):
                self.leases.pop(rid)  # unless released, preempted or reaped already: then nothing is credited
        # Again: nothing left to free.
        assert self.run(self.slot_store.release_many([*zip(rids, nodes)], chains[len(rids):])) == [None] * len(rids)

    @precondition(lambda self: set(self.leases) - set(self.slots))
    @rule(data=st.data())
    def release_leases_without_slots(self, data) -> None:
        # Leases a preemption granted, or whose slots went first: a balancer's release frees them alone.
        rids = data.draw(st.lists(st.sampled_from(sorted(set(self.leases) - set(self.slots))), min_size=1, max_size=3,
                                  unique=True))
        nodes = [self.leases.pop(rid)[0] for rid in rids]
        assert self.run(self.slot_store.release_many([*zip(rids, nodes)])) == [None] * len(rids)

    def free(self, node: str) -> dict[str, int]:
        general, short = CAPACITY[node]
        mine = [(b, p) for n, b, p in self.leases.values() if n == node]
        return {"general": general - sum(b for b, p in mine if p == "general"),
                "short": short - sum(b for b, p in mine if p == "short")}

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.leases)))
        node, blocks, _ = self.leases.pop(rid)
        assert self.run(self.ledger.release(rid, node)) == blocks
        assert self.run(self.ledger.release(rid, node)) is None  # twice is harmless

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release_knowing_only_the_request(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.leases)))
        _, blocks, _ = self.leases.pop(rid)
        assert self.run(self.ledger.release_on_any(rid, sorted(CAPACITY))) == blocks
        assert self.run(self.ledger.release_on_any(rid, sorted(CAPACITY))) is None

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release_batch(self, data) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.leases)), min_size=1, max_size=4, unique=True))
        nodes = [self.leases[rid][0] for rid in rids]
        expected = [self.leases.pop(rid)[1] for rid in rids]
        # One pipeline; an id twice in a batch, or one never leased, frees nothing the second time.
        freed = self.run(self.ledger.release_many([*zip(rids, nodes), (rids[0], nodes[0]), ("never", nodes[0])]))
        assert freed == [*expected, None, None]

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def expire(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.leases)))
        # Backdate the lease, as if its holder had stopped renewing long ago.
        self.run(self.client.zadd(expiry_key(self.leases[rid][0]), {rid: 0}))
        assert rid in self.run(self.ledger.reap(sorted(self.live_nodes)))
        self.leases.pop(rid)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), node=st.sampled_from(sorted(CAPACITY)), blocks=st.integers(1, 15))
    def reallocate_elsewhere(self, data, node: str, blocks: int) -> None:
        # A retried or resumed request allocates again under the same id on another node; the old attempt's
        # end, later, frees the lease on the old node and leaves the new one be.
        rid = data.draw(st.sampled_from(sorted(self.leases)))
        if node not in self.live_nodes or self.leases[rid][0] == node:
            return
        general, short_cap = CAPACITY[node]
        fits = blocks <= self.free(node)["general"]
        result = self.run(self.ledger.reserve(rid, node, blocks, "general", general, short_cap, 1.0, 10))
        assert result.granted == fits and not result.already_held
        old_node, old_blocks, _ = self.leases.pop(rid)
        assert self.run(self.ledger.release(rid, old_node)) == old_blocks
        if result.granted:
            self.leases[rid] = (node, blocks, result.pool)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def late_release_from_another_node_is_ignored(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.leases)))
        other = next(n for n in sorted(CAPACITY) if n != self.leases[rid][0])
        assert self.run(self.ledger.release(rid, other)) is None

    @rule(node=st.sampled_from(sorted(CAPACITY)))
    def node_joins(self, node: str) -> None:
        self.live_nodes.add(node)
        self.run(self.ledger.reap(sorted(self.live_nodes)))

    @rule(node=st.sampled_from(sorted(CAPACITY)))
    def node_leaves(self, node: str) -> None:
        # A departed node renews nothing: all its leases expire.
        self.live_nodes.discard(node)
        mine = [r for r, (n, _, _) in self.leases.items() if n == node]
        for rid in mine:
            self.run(self.client.zadd(expiry_key(node), {rid: 0}))
            self.leases.pop(rid)
        # Reaped though no longer among the nodes alive; then it leaves the index, having no lease left.
        assert sorted(self.run(self.ledger.reap(sorted(self.live_nodes)))) == sorted(mine)
        assert node.encode() not in self.run(self.client.smembers(LEDGER_NODES_KEY))

    @invariant()
    def reserved_within_capacity_and_matching_leases(self) -> None:
        usage = self.run(self.ledger.usage(sorted(CAPACITY)))
        for node, (general, short) in CAPACITY.items():
            used_general, used_short, count = usage[node]
            assert 0 <= used_general <= general and 0 <= used_short <= short
            mine = [(b, p) for n, b, p in self.leases.values() if n == node]
            assert used_general == sum(b for b, p in mine if p == "general")
            assert used_short == sum(b for b, p in mine if p == "short")
            assert count == len(mine)
        slots = self.run(self.slot_store.usage([chain_of(node) for node in CAPACITY], 0.0))
        assert slots == {chain_of(node): sum(1 for n in self.slots.values() if n == node) for node in CAPACITY}

    def teardown(self) -> None:
        for rid, (node, _, _) in list(self.leases.items()):
            self.run(self.ledger.release(rid, node))
        self.run(self.slot_store.release_many(list(self.slots.items())))
        assert not any(self.run(self.slot_store.usage([chain_of(node) for node in CAPACITY], 0.0)).values())
        usage = self.run(self.ledger.usage(sorted(CAPACITY)))
        assert all(u == (0, 0, 0) for u in usage.values()), usage
        assert not self.run(self.existing([lease_key(n, f"r{i}") for i in range(1, self.counter + 1) for n in CAPACITY]))
        self.run(self.client.aclose())
        self.loop.close()


    async def existing(self, keys: list[str]) -> int:
        async with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
            return sum(await pipe.execute())


def test_ledger_never_overcommits_and_returns_to_zero(redis_backend: RedisSettings) -> None:
    LedgerMachine.redis_settings = redis_backend
    run = LedgerMachine.TestCase()
    run.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
    run.runTest()
