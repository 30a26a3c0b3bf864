"""The cache-aware dequeue's bound on overtakes grows with the rate slots free (Router.overtake_bound)."""

from __future__ import annotations

import msgspec

from services.balancer.router import Router
from shared.config import QueueSettings
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, request, router


def _router_at(now: float) -> Router:
    r = router(max_per_chain=1, queue=QueueSettings(cache_aware_max_skips=2, cache_aware_max_delay_s=0.5))
    r.builder.clock = lambda: now
    return r


def _depart(r: Router, count: int, over_s: float) -> None:
    for i in range(count):
        r.degradation.departures.note(NOW_WALL - over_s + over_s * i / count)


def test_the_bound_is_the_configured_count_until_slots_free_faster_than_it_per_max_delay() -> None:
    r = _router_at(NOW_WALL)
    assert r.overtake_bound() == 2
    _depart(r, 3, over_s=1.0)  # 3 per second: 1.5 within the 0.5 s delay, under the floor
    assert r.overtake_bound() == 2
    _depart(r, 97, over_s=1.0)
    assert r.overtake_bound() == 0.5 * 100


def test_by_default_a_queued_request_may_be_overtaken_for_two_seconds_of_departures() -> None:
    r = router(max_per_chain=1)
    r.builder.clock = lambda: NOW_WALL
    _depart(r, 100, over_s=1.0)
    assert r.overtake_bound() == 2.0 * 100


def test_under_load_a_freed_slot_still_goes_to_the_request_its_node_caches_after_the_configured_count() -> None:
    r = _router_at(NOW_WALL)
    _depart(r, 100, over_s=1.0)  # the bound: 50 overtakes
    heartbeats = [heartbeat("w0"), heartbeat("w1")]
    r.table.reserve("running", r.builder.facts(heartbeats[0]).chain_id, 1, NOW_WALL + 60)  # w0 is full
    r.index.apply("w1", stored=[1, 2, 3, 4])
    r.index.apply("w0", stored=[5, 6, 7, 8])
    for request_id, hashes, at in (("old", [5, 6, 7, 8], 0.0), ("plain", [9, 10, 11, 12], 0.1), ("match0", [1, 2, 3, 4], 0.2),
                                   ("match1", [1, 2, 3, 4], 0.3), ("match2", [1, 2, 3, 4], 0.4)):
        r.queue.push(msgspec.structs.replace(request(request_id), block_hashes=hashes), NOW_WALL - 1 + at, NOW_WALL + 30)
    for served in ("match0", "match1"):
        placed = r.dispatch_queued(lambda model: heartbeats)
        assert [(entry.request_id, p.chain.worker_id) for entry, p in placed] == [(served, "w1")]
        r.finished(served, "w1")
    # Overtaken twice, the configured count, but far from what 100 departures a second allow.
    assert [e.request_id for e in r.dequeue_order(lambda model: heartbeats)] == ["match2", "old", "plain"]
