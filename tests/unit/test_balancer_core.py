"""Balancer core: the slot table, the central queue and BalancerService.route (services/balancer)."""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from contracts.messages import ErrorReply, RequestFinished, RouteDecision, RouteRequest, Usage
from services.balancer.central_queue import CentralQueue
from services.balancer.metrics import BalancerMetrics
from services.balancer.service import BalancerService
from services.balancer.slot_store import LocalSlotStore
from services.balancer.slot_table import SlotTable
from services.balancer.status import SlotRates
from shared.cluster import ClusterView, ClusterWatcher
from shared.config import QueueSettings
from tests.waiting import until
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, request, router, settings as balancer_settings

# --- SlotTable ----------------------------------------------------------------------


def test_slot_table_counts_and_limits() -> None:
    table = SlotTable()
    assert table.reserve("r1", "a", 2, 10.0)
    assert table.reserve("r2", "a", 2, 10.0)
    assert not table.reserve("r3", "a", 2, 10.0)  # full
    assert table.reserve("r3", "b", 2, 10.0)
    assert (table.used("a"), table.used("b"), table.used("c"), len(table)) == (2, 1, 0, 3)
    assert table.release("r1") == "a"
    assert table.release("r1") is None  # twice: no effect
    assert table.release("unknown") is None
    assert (table.used("a"), len(table)) == (1, 2)


def test_re_reserving_moves_the_request_and_its_deadline() -> None:
    table = SlotTable()
    table.reserve("r1", "a", 5, 10.0)
    table.reserve("r1", "b", 5, 20.0)
    assert (table.used("a"), table.used("b"), len(table)) == (0, 1, 1)
    assert table.expire(15.0) == []  # the old deadline no longer applies
    assert table.expire(20.0) == ["r1"]
    assert table.used("b") == 0


def test_expire_drops_only_passed_deadlines() -> None:
    table = SlotTable()
    for request_id, deadline in (("early", 5.0), ("edge", 7.0), ("late", 9.0)):
        table.reserve(request_id, "a", 5, deadline)
    assert table.expire(4.9) == []
    assert sorted(table.expire(7.0)) == ["early", "edge"]  # a deadline equal to now has passed
    assert table.used("a") == 1
    assert table.expire(100.0) == ["late"]
    assert len(table) == 0


def test_foreign_usage_and_chains_that_leave() -> None:
    table = SlotTable()
    table.reserve("r1", "a", 4, 10.0)
    table.set_global_used("a", 3)  # two held by other replicas
    assert table.used("a") == 3 and table.own("a") == 1
    assert not table.reserve("r2", "a", 3, 10.0)
    table.set_global_used("b", 2)
    assert table.retain_chains(["b"]) == ["r1"]
    assert (table.used("a"), table.used("b"), len(table)) == (0, 2, 0)


REQUEST_IDS = st.sampled_from([f"r{i}" for i in range(6)])
CHAINS = st.sampled_from(["a", "b", "c"])
TIMES = st.integers(0, 20).map(float)


class SlotTableMachine(RuleBasedStateMachine):
    """Model: request id -> (chain, deadline) of every un-released, un-expired reservation."""

    def __init__(self) -> None:
        super().__init__()
        self.table = SlotTable()
        self.model: dict[str, tuple[str, float]] = {}

    @rule(request_id=REQUEST_IDS, chain=CHAINS, deadline=TIMES, slots=st.integers(1, 3))
    def reserve(self, request_id: str, chain: str, deadline: float, slots: int) -> None:
        self.model.pop(request_id, None)
        fits = Counter(c for c, _ in self.model.values())[chain] < slots
        assert self.table.reserve(request_id, chain, slots, deadline) == fits
        if fits:
            self.model[request_id] = (chain, deadline)

    @rule(request_id=REQUEST_IDS)
    def release(self, request_id: str) -> None:
        expected = self.model.pop(request_id, None)
        assert self.table.release(request_id) == (expected[0] if expected else None)

    @rule(now=TIMES)
    def expire(self, now: float) -> None:
        passed = {r for r, (_, d) in self.model.items() if d <= now}
        assert set(self.table.expire(now)) == passed
        for request_id in passed:
            del self.model[request_id]

    @rule(chain=CHAINS)
    def chain_leaves(self, chain: str) -> None:
        self.table.retain_chains({"a", "b", "c"} - {chain})
        self.model = {r: e for r, e in self.model.items() if e[0] != chain}

    @invariant()
    def counts_match(self) -> None:
        expected = Counter(c for c, _ in self.model.values())
        for chain in ("a", "b", "c"):
            assert self.table.used(chain) == expected[chain]
        assert len(self.table) == len(self.model) == self.table.total_used()


SlotTableMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSlotTableStateful = SlotTableMachine.TestCase


# --- CentralQueue ---------------------------------------------------------------------


def test_queue_orders_by_class_then_arrival_and_is_bounded() -> None:
    queue = CentralQueue(max_length=4)
    for request_id, priority in (("low1", 0), ("high1", 5), ("low2", 0), ("high2", 5)):
        assert queue.push(request(request_id, priority=priority), NOW_WALL, NOW_WALL + 10) is not None
    assert queue.full and queue.push(request("x"), NOW_WALL, NOW_WALL + 10) is None
    assert [e.request_id for e in queue.in_order()] == ["high1", "high2", "low1", "low2"]
    taken = queue.remove("high1")
    assert taken is not None and "high1" not in queue
    queue.restore(taken)  # back at its original place
    assert [e.request_id for e in queue.in_order()][0] == "high1"
    assert queue.lengths() == {5: 2, 0: 2}


def test_queue_expiry_and_duplicates() -> None:
    queue = CentralQueue(max_length=10)
    queue.push(request("a"), NOW_WALL, NOW_WALL + 1)
    assert queue.push(request("a"), NOW_WALL, NOW_WALL + 5) is None  # already waiting
    queue.push(request("b"), NOW_WALL, NOW_WALL + 5)
    assert [e.request_id for e in queue.expire(NOW_WALL + 1)] == ["a"]
    assert len(queue) == 1 and queue.oldest_enqueued_at() == NOW_WALL


# --- BalancerService.route ------------------------------------------------------------

TTL = 3.0
NOW_MONO = 1000.0


class Clock:
    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self) -> float:
        return self.value


def make_balancer(*heartbeats, policy: str = "jffc_per_request", max_wait_s: float = 30.0, **slots):
    view = ClusterView(TTL)
    core = router(policy, **slots)
    core._queue_settings = QueueSettings(max_wait_s=max_wait_s)
    for hb in heartbeats:
        view.observe(hb, NOW_MONO)
        core.builder.observe(hb)
    mono, wall = Clock(NOW_MONO), Clock(NOW_WALL)
    s = balancer_settings(policy, **slots)
    service = BalancerService(
        None, view, core, LocalSlotStore(), s, BalancerMetrics(), SlotRates(s.slots), clock=mono, wall_clock=wall  # type: ignore[arg-type]
    )
    return service, mono, wall


def route_request(request_id: str = "r1", model: str = "m", timeout_s: float = 60.0, exclude: list[str] | None = None) -> RouteRequest:
    return request(request_id, model=model, timeout_s=timeout_s, exclude=exclude, blocks=0)


def finished(request_id: str, worker_id: str = "a") -> RequestFinished:
    return RequestFinished(request_id=request_id, worker_id=worker_id, finish_reason="stop", usage=Usage(1, 1), duration_s=0.1)


async def test_route_to_the_only_node() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"))
    reply = await balancer.route(route_request())
    assert isinstance(reply, RouteDecision)
    assert (reply.request_id, reply.worker_id, reply.inbox, reply.policy) == ("r1", "a", "inbox.a", "jffc_per_request")


async def test_model_not_found() -> None:
    balancer, _, _ = make_balancer(heartbeat("a", model="other"))
    reply = await balancer.route(route_request(model="m"))
    assert isinstance(reply, ErrorReply)
    assert (reply.status, reply.code) == (404, "model_not_found")
    assert "'m'" in reply.message


async def test_empty_cluster_is_model_not_found() -> None:
    balancer, _, _ = make_balancer()
    reply = await balancer.route(route_request())
    assert isinstance(reply, ErrorReply) and reply.status == 404


async def test_stale_nodes_are_not_routed_to() -> None:
    balancer, mono, _ = make_balancer(heartbeat("a"))
    mono.value = NOW_MONO + TTL + 1
    reply = await balancer.route(route_request())
    assert isinstance(reply, ErrorReply) and reply.code == "model_not_found"


async def test_all_draining_is_503() -> None:
    balancer, _, _ = make_balancer(heartbeat("a", draining=True), heartbeat("b", draining=True))
    reply = await balancer.route(route_request())
    assert isinstance(reply, ErrorReply)
    assert (reply.status, reply.code, reply.retry_after_s) == (503, "no_capacity", 1.0)


async def test_draining_node_is_skipped() -> None:
    balancer, _, _ = make_balancer(heartbeat("a", draining=True), heartbeat("b", running=10))
    for i in range(3):
        reply = await balancer.route(route_request(f"r{i}"))
        assert isinstance(reply, RouteDecision) and reply.worker_id == "b"


async def test_excluded_workers_are_honoured() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), heartbeat("b", running=50))
    for i in range(3):
        reply = await balancer.route(route_request(f"r{i}", exclude=["a"]))
        assert isinstance(reply, RouteDecision) and reply.worker_id == "b"


async def test_a_node_the_watcher_hears_is_routed_to_at_once() -> None:
    """Routable nodes are reused between heartbeats, but never past one the cluster watcher just recorded."""
    balancer, mono, _ = make_balancer(heartbeat("a"))
    watcher = ClusterWatcher(None, None, balancer._view, 3600.0, clock=mono)  # type: ignore[arg-type]
    watcher.add_heartbeat_listener(balancer.heard)
    refused = await balancer.route(route_request("r1", exclude=["a"]))
    assert isinstance(refused, ErrorReply) and refused.code == "no_capacity"
    watcher.heard(heartbeat("b"))
    reply = await balancer.route(route_request("r2", exclude=["a"]))
    assert isinstance(reply, RouteDecision) and reply.worker_id == "b"


async def test_every_worker_excluded_is_503() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), heartbeat("b"))
    reply = await balancer.route(route_request(exclude=["a", "b"]))
    assert isinstance(reply, ErrorReply)
    assert (reply.status, reply.code, reply.retry_after_s) == (503, "no_capacity", 1.0)


async def test_a_request_no_node_could_hold_is_refused_not_queued() -> None:
    # Found by the NATS fuzzer: such a route request used to wait in the queue until its deadline.
    balancer, _, _ = make_balancer(heartbeat("a"), heartbeat("b"))  # max_model_len 4096
    reply = await balancer.route(request("big", prompt=4000, output=97, blocks=0))
    assert isinstance(reply, ErrorReply)
    assert (reply.status, reply.code) == (400, "context_length_exceeded")
    assert not balancer.router.queue and isinstance(await balancer.route(request("fits", prompt=4000, output=96, blocks=0)),
                                                    RouteDecision)


async def test_deadline_passed_is_504() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"))
    reply = await balancer.route(route_request(timeout_s=0.0))
    assert isinstance(reply, ErrorReply)
    assert (reply.status, reply.code) == (504, "deadline_exceeded")


@pytest.mark.parametrize("policy", ["least_loaded", "jffc", "jffc_per_request"])
async def test_successive_routes_spread_over_idle_nodes(policy: str) -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), heartbeat("b"), policy=policy)
    picks = []
    for i in range(6):
        reply = await balancer.route(route_request(f"r{i}"))
        assert isinstance(reply, RouteDecision)
        picks.append(reply.worker_id)
    assert Counter(picks) == {"a": 3, "b": 3}


async def test_least_loaded_node_wins_until_reservations_even_out() -> None:
    balancer, _, _ = make_balancer(heartbeat("a", running=2), heartbeat("b"), policy="least_loaded")
    picks = [(await balancer.route(route_request(f"r{i}"))).worker_id for i in range(4)]  # type: ignore[union-attr]
    # b has load 0, 1 then 2 (reservations > running+waiting); a stays at 2.
    assert picks[:2] == ["b", "b"]
    assert sorted(picks[2:]) == ["a", "b"]


async def test_a_re_route_releases_the_earlier_reservation() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), heartbeat("b"), max_per_chain=1)
    first = await balancer.route(route_request("r1"))
    assert isinstance(first, RouteDecision)
    retry = await balancer.route(route_request("r1", exclude=[first.worker_id]))
    assert isinstance(retry, RouteDecision) and retry.worker_id != first.worker_id
    assert balancer.router.table.total_used() == 1
    # The first worker's slot is free again for someone else.
    other = await balancer.route(route_request("r2"))
    assert isinstance(other, RouteDecision) and other.worker_id == first.worker_id


async def test_a_queued_request_takes_the_next_slot_that_frees() -> None:
    balancer, _, wall = make_balancer(heartbeat("a"), max_per_chain=1)
    first = await balancer.route(route_request("r1"))
    assert isinstance(first, RouteDecision) and first.queued_s == 0.0
    waiting = asyncio.create_task(balancer.route(route_request("r2")))
    await until(lambda: len(balancer.router.queue) == 1, 5.0, "r2 queued", every_s=0.001)
    assert not waiting.done()
    wall.value += 2.5
    balancer._on_finished(finished("r1"), None)  # type: ignore[arg-type]
    reply = await asyncio.wait_for(waiting, 1.0)
    assert isinstance(reply, RouteDecision) and reply.request_id == "r2"
    assert reply.queued_s == 2.5  # what ingress reports as vllm:request_queue_time_seconds
    balancer._on_finished(finished("r2"), None)  # type: ignore[arg-type]
    assert balancer.router.table.total_used() == 0


async def test_a_request_past_its_queue_deadline_gets_503_with_retry_after() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), max_per_chain=1, max_wait_s=0.05)
    assert isinstance(await balancer.route(route_request("r1")), RouteDecision)
    reply = await balancer.route(route_request("r2"))
    assert isinstance(reply, ErrorReply)
    assert (reply.status, reply.code, reply.retry_after_s) == (503, "queue_timeout", 1.0)
    assert len(balancer.router.queue) == 0


async def test_a_full_queue_refuses_at_once() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), max_per_chain=1)
    balancer.router.queue._max_length = 1
    await balancer.route(route_request("r1"))
    waiting = asyncio.create_task(balancer.route(route_request("r2")))
    await until(lambda: len(balancer.router.queue) == 1, 5.0, "r2 queued", every_s=0.001)
    reply = await balancer.route(route_request("r3"))
    assert isinstance(reply, ErrorReply) and (reply.status, reply.code) == (503, "queue_full")
    await balancer.stop()
    stopped = await waiting
    assert isinstance(stopped, ErrorReply) and stopped.code == "balancer_stopping"


async def test_reservations_expire_at_the_deadline_and_when_the_node_leaves() -> None:
    balancer, mono, wall = make_balancer(heartbeat("a"), heartbeat("b"))
    await balancer.route(route_request("short", timeout_s=5.0))
    await balancer.route(route_request("long", timeout_s=500.0))
    assert balancer.router.table.total_used() == 2
    wall.value = NOW_WALL + 5
    await balancer.tick()
    assert balancer.router.table.total_used() == 1
    mono.value = NOW_MONO + TTL + 1  # both nodes stop heartbeating
    await balancer.tick()
    assert balancer.router.table.total_used() == 0


class FlakyStore(LocalSlotStore):
    """A store that is down until `up` is set, recording what it is told afterwards."""

    def __init__(self) -> None:
        self.up = False
        self.restored: list[tuple[str, str]] = []

    async def reserve(self, request_id, chain_id, slots, expires_at):
        if not self.up:
            raise ConnectionError("redis down")
        self.restored.append((request_id, chain_id))
        return True, -1

    async def usage(self, chain_ids, now):
        if not self.up:
            raise ConnectionError("redis down")
        return {}


async def test_a_store_outage_falls_back_to_local_counts_and_restores_holds() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), max_per_chain=1)
    store = balancer._store = FlakyStore()
    first = await balancer.route(route_request("r1"))
    assert isinstance(first, RouteDecision)  # served, counted locally
    waiting = asyncio.create_task(balancer.route(route_request("r2")))
    await until(lambda: len(balancer.router.queue) == 1, 5.0, "r2 queued", every_s=0.001)
    assert not waiting.done()  # the local count still enforces the slot
    store.up = True
    await balancer.tick()
    assert store.restored == [("r1", first.worker_id and balancer.router.table.holder("r1"))]
    balancer._on_finished(finished("r1"), None)  # type: ignore[arg-type]
    assert isinstance(await asyncio.wait_for(waiting, 1.0), RouteDecision)


# --- cache-aware dequeue ----------------------------------------------------------------


def _queued(r, request_id: str, hashes: list[int], at: float) -> None:
    r.queue.push(msgspec.structs.replace(request(request_id), block_hashes=hashes), at, at + 30)


def test_a_freed_slot_goes_to_the_queued_request_its_node_caches_unless_one_was_overtaken_too_often() -> None:
    # The count alone bounds overtakes here: the departures' worth (tests/unit/test_overtake_bound.py) stays below it.
    r = router(max_per_chain=1, queue=QueueSettings(cache_aware_max_skips=2, cache_aware_max_delay_s=0.001))
    heartbeats = [heartbeat("w0"), heartbeat("w1")]
    r.table.reserve("running", r.builder.facts(heartbeats[0]).chain_id, 1, NOW_WALL + 60)  # w0 is full
    r.index.apply("w1", stored=[1, 2, 3, 4])
    r.index.apply("w0", stored=[5, 6, 7, 8])
    _queued(r, "old", [5, 6, 7, 8], NOW_WALL)  # cached, but on the busy node
    _queued(r, "plain", [9, 10, 11, 12], NOW_WALL + 0.1)
    for index in range(3):
        _queued(r, f"match{index}", [1, 2, 3, 4], NOW_WALL + 0.2 + index)

    def order() -> list[str]:
        return [e.request_id for e in r.dequeue_order(lambda model: heartbeats)]

    assert order() == ["match0", "match1", "match2", "old", "plain"]
    w1 = r.builder.facts(heartbeats[1])
    for served in ("match0", "match1"):
        placed = r.dispatch_queued(lambda model: heartbeats)
        assert [(entry.request_id, p.chain.worker_id) for entry, p in placed] == [(served, "w1")]
        r.finished(served, "w1")
        assert w1.chain_id not in r.table.chains()
    # "old" and "plain" have now been overtaken twice (the bound): they go first, oldest first.
    assert order() == ["old", "plain", "match2"]


@pytest.mark.parametrize("cache_aware, first", [(False, "old"), (True, "match")])
def test_without_cache_aware_dequeue_the_oldest_goes_first(cache_aware: bool, first: str) -> None:
    r = router(queue=QueueSettings(cache_aware_dequeue=cache_aware))
    r.index.apply("w0", stored=[1, 2])
    _queued(r, "old", [7, 8], NOW_WALL)
    _queued(r, "match", [1, 2], NOW_WALL + 0.1)
    heartbeats = [heartbeat("w0")]
    assert r.dequeue_order(lambda model: heartbeats)[0].request_id == first
