"""The balancer frees every KV lease it takes, with the request's slot, whatever the slot store; the cache-manager
no longer hears finished requests. And on a two-node chain, which node's slot and lease a finish frees."""

from __future__ import annotations

import msgspec

from contracts import subjects
from contracts.messages import RouteDecision
from services.balancer.allocation import KvAllocator
from services.balancer.slot_store import LocalSlotStore
from services.cache_manager.metrics import CacheMetrics
from services.cache_manager.service import CacheManagerService
from shared.cluster import ClusterView
from shared.config import CacheManagerSettings
from tests.unit.balancer_fixtures import heartbeat, request
from tests.unit.test_balancer_core import finished, make_balancer
from tests.waiting import until


class RecordingStore(LocalSlotStore):
    def __init__(self) -> None:
        super().__init__()
        self.released: list[tuple[str, str, str | None]] = []

    async def release_many(self, releases, chains=None):
        self.released += [(*release, chain) for release, chain in zip(releases, chains or [None] * len(releases), strict=True)]
        return [None] * len(releases)


class RecordingLedger:
    """The ledger's release as the allocator calls it."""

    lease_ttl_s = 10.0

    def __init__(self, fails: bool = False) -> None:
        self.released: list[tuple[str, str]] = []
        self._fails = fails

    async def release_many(self, releases):
        if self._fails:
            raise ConnectionError("Redis is down")
        self.released += releases
        return [None] * len(releases)


def leasing_local_store(ledger: RecordingLedger) -> LocalSlotStore:
    """A single balancer's local slot store, wired to its allocator as the balancer's main wires it."""
    return LocalSlotStore(KvAllocator(None, 2.0, ledger).release_many)  # type: ignore[arg-type]


async def test_a_local_slot_stores_release_frees_the_leases_through_the_allocator() -> None:
    ledger = RecordingLedger()
    store = leasing_local_store(ledger)
    assert await store.release_many([("r1", "a"), ("r2", "b")], ["a@1", None]) == [None, None]
    assert await store.release("r3", "a") is None
    assert ledger.released == [("r1", "a"), ("r2", "b"), ("r3", "a")]
    assert await store.release_many([]) == [] and len(ledger.released) == 3


async def test_a_lease_the_ledger_cannot_free_now_is_left_to_expire() -> None:
    store = leasing_local_store(RecordingLedger(fails=True))
    assert await store.release_many([("r1", "a")], ["a@1"]) == [None]  # the slot's release goes on


async def test_a_single_balancer_frees_the_lease_of_each_request_it_placed_when_it_finishes() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), heartbeat("b"))
    ledger = RecordingLedger()
    balancer._store = leasing_local_store(ledger)
    decision = await balancer.route(request("r1", blocks=0))
    assert isinstance(decision, RouteDecision)
    balancer._on_finished(finished("r1", decision.worker_id), None)  # type: ignore[arg-type]
    await until(lambda: ledger.released, 5.0, "the lease's release reached the ledger", every_s=0.001)
    assert ledger.released == [("r1", decision.worker_id)]
    # Routed again away from a node that failed it: the lease there goes with the slot.
    ledger.released.clear()
    second = await balancer.route(request("r2", blocks=0))
    assert isinstance(second, RouteDecision)
    resumed = await balancer.route(msgspec.structs.replace(request("r2", blocks=0), exclude_workers=[second.worker_id]))
    assert isinstance(resumed, RouteDecision) and resumed.worker_id != second.worker_id
    assert ledger.released == [("r2", second.worker_id)]
    await balancer.stop()


class SubscribingBus:
    def __init__(self) -> None:
        self.subjects: list[str] = []

    async def subscribe(self, subject: str, *_: object, **__: object) -> None:
        self.subjects.append(subject)


class EmptyLedger:
    lease_ttl_s = 10.0

    async def reap(self, live_worker_ids=(), limit=500) -> list[str]:
        return []


async def test_the_cache_manager_leaves_finished_requests_leases_to_the_balancers() -> None:
    bus = SubscribingBus()
    service = CacheManagerService(CacheManagerSettings(), bus, ClusterView(3.0), EmptyLedger(), CacheMetrics(), "c0")  # type: ignore[arg-type]
    await service.start()
    try:
        assert subjects.REQUEST_FINISHED not in bus.subjects
        # A withdrawn route's lease a preemption granted may land after the balancer's release: that one it frees.
        assert subjects.ROUTE_WITHDRAWN in bus.subjects
        assert subjects.CACHE_RENEW in bus.subjects  # and it still renews, and reaps (`EmptyLedger.reap`)
    finally:
        await service.stop()


async def test_a_prefill_node_that_never_handed_over_frees_its_decode_nodes_slot_and_lease() -> None:
    balancer, _, _ = make_balancer(heartbeat("d0", role="decode"), heartbeat("p0", role="prefill"))
    store = balancer._store = RecordingStore()
    decision = await balancer.route(request("r1", prompt=1024, blocks=64))
    assert isinstance(decision, RouteDecision) and (decision.worker_id, decision.prefill_worker_id) == ("d0", "p0")
    balancer._on_finished(finished("r1", "p0"), None)  # type: ignore[arg-type]
    await until(lambda: store.released, 5.0, "the release reached the store", every_s=0.001)
    assert store.released == [("r1", "d0", balancer.router.builder.facts(heartbeat("d0", role="decode")).chain_id)]
    assert balancer.router.table.holder("r1") is None
    await balancer.stop()


async def test_the_late_end_of_an_attempt_resumed_elsewhere_keeps_the_new_slot() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), heartbeat("b"))
    store = balancer._store = RecordingStore()
    first = await balancer.route(request("r1", blocks=0))
    assert isinstance(first, RouteDecision)
    resumed = await balancer.route(msgspec.structs.replace(request("r1", blocks=0), exclude_workers=[first.worker_id]))
    assert isinstance(resumed, RouteDecision) and resumed.worker_id != first.worker_id
    store.released.clear()
    balancer._on_finished(finished("r1", first.worker_id), None)  # type: ignore[arg-type]
    await until(lambda: store.released, 5.0, "the release reached the store", every_s=0.001)
    # Only what the first node may still hold there: the resumed attempt's slot and lease stay.
    assert store.released == [("r1", first.worker_id, None)]
    assert balancer.router.table.holder("r1") is not None
    await balancer.stop()
