"""Greedy allocation, pools, victim choice and pre-warm planning (pure core)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.kv.allocation import (
    Demand,
    NodeCapacity,
    RunningLease,
    choose_victims,
    is_short,
    need_blocks,
    rank,
    retention_value,
)
from services.cache_manager.prewarm import HotPrefixTracker, plan_prewarms
from shared.config import CacheManagerSettings

POLICY = CacheManagerSettings(short_pool_share=0.25, short_request_tokens=256, length_penalty_tokens=1024)


def node(worker_id: str, total: int = 100, general: int = 0, short: int = 0) -> NodeCapacity:
    return NodeCapacity(worker_id, total, 16, general, short)


def test_need_counts_only_uncached_blocks_and_at_least_one() -> None:
    demand = Demand("r", prompt_tokens=64, max_tokens=32)
    assert need_blocks(demand, 16, 0, POLICY) == 6
    assert need_blocks(demand, 16, 4, POLICY) == 2
    assert need_blocks(demand, 16, 99, POLICY) == 1


def test_output_reserve_is_capped() -> None:
    capped = CacheManagerSettings(output_reserve_cap=16)
    assert need_blocks(Demand("r", 32, 4000), 16, 0, capped) == 3


def test_cached_prefix_wins_over_an_idle_node() -> None:
    demand = Demand("r", prompt_tokens=512, max_tokens=32)
    plans = rank(demand, [node("idle"), node("warm", general=10)], {"warm": 32}, POLICY)
    assert [p.worker_id for p in plans] == ["warm", "idle"]
    assert plans[0].cached_blocks == 32 and plans[0].blocks == 2


def test_less_loaded_node_wins_when_nothing_is_cached() -> None:
    plans = rank(Demand("r", 64, 16), [node("busy", general=60), node("calm", general=5)], {}, POLICY)
    assert [p.worker_id for p in plans] == ["calm", "busy"]


def test_long_requests_cannot_use_the_short_pool() -> None:
    # 75 general blocks all used; the 25-block short pool is empty.
    full = node("n", general=75)
    assert rank(Demand("long", 1024, 64), [full], {}, POLICY) == []
    short_plan = rank(Demand("short", 64, 16), [full], {}, POLICY)
    assert short_plan[0].pool == "short"


def test_short_requests_fall_back_to_general_when_their_pool_is_full() -> None:
    plans = rank(Demand("short", 64, 16), [node("n", short=25)], {}, POLICY)
    assert plans[0].pool == "general"
    assert is_short(Demand("s", 100, 100), POLICY) and not is_short(Demand("l", 200, 100), POLICY)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 400), st.integers(0, 300), st.integers(0, 100)), min_size=1, max_size=6),
    st.integers(1, 3000),
    st.integers(1, 500),
    st.floats(0.1, 10),
)
def test_every_ranked_plan_fits_its_pool(raw_nodes, prompt, max_tokens, priority) -> None:
    nodes = []
    for i, (total, general, short) in enumerate(raw_nodes):
        short_pool = int(total * POLICY.short_pool_share)
        nodes.append(NodeCapacity(f"n{i}", total, 16, min(general, total - short_pool), min(short, short_pool)))
    demand = Demand("r", prompt, max_tokens, priority)
    plans = rank(demand, nodes, {}, POLICY)
    utilities = [p.utility for p in plans]
    assert utilities == sorted(utilities, reverse=True)
    for plan in plans:
        chosen = next(n for n in nodes if n.worker_id == plan.worker_id)
        free_general, free_short = chosen.free(POLICY)
        assert plan.blocks <= (free_short if plan.pool == "short" else free_general)
        assert plan.pool == "general" or is_short(demand, POLICY)


def lease(rid: str, blocks: int, priority: float = 1.0, generated: int = 0, max_tokens: int = 100, at: float = 0.0) -> RunningLease:
    return RunningLease(rid, "n", blocks, "general", priority, max_tokens, generated, at)


def test_victim_is_the_lowest_retention_lease() -> None:
    leases = [lease("keep", 4, priority=5.0), lease("cheap", 8, priority=1.0, generated=10), lease("big", 20, priority=1.0)]
    victims = choose_victims(leases, needed_blocks=10, free_blocks=0, newcomer_priority=3.0, policy=POLICY)
    assert [v.request_id for v in victims] == ["big"]
    assert retention_value(leases[2], 10) < retention_value(leases[1], 10) < retention_value(leases[0], 10)


def test_no_preemption_when_the_newcomer_is_not_worth_it() -> None:
    leases = [lease("vip", 4, priority=9.0)]
    assert choose_victims(leases, 4, 0, newcomer_priority=1.0, policy=POLICY) is None
    # Equals never preempt each other, however cheap the victim looks.
    assert choose_victims([lease("peer", 40, priority=1.0, generated=99)], 4, 0, newcomer_priority=1.0, policy=POLICY) is None
    assert choose_victims([lease("small", 1)], 10, 0, newcomer_priority=9.0, policy=POLICY) is None  # not enough room


def test_lru_evicts_the_oldest_lower_priority_lease() -> None:
    lru = CacheManagerSettings(eviction="lru")
    leases = [lease("new", 5, at=2.0), lease("old", 5, at=1.0)]
    assert [v.request_id for v in choose_victims(leases, 5, 0, 2.0, lru)] == ["old"]
    assert choose_victims(leases, 5, 0, 1.0, lru) is None


def test_hot_prefix_needs_enough_hits_in_the_window() -> None:
    tracker = HotPrefixTracker(window_s=10, min_hits=3)
    for t in (0.0, 1.0, 2.0):
        tracker.observe((1, 2), (5,) * 32, t)
    assert [p.hits for p in tracker.hot(2.5)] == [3]
    assert tracker.hot(11.5) == []


def test_prewarm_goes_to_the_idlest_node_only_when_every_holder_is_busy() -> None:
    tracker = HotPrefixTracker(window_s=10, min_hits=1)
    tracker.observe((1, 2), (5,) * 32, 0.0)
    hot = tracker.hot(0.0)
    matches = {2: {"a": 2, "b": 1}}
    plans = plan_prewarms(hot, matches, {"a": 0.9, "b": 0.1, "c": 0.2}, 0.7, 0.3, set())
    assert [(p.prefix.key, p.target) for p in plans] == [(2, "b")]
    assert plan_prewarms(hot, matches, {"a": 0.5, "b": 0.1}, 0.7, 0.3, set()) == []
    assert plan_prewarms(hot, matches, {"a": 0.9, "b": 0.1}, 0.7, 0.3, {(2, "b")}) == []
    assert plan_prewarms(hot, {}, {"a": 0.9, "b": 0.1}, 0.7, 0.3, set()) == []
