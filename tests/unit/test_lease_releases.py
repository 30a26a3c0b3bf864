"""Who frees a finished request's KV lease: the balancers with their slots, or the cache-managers, from one setting;
and on a two-node chain, which node's slot and lease a finish frees."""

from __future__ import annotations

import msgspec
import pytest

from contracts import subjects
from contracts.messages import RouteDecision
from services.balancer.slot_store import LocalSlotStore
from services.cache_manager.metrics import CacheMetrics
from services.cache_manager.service import CacheManagerService
from shared.cluster import ClusterView
from shared.config import BalancerSettings, CacheManagerSettings, KvlaneConfig, SlotSettings, load_config
from tests.unit.balancer_fixtures import heartbeat, request
from tests.unit.test_balancer_core import finished, make_balancer
from tests.waiting import until


class RecordingStore(LocalSlotStore):
    def __init__(self) -> None:
        self.released: list[tuple[str, str, str | None]] = []

    async def release_many(self, releases, chains=None):
        self.released += [(*release, chain) for release, chain in zip(releases, chains or [None] * len(releases), strict=True)]
        return [None] * len(releases)


@pytest.mark.parametrize(("allocate_kv", "store", "balancer_releases"), [
    (True, "redis", True), (True, "local", False), (False, "redis", False), (False, "local", False),
])
def test_exactly_one_service_frees_leases_whatever_the_config(allocate_kv: bool, store: str, balancer_releases: bool) -> None:
    settings = BalancerSettings(allocate_kv=allocate_kv, slots=SlotSettings(store=store))  # type: ignore[arg-type]
    assert settings.releases_kv_leases == balancer_releases


def test_the_setting_is_read_from_the_environment_like_any_other() -> None:
    config = load_config(env={"KVLANE__BALANCER__SLOTS__STORE": "local"})
    assert not config.balancer.releases_kv_leases and KvlaneConfig().balancer.releases_kv_leases


class SubscribingBus:
    def __init__(self) -> None:
        self.subjects: list[str] = []

    async def subscribe(self, subject: str, *_: object, **__: object) -> None:
        self.subjects.append(subject)


class EmptyLedger:
    lease_ttl_s = 10.0

    async def reap(self, live_worker_ids=(), limit=500) -> list[str]:
        return []


@pytest.mark.parametrize("releases_finished", [True, False])
async def test_the_cache_manager_hears_finishes_only_where_it_frees_their_leases(releases_finished: bool) -> None:
    bus = SubscribingBus()
    service = CacheManagerService(CacheManagerSettings(), bus, ClusterView(3.0), EmptyLedger(), CacheMetrics(), "c0",  # type: ignore[arg-type]
                                  releases_finished=releases_finished)
    await service.start()
    try:
        assert (subjects.REQUEST_FINISHED in bus.subjects) == releases_finished
        assert subjects.ROUTE_WITHDRAWN in bus.subjects  # withdrawn routes' leases: either way
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
