"""Chains and slots (GCA pairing), trackers, and the JFFC response-time bounds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.balancer.bounds import ChainRate, candidate_caps, mean_response, recommend_slots, response_bounds
from services.balancer.chains import PairedChain, PoolNode, kv_slots, pair_chains
from services.balancer.trackers import ArrivalRate, QueueGrowth, SpeedTracker, speed_tiers
from tests.unit.balancer_fixtures import TINY, heartbeat

# --- chains ------------------------------------------------------------------------


def test_pairing_is_fastest_first_with_bottleneck_slots() -> None:
    prefill = [PoolNode("p-slow", 1.0, 4), PoolNode("p-fast", 3.0, 6)]
    decode = [PoolNode("d-fast", 5.0, 4), PoolNode("d-slow", 2.0, 10)]
    assert pair_chains(prefill, decode) == [
        PairedChain("p-fast", "d-fast", 4),  # fastest with fastest, the decode side binds
        PairedChain("p-fast", "d-slow", 2),  # p-fast's 2 left join the next decode node
        PairedChain("p-slow", "d-slow", 4),
    ]


@settings(max_examples=200, deadline=None)
@given(
    prefill=st.lists(st.tuples(st.floats(0.1, 10), st.integers(0, 20)), max_size=6),
    decode=st.lists(st.tuples(st.floats(0.1, 10), st.integers(0, 20)), max_size=6),
)
def test_pairing_conserves_slots(prefill, decode) -> None:
    p = [PoolNode(f"p{i}", s, n) for i, (s, n) in enumerate(prefill)]
    d = [PoolNode(f"d{i}", s, n) for i, (s, n) in enumerate(decode)]
    chains = pair_chains(p, d)
    assert sum(c.slots for c in chains) == min(sum(n.slots for n in p), sum(n.slots for n in d))
    for node in p:
        assert sum(c.slots for c in chains if c.prefill_id == node.worker_id) <= node.slots
    for node in d:
        assert sum(c.slots for c in chains if c.decode_id == node.worker_id) <= node.slots
    assert all(c.slots > 0 for c in chains)


@pytest.mark.parametrize(
    ("blocks", "block_size", "tokens", "cap", "slots"),
    [(4096, 16, 1024, 0, 64), (4096, 16, 1024, 8, 8), (100, 16, 1024, 0, 1), (0, 16, 1024, 0, 1), (0, 16, 1024, 5, 5), (1000, 32, 1000, 0, 31)],
)
def test_kv_slots(blocks: int, block_size: int, tokens: int, cap: int, slots: int) -> None:
    assert kv_slots(blocks, block_size, tokens, cap) == slots


# --- trackers ------------------------------------------------------------------------


def test_queue_growth_rate_is_smoothed_and_ignores_repeats() -> None:
    growth = QueueGrowth(smoothing=1.0)
    growth.observe("a", 10.0, 0)
    assert growth.rate("a") == 0.0
    growth.observe("a", 11.0, 4)
    assert growth.rate("a") == pytest.approx(4.0)
    growth.observe("a", 11.0, 40)  # same heartbeat again
    assert growth.rate("a") == pytest.approx(4.0)
    growth.observe("a", 13.0, 0)
    assert growth.rate("a") == pytest.approx(-2.0)
    growth.forget(["a"])
    assert growth.rate("a") == 0.0


def busy_twice(tracker: SpeedTracker, worker_id: str, decode_tps: float, running: int = 4) -> None:
    """Two busy heartbeats: only an interval busy at both ends is measured."""
    tracker.observe(heartbeat(worker_id, running=running, decode_tps=decode_tps, sent_at=1.0))
    tracker.observe(heartbeat(worker_id, running=running, decode_tps=decode_tps, sent_at=2.0))


def test_speed_tracker_measures_only_busy_nodes() -> None:
    tracker = SpeedTracker(TINY, smoothing=1.0)
    tracker.observe(heartbeat("idle", decode_tps=0.0))
    assert tracker.factor("idle") is None
    # 4 sequences decoding at 10 steps/s under TINY would take 10*(2ms+4*0.2ms) = 28 ms of every second.
    busy_twice(tracker, "a", decode_tps=40.0)
    assert tracker.factor("a") == pytest.approx(10 * (TINY.a + 4 * TINY.c))
    # A node ten times faster completes ten times the steps.
    busy_twice(tracker, "b", decode_tps=400.0)
    assert tracker.factor("b") == pytest.approx(10 * tracker.factor("a"))
    assert tracker.typical_factor() == tracker.factor("b")  # the median of two is the upper one


def test_speed_tracker_ignores_intervals_that_started_idle() -> None:
    # Idle for most of the interval, the node decoded few tokens: it would look slow, get less work, look slower.
    tracker = SpeedTracker(TINY, smoothing=1.0)
    tracker.observe(heartbeat("a", running=0, sent_at=1.0))
    tracker.observe(heartbeat("a", running=4, decode_tps=4.0, sent_at=2.0))
    assert tracker.factor("a") is None
    tracker.observe(heartbeat("a", running=4, decode_tps=40.0, sent_at=3.0))
    assert tracker.factor("a") == pytest.approx(10 * (TINY.a + 4 * TINY.c))


def test_near_equal_speeds_share_one_tier() -> None:
    assert speed_tiers({"a": 1.0, "b": 1.3, "c": 1.4, "d": 3.0}, 0.5) == {"a": 1.4, "b": 1.4, "c": 1.4, "d": 3.0}
    # A homogeneous fleet spread over the whole band stays one tier (centred on its median)...
    spread = speed_tiers({"a": 0.7, "b": 0.9, "c": 1.0, "d": 1.2, "e": 1.45}, 0.5)
    assert set(spread.values()) == {1.0}
    # ...while a fleet of two kinds of node splits into two tiers.
    mixed = speed_tiers({"a": 1.0, "b": 1.1, "c": 1.2, "d": 3.0, "e": 3.3}, 0.5)
    assert mixed["a"] == mixed["b"] == mixed["c"] == 1.2 and mixed["d"] == mixed["e"] == 3.3
    assert speed_tiers({"a": 1.0, "b": 1.01}, 0.0) == {"a": 1.0, "b": 1.01}
    tracker = SpeedTracker(TINY, smoothing=1.0, equal_within=0.5)
    busy_twice(tracker, "a", decode_tps=40.0)
    busy_twice(tracker, "b", decode_tps=48.0)
    assert tracker.factor("a") == tracker.factor("b") == tracker.measured("b")
    assert tracker.measured("a") < tracker.measured("b")


def test_arrival_rate() -> None:
    rate = ArrivalRate(smoothing=1.0, started_at=0.0)
    for _ in range(10):
        rate.arrived()
    assert rate.tick(2.0) == pytest.approx(5.0)
    assert rate.tick(3.0) == pytest.approx(0.0)


# --- bounds ---------------------------------------------------------------------------


def test_one_slot_is_mm1() -> None:
    bounds = response_bounds([ChainRate("a", 1, 2.0)], arrival_rate=1.0)
    assert bounds.lower_s == pytest.approx(1.0) and bounds.upper_s == pytest.approx(1.0)  # 1/(mu - lambda)


def test_identical_slots_are_mmc() -> None:
    mu, c, lam = 1.0, 3, 2.0
    a = lam / mu
    rho = a / c
    p0 = 1 / (sum(a**k / math.factorial(k) for k in range(c)) + a**c / (math.factorial(c) * (1 - rho)))
    erlang_c = a**c / (math.factorial(c) * (1 - rho)) * p0
    expected = erlang_c / (c * mu - lam) + 1 / mu
    bounds = response_bounds([ChainRate("a", 3, mu)], lam)
    assert bounds.lower_s == pytest.approx(expected)
    assert bounds.upper_s == pytest.approx(expected)


def test_overload_is_infinite_and_heterogeneous_slots_bracket() -> None:
    chains = [ChainRate("fast", 2, 4.0), ChainRate("slow", 2, 1.0)]
    assert math.isinf(response_bounds(chains, 10.0).lower_s)
    bounds = response_bounds(chains, 3.0)
    assert 1 / 4.0 < bounds.lower_s < bounds.upper_s < math.inf


@settings(max_examples=100, deadline=None)
@given(
    rates=st.lists(st.tuples(st.integers(1, 5), st.floats(0.1, 10.0)), min_size=1, max_size=5),
    load=st.floats(0.05, 0.95),
)
def test_lower_bound_never_exceeds_upper(rates, load: float) -> None:
    chains = [ChainRate(f"c{i}", s, r) for i, (s, r) in enumerate(rates)]
    capacity = sum(s * r for s, r in rates)
    bounds = response_bounds(chains, load * capacity)
    assert bounds.lower_s <= bounds.upper_s * (1 + 1e-9)
    assert bounds.lower_s >= 1 / max(r for _, r in rates) * (1 - 1e-9)  # nobody beats the fastest slot


def test_mean_response_edge_cases() -> None:
    assert math.isinf(mean_response([], 1.0))
    assert mean_response([2.0], 0.0) == pytest.approx(0.5)


def test_recommendation_balances_capacity_against_per_slot_slowdown() -> None:
    # Each extra slot slows every slot of the chain: rate(s) = 1 / (1 + 0.5 s).
    rate_at = lambda chain_id, s: 1.0 / (1.0 + 0.5 * s)  # noqa: E731
    light = recommend_slots([("a", 64)], rate_at, arrival_rate=0.1)
    heavy = recommend_slots([("a", 64)], rate_at, arrival_rate=1.5)
    assert light is not None and heavy is not None
    assert light[0] < heavy[0]  # more load needs more slots
    assert heavy[1].lower_s < math.inf
    assert recommend_slots([], rate_at, 1.0) is None
    assert recommend_slots([("a", 4)], rate_at, 0.0) is None
    assert candidate_caps(10)[:8] == [1, 2, 3, 4, 5, 6, 7, 8] and candidate_caps(10)[-1] == 10


def test_an_idle_node_measured_slow_drifts_back_to_the_fleet_median() -> None:
    from contracts.messages import EngineStats, Heartbeat, WorkerRegistration
    from services.balancer.speed import StepModel
    from services.balancer.trackers import SpeedTracker

    tracker = SpeedTracker(StepModel(a=0.002, b=2e-5, c=2e-4), smoothing=0.5)

    def beat(worker: str, t: float, running: int, decode: float) -> Heartbeat:
        registration = WorkerRegistration(worker, "aggregated", "m", "sim", f"inbox.{worker}", 16, 4096, "sim", 0.0)
        return Heartbeat(registration, EngineStats(running=running, decode_tokens_per_s=decode, kv_blocks_total=100), t, int(t))

    for t in range(1, 4):
        tracker.observe(beat("fast", t, 8, 8 * 400.0))
        tracker.observe(beat("other", t, 8, 8 * 400.0))
        tracker.observe(beat("slow", t, 8, 8 * 20.0))
    slow_before = tracker.measured("slow")
    assert slow_before < tracker.measured("fast") / 5
    for t in range(4, 14):
        tracker.observe(beat("slow", t, 0, 0.0))
    assert tracker.measured("slow") > 0.9 * tracker.measured("fast")


def test_bounds_of_huge_slot_counts_are_quick_and_as_with_the_first_few_thousand() -> None:
    # Found by the NATS fuzzer: a heartbeat claiming 2^63 KV blocks made `kvlane status` build a list per slot
    # (the balancer hung); an unbounded fleet (2^30 slots a chain) did the same.
    import time

    from services.balancer.bounds import MAX_SLOTS

    started = time.perf_counter()
    huge = response_bounds([ChainRate("a", 2**62, 1.0), ChainRate("b", 1 << 30, 0.5)], arrival_rate=100.0)
    assert time.perf_counter() - started < 1.0
    assert huge == response_bounds([ChainRate("a", MAX_SLOTS, 1.0), ChainRate("b", MAX_SLOTS, 0.5)], arrival_rate=100.0)
    assert recommend_slots([("a", 2**62)], lambda chain, slots: 1.0, 10.0) is not None
