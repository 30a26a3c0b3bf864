"""A request waits, for a bounded time, for a busy node caching its prompt (`Router.holds_for_cache`).

Two nodes of one slot each: w0 caches the request's whole prompt but is
full, w1 is free and caches none or some of it. Each test runs on the
chain index and on the snapshot path, which must decide alike.
"""

from __future__ import annotations

import msgspec
import pytest

from services.balancer.router import Placement, Queued, Router
from shared.config import DegradationSettings, JffcPerRequestSettings, QueueSettings
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, request, router

PROMPT = list(range(1, 9))  # 8 blocks
HEARTBEATS = [heartbeat("w0"), heartbeat("w1")]


class Clock:
    def __init__(self) -> None:
        self.now = NOW_WALL

    def __call__(self) -> float:
        return self.now


def _router(clock: Clock, use_index: bool, policy: str = "jffc_per_request", share: float = 0.25,
            free_node_caches: int = 0, queue_length: int = 64, degradation: DegradationSettings | None = None) -> Router:
    r = router(policy, queue_length=queue_length, queue=QueueSettings(cache_aware_max_delay_s=2.0),
               jffc=JffcPerRequestSettings(cache_hold_share=share), clock=clock, use_index=use_index,
               degradation=degradation, max_per_chain=1)
    r.index.apply("w0", stored=PROMPT)
    if free_node_caches:
        r.index.apply("w1", stored=PROMPT[:free_node_caches])
    r.table.reserve("running", r.builder.facts(HEARTBEATS[0]).chain_id, 1, NOW_WALL + 60)  # w0 is full
    return r


def _admit(r: Router, clock: Clock) -> Placement | Queued:
    outcome = r.admit(msgspec.structs.replace(request("r", prompt=128), block_hashes=PROMPT), HEARTBEATS, clock.now)
    assert isinstance(outcome, Placement | Queued)
    return outcome


def _placed(r: Router) -> list[tuple[str, str]]:
    return [(entry.request_id, p.chain.worker_id) for entry, p in r.dispatch_queued(lambda model: HEARTBEATS)]


@pytest.mark.parametrize("use_index", [True, False])
def test_a_request_waits_for_the_busy_node_caching_its_prompt_and_takes_it_when_it_frees(use_index: bool) -> None:
    clock = Clock()
    r = _router(clock, use_index)
    assert isinstance(_admit(r, clock), Queued)
    assert r.cache_holds == 1
    clock.now += 0.5
    assert _placed(r) == []  # still held: w1 is free but caches nothing of it
    assert r.cache_holds == 1  # one request held, however often the queue is drained
    r.finished("running", "w0")
    assert _placed(r) == [("r", "w0")]


@pytest.mark.parametrize("use_index", [True, False])
def test_the_wait_ends_after_the_cache_aware_delay_bound_on_whichever_node_is_free(use_index: bool) -> None:
    clock = Clock()
    r = _router(clock, use_index)
    assert isinstance(_admit(r, clock), Queued)
    clock.now += 2.01
    assert _placed(r) == [("r", "w1")]


@pytest.mark.parametrize("use_index", [True, False])
@pytest.mark.parametrize("share, free_node_caches", [
    (0.0, 0),  # holding is off
    (0.25, 7),  # the free node caches all but 1/8 of the prompt: less than the share to gain by waiting
])
def test_no_wait_when_off_or_when_a_free_node_caches_nearly_as_much(use_index: bool, share: float, free_node_caches: int) -> None:
    clock = Clock()
    r = _router(clock, use_index, share=share, free_node_caches=free_node_caches)
    placed = _admit(r, clock)
    assert isinstance(placed, Placement) and placed.chain.worker_id == "w1"
    assert r.cache_holds == 0


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "prefix_affinity", "kv_cost", "jffc"])
def test_only_jffc_per_request_waits_for_a_cache(policy: str) -> None:
    clock = Clock()
    placed = _admit(_router(clock, True, policy=policy), clock)
    assert isinstance(placed, Placement) and placed.chain.worker_id == "w1"


def test_a_request_that_no_node_caches_is_never_held() -> None:
    clock = Clock()
    r = _router(clock, True)
    outcome = r.admit(msgspec.structs.replace(request("r", prompt=128), block_hashes=[90, 91]), HEARTBEATS, clock.now)
    assert isinstance(outcome, Placement) and outcome.chain.worker_id == "w1"


@pytest.mark.parametrize("use_index", [True, False])
def test_a_held_request_takes_the_free_node_rather_than_be_refused_by_a_full_queue(use_index: bool) -> None:
    clock = Clock()
    r = _router(clock, use_index, queue_length=0)
    placed = _admit(r, clock)
    assert isinstance(placed, Placement) and placed.chain.worker_id == "w1"
    assert r.cache_holds == 0


@pytest.mark.parametrize("use_index", [True, False])
def test_a_held_request_is_not_shortened_as_if_the_fleet_were_overloaded(use_index: bool) -> None:
    # No departures measured yet: the queue's predicted wait is unbounded, which shortens any request that
    # queues for want of a slot; a held one has a free slot and keeps its max_tokens.
    clock = Clock()
    r = _router(clock, use_index, degradation=DegradationSettings(reduce_max_tokens=True, below_priority=5))
    queued = r.admit(msgspec.structs.replace(request("r", prompt=128, output=64), block_hashes=PROMPT), HEARTBEATS, clock.now)
    assert isinstance(queued, Queued) and queued.entry.request.max_tokens == 64
    assert r.degradation.counts["max_tokens"] == 0
