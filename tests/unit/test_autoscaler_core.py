"""The autoscaler's pure core: pressures from windows, steps, panic, hysteresis, cooldowns, bounds, a pool per base model."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.autoscaler import POOLS, PoolDecision, PoolKey, ScalingDecision
from contracts.balancer import BalancerStatus, BalancerStatusReply
from services.autoscaler.core import Autoscaler, Observations, PoolGauges, pool_gauges
from services.autoscaler.metrics import AutoscalerMetrics
from services.balancer.status import SlotRates, build_status
from shared.config import AutoscalerSettings, ModelPoolBounds, PoolBounds, SlotSettings
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, request, router

MODEL = "m"
AGGREGATED, PREFILL, DECODE = PoolKey(MODEL, "aggregated"), PoolKey(MODEL, "prefill"), PoolKey(MODEL, "decode")

FAST = AutoscalerSettings(interval_s=1.0, stable_window_s=10.0, panic_window_s=2.0, up_cooldown_s=3.0, down_cooldown_s=5.0,
                          aggregated=PoolBounds(min=1, max=6), prefill=PoolBounds(min=1, max=4), decode=PoolBounds(min=1, max=4))


def feed(obs: Observations, at: float, replicas: int, ttft: float = 0.1, tpot: float = 0.01, kv: float = 0.2, waiting: int = 0,
         pool: PoolKey = AGGREGATED) -> None:
    obs.gauges(at, {pool: PoolGauges(replicas, kv, waiting)})
    obs.served(at, pool.model, ttft, tpot)


def test_idle_pressure_is_low_and_nothing_changes_before_a_full_window() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    feed(obs, 0.0, replicas=3)
    [decision] = scaler.decide(0.0, obs, {AGGREGATED: 3})
    assert decision.desired == 3 and decision.pressure < 1
    assert "full stable window" in decision.reason


def test_ttft_over_target_scales_up_by_one_then_cools_down() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    feed(obs, 0.0, replicas=2, ttft=0.75)  # 1.5x the 0.5 s target, under the panic threshold
    [first] = scaler.decide(0.0, obs, {AGGREGATED: 2})
    assert (first.desired, first.signal) == (3, "ttft")
    feed(obs, 1.0, replicas=2, ttft=0.75)
    [second] = scaler.decide(1.0, obs, {AGGREGATED: 2})
    # 1.5 at 2 replicas is 1.0 at the 3 asked for: nothing more.
    assert second.desired == 3


def test_pending_replicas_count_until_the_cooldown_ends() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    feed(obs, 0.0, replicas=2, ttft=0.9)
    assert scaler.decide(0.0, obs, {AGGREGATED: 2})[0].desired == 3
    feed(obs, 3.5, replicas=2, ttft=0.9)  # the third never came: after the cooldown the 2 running count again
    assert scaler.decide(3.5, obs, {AGGREGATED: 2})[0].desired == 3


def test_a_surge_panics_up_by_panic_step_and_blocks_scale_down() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    for t in range(11):
        feed(obs, float(t), replicas=4, ttft=0.05, kv=0.1)
    assert scaler.decide(10.0, obs, {AGGREGATED: 4})[0].desired == 3  # idle for a full window
    feed(obs, 11.0, replicas=3, waiting=40)  # 40 waiting on 3: 2.7x the 5 per replica
    [panic] = scaler.decide(11.0, obs, {AGGREGATED: 3})
    assert panic.panic and panic.desired == 5 and panic.signal == "waiting"
    for t in range(12, 22):
        feed(obs, float(t), replicas=5, ttft=0.05, kv=0.1)
    [held] = scaler.decide(20.0, obs, {AGGREGATED: 5})
    assert held.desired == 5 and "panic is recent" in held.reason


def test_scale_down_needs_room_with_one_replica_fewer() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    for t in range(11):
        feed(obs, float(t), replicas=2, kv=0.5)  # 0.625x; at one replica 1.25x
    [kept] = scaler.decide(10.0, obs, {AGGREGATED: 2})
    assert kept.desired == 2 and kept.reason == "within target"


def test_prefill_grows_on_ttft_only_while_tpot_is_fine() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    obs.gauges(0.0, {PREFILL: PoolGauges(1, 0.1, 0), DECODE: PoolGauges(2, 0.3, 0)})
    obs.served(0.0, MODEL, 0.8, 0.02)
    decisions = {d.pool: d for d in scaler.decide(0.0, obs, {PREFILL: 1, DECODE: 2})}
    assert (decisions["prefill"].desired, decisions["decode"].desired) == (2, 2)
    obs2, scaler2 = Observations(FAST.stable_window_s), Autoscaler(FAST)
    obs2.gauges(0.0, {PREFILL: PoolGauges(1, 0.1, 0), DECODE: PoolGauges(2, 0.3, 0)})
    obs2.served(0.0, MODEL, 0.8, 0.08)  # TPOT over too: decode first
    decisions = {d.pool: d for d in scaler2.decide(0.0, obs2, {PREFILL: 1, DECODE: 2})}
    assert (decisions["prefill"].desired, decisions["decode"].desired) == (1, 3)
    assert decisions["decode"].signal == "tpot"


def test_kv_usage_over_its_limit_grows_decode() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    obs.gauges(0.0, {DECODE: PoolGauges(2, 0.95, 0)})
    [decision] = scaler.decide(0.0, obs, {DECODE: 2})
    assert (decision.desired, decision.signal) == (3, "kv_usage")


def test_a_pool_the_fleet_lacks_is_not_managed() -> None:
    obs = Observations(FAST.stable_window_s)
    feed(obs, 0.0, replicas=2)
    assert [d.pool for d in Autoscaler(FAST).decide(0.0, obs, {AGGREGATED: 2, PREFILL: 0})] == ["aggregated"]


signals = st.tuples(st.floats(0, 5), st.floats(0, 0.3), st.floats(0, 1), st.integers(0, 60), st.integers(1, 8))


@settings(max_examples=200, deadline=None)
@given(st.lists(signals, min_size=1, max_size=40))
def test_bounds_and_step_limits_hold_whatever_the_signals(history: list) -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    previous: int | None = None
    for t, (ttft, tpot, kv, waiting, replicas) in enumerate(history):
        feed(obs, float(t), replicas=replicas, ttft=ttft, tpot=tpot, kv=kv, waiting=waiting)
        obs.forget_before(float(t))
        [decision] = scaler.decide(float(t), obs, {AGGREGATED: replicas})
        assert FAST.aggregated.min <= decision.desired <= FAST.aggregated.max
        known = [replicas] if previous is None else [replicas, previous]
        if "bounded" not in decision.reason:
            # At most one step from what runs or what was asked for: never a jump.
            assert decision.desired <= max(known) + FAST.panic_step
            assert decision.desired >= min(known) - FAST.step
        previous = decision.desired


def test_idle_after_trimming_still_scales_down() -> None:
    """Trimming old samples must not hide that a full window has been observed."""
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    for t in range(30):
        feed(obs, float(t), replicas=3, ttft=0.01, tpot=0.001, kv=0.0)
        obs.forget_before(float(t))
    assert scaler.decide(29.0, obs, {AGGREGATED: 3})[0].desired == 2


# --- pools per base model ----------------------------------------------------------------------

HOT, IDLE = PoolKey("hot", "aggregated"), PoolKey("idle", "aggregated")


def test_an_overloaded_model_scales_only_its_own_pool_and_the_idle_one_may_shrink() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    for t in range(11):
        # hot: TTFT 1.5x its target and, at the end, 20 waiting on 2 replicas; idle: well under every target.
        obs.gauges(float(t), {HOT: PoolGauges(2, 0.3, 20 if t == 10 else 0), IDLE: PoolGauges(3, 0.1, 0)})
        obs.served(float(t), "hot", 0.75, 0.01)
        obs.served(float(t), "idle", 0.05, 0.005)
    decisions = {d.key: d for d in scaler.decide(10.0, obs, {HOT: 2, IDLE: 3})}
    assert decisions.keys() == {HOT, IDLE}
    assert decisions[HOT].desired > 2 and decisions[HOT].model == "hot"
    # hot's latencies are not idle's: idle runs under target with one replica fewer, after a full window.
    assert decisions[IDLE].desired == 2 and decisions[IDLE].signal != "ttft" and decisions[IDLE].pressure < 0.5


def test_gauges_and_the_central_queue_are_grouped_by_model_and_role() -> None:
    heartbeats = [heartbeat("a0", model="a", used=2048, waiting=1), heartbeat("a1", model="a", waiting=3),
                  heartbeat("b0", model="b", running=2), heartbeat("bd", model="b", role="decode", used=1024),
                  heartbeat("gone", model="a", draining=True, waiting=50)]
    gauges = pool_gauges(heartbeats, {"a": 6, "b": 1})
    assert gauges == {
        PoolKey("a", "aggregated"): PoolGauges(2, 0.25, 1 + 3 + 6, 0),
        # The central queue waits for a slot: b's aggregated pool holds them, before its decode pool.
        PoolKey("b", "aggregated"): PoolGauges(1, 0.0, 1, 2),
        PoolKey("b", "decode"): PoolGauges(1, 0.25, 0, 0),
    }
    # A queue not counted per model is the model's only when the fleet has one.
    assert pool_gauges(heartbeats[:2], {"": 4})[PoolKey("a", "aggregated")].waiting == 8
    assert sum(g.waiting for g in pool_gauges(heartbeats, {"": 4}).values()) == 1 + 3


def test_the_balancer_s_status_counts_its_queue_per_model_for_the_autoscaler() -> None:
    """Each model's pool grows on its own queued requests, not on another model's."""
    routing = router()
    for request_id, model in (("r1", "m"), ("r2", "n"), ("r3", "n")):
        routing.queue.push(request(request_id, model=model), NOW_WALL, NOW_WALL + 5)
    status = build_status(balancer_id="b", slot_store="local", router=routing, heartbeats=[], rates=SlotRates(SlotSettings()),
                          arrival_rate=0.0, now=NOW_WALL, fast_forwards=0)
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(status), type=BalancerStatusReply)
    assert isinstance(again, BalancerStatus) and (again.queue_length, again.queued_per_model) == (3, {"m": 1, "n": 2})


def test_a_model_that_joins_a_running_fleet_gathers_its_own_window_before_scaling_down() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    lowest: dict[PoolKey, int] = {}
    for t in range(20):
        # Both idle; the second model's workers register at 15 s.
        gauges = {HOT: PoolGauges(3, 0.05, 0)} | ({IDLE: PoolGauges(3, 0.05, 0)} if t >= 15 else {})
        obs.gauges(float(t), gauges)
        for decision in scaler.decide(float(t), obs, {pool: g.replicas for pool, g in gauges.items()}):
            lowest[decision.key] = min(lowest.get(decision.key, decision.desired), decision.desired)
    assert lowest == {HOT: 2, IDLE: 3}
    assert "full stable window" in decision.reason and decision.key == IDLE

def test_a_model_s_own_bounds_override_its_role_s() -> None:
    settings_ = AutoscalerSettings(aggregated=PoolBounds(min=1, max=6),
                                   models={"big": ModelPoolBounds(aggregated=PoolBounds(min=2, max=3))})
    obs, scaler = Observations(settings_.stable_window_s), Autoscaler(settings_)
    big, small = PoolKey("big", "aggregated"), PoolKey("small", "aggregated")
    obs.gauges(0.0, {big: PoolGauges(3, 0.1, 100), small: PoolGauges(1, 0.1, 100)})
    decisions = {d.key: d for d in scaler.decide(0.0, obs, {big: 3, small: 1})}
    assert decisions[big].desired == 3 and "bounded to 2..3" in decisions[big].reason
    assert decisions[small].desired == 1 + settings_.panic_step
    assert settings_.bounds("big", "decode") == settings_.decode


def test_decisions_are_exported_per_model_and_role() -> None:
    metrics = AutoscalerMetrics()
    pools = [PoolDecision("aggregated", 2, 4, 1.5, 2.5, "ttft", "up", True, "hot"),
             PoolDecision("aggregated", 3, 2, 0.1, 0.1, "kv_usage", "down", False, "idle")]
    metrics.record(ScalingDecision("a", 1.0, pools))
    desired = {model: metrics.registry.get_sample_value("kvlane_autoscaler_desired_replicas",
                                                        {"model_name": model, "pool": "aggregated"}) for model in ("hot", "idle")}
    assert desired == {"hot": 4.0, "idle": 2.0}
    metrics.record(ScalingDecision("a", 2.0, [PoolDecision("aggregated", 4, 5, 1.2, 1.2, "ttft", "up", False, "hot"), pools[1]]))
    assert metrics.registry.get_sample_value("kvlane_autoscaler_changes_total",
                                             {"model_name": "hot", "pool": "aggregated", "direction": "up"}) == 1.0
    assert metrics.registry.get_sample_value("kvlane_autoscaler_changes_total",
                                             {"model_name": "idle", "pool": "aggregated", "direction": "down"}) is None


pool_decisions = st.builds(
    PoolDecision, st.sampled_from(POOLS), st.integers(0, 50), st.integers(0, 50), st.floats(0, 10), st.floats(0, 10),
    st.sampled_from(["ttft", "tpot", "kv_usage", "waiting"]), st.text(max_size=20), st.booleans(),
    st.sampled_from(["", "hot", "idle", "org/Model-7B"]))


@settings(max_examples=100, deadline=None)
@given(st.lists(pool_decisions, max_size=6))
def test_a_decision_round_trips_on_the_bus_and_in_redis_with_each_model_s_pools_apart(pools: list[PoolDecision]) -> None:
    decision = ScalingDecision("a", 12.5, pools)
    for encode, decode in ((msgspec.msgpack.encode, msgspec.msgpack.decode), (msgspec.json.encode, msgspec.json.decode)):
        again = decode(encode(decision), type=ScalingDecision)
        assert again == decision
        assert again.desired() == {(p.model, p.pool): p.desired for p in pools}


def test_a_decision_without_models_reads_as_the_fleet_s_only_model() -> None:
    """What an autoscaler that kept pools per role stored: its pools read as model "", the fleet's one model."""
    stored = b'{"type":"scaling","autoscaler_id":"a","decided_at":1.0,"pools":[{"pool":"aggregated","current":1,' \
             b'"desired":2,"pressure":1.2,"panic_pressure":1.2,"signal":"ttft","reason":"up"}]}'
    decision = msgspec.json.decode(stored, type=ScalingDecision)
    assert decision.desired() == {PoolKey("", "aggregated"): 2} and decision.pools[0].model == ""


two_models = st.tuples(signals, signals)


@settings(max_examples=150, deadline=None)
@given(st.lists(two_models, min_size=1, max_size=30))
def test_each_model_s_pool_decides_as_if_the_other_model_were_not_there(history: list) -> None:
    """Whatever one model's load, the other's decisions are those of a fleet serving it alone."""
    together, obs = Autoscaler(FAST), Observations(FAST.stable_window_s)
    alone = {pool: (Autoscaler(FAST), Observations(FAST.stable_window_s)) for pool in (HOT, IDLE)}
    for t, sampled in enumerate(history):
        at = float(t)
        running = {}
        for pool, (ttft, tpot, kv, waiting, replicas) in zip((HOT, IDLE), sampled):
            running[pool] = replicas
            for observations in (obs, alone[pool][1]):
                observations.served(at, pool.model, ttft, tpot)
        gauges = {pool: PoolGauges(replicas, kv, waiting) for pool, (_, _, kv, waiting, replicas) in zip((HOT, IDLE), sampled)}
        obs.gauges(at, gauges)
        obs.forget_before(at)
        decided = {d.key: d for d in together.decide(at, obs, running)}
        for pool, (scaler, observations) in alone.items():
            observations.gauges(at, {pool: gauges[pool]})
            observations.forget_before(at)
            [own] = scaler.decide(at, observations, {pool: running[pool]})
            assert decided[pool] == own
