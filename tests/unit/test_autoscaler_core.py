"""The autoscaler's pure core: pressures from windows, steps, panic, hysteresis, cooldowns, bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.autoscaler.core import Autoscaler, Observations, PoolGauges
from shared.config import AutoscalerSettings, PoolBounds

FAST = AutoscalerSettings(interval_s=1.0, stable_window_s=10.0, panic_window_s=2.0, up_cooldown_s=3.0, down_cooldown_s=5.0,
                          aggregated=PoolBounds(min=1, max=6), prefill=PoolBounds(min=1, max=4), decode=PoolBounds(min=1, max=4))


def feed(obs: Observations, at: float, replicas: int, ttft: float = 0.1, tpot: float = 0.01, kv: float = 0.2, waiting: int = 0,
         pool: str = "aggregated") -> None:
    obs.gauges(at, {pool: PoolGauges(replicas, kv, waiting)})
    obs.served(at, ttft, tpot)


def test_idle_pressure_is_low_and_nothing_changes_before_a_full_window() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    feed(obs, 0.0, replicas=3)
    [decision] = scaler.decide(0.0, obs, {"aggregated": 3})
    assert decision.desired == 3 and decision.pressure < 1
    assert "full stable window" in decision.reason


def test_ttft_over_target_scales_up_by_one_then_cools_down() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    feed(obs, 0.0, replicas=2, ttft=0.75)  # 1.5x the 0.5 s target, under the panic threshold
    [first] = scaler.decide(0.0, obs, {"aggregated": 2})
    assert (first.desired, first.signal) == (3, "ttft")
    feed(obs, 1.0, replicas=2, ttft=0.75)
    [second] = scaler.decide(1.0, obs, {"aggregated": 2})
    # 1.5 at 2 replicas is 1.0 at the 3 asked for: nothing more.
    assert second.desired == 3


def test_pending_replicas_count_until_the_cooldown_ends() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    feed(obs, 0.0, replicas=2, ttft=0.9)
    assert scaler.decide(0.0, obs, {"aggregated": 2})[0].desired == 3
    feed(obs, 3.5, replicas=2, ttft=0.9)  # the third never came: after the cooldown the 2 running count again
    assert scaler.decide(3.5, obs, {"aggregated": 2})[0].desired == 3


def test_a_surge_panics_up_by_panic_step_and_blocks_scale_down() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    for t in range(11):
        feed(obs, float(t), replicas=4, ttft=0.05, kv=0.1)
    assert scaler.decide(10.0, obs, {"aggregated": 4})[0].desired == 3  # idle for a full window
    feed(obs, 11.0, replicas=3, waiting=40)  # 40 waiting on 3: 2.7x the 5 per replica
    [panic] = scaler.decide(11.0, obs, {"aggregated": 3})
    assert panic.panic and panic.desired == 5 and panic.signal == "waiting"
    for t in range(12, 22):
        feed(obs, float(t), replicas=5, ttft=0.05, kv=0.1)
    [held] = scaler.decide(20.0, obs, {"aggregated": 5})
    assert held.desired == 5 and "panic is recent" in held.reason


def test_scale_down_needs_room_with_one_replica_fewer() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    for t in range(11):
        feed(obs, float(t), replicas=2, kv=0.5)  # 0.625x; at one replica 1.25x
    [kept] = scaler.decide(10.0, obs, {"aggregated": 2})
    assert kept.desired == 2 and kept.reason == "within target"


def test_prefill_grows_on_ttft_only_while_tpot_is_fine() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    obs.gauges(0.0, {"prefill": PoolGauges(1, 0.1, 0), "decode": PoolGauges(2, 0.3, 0)})
    obs.served(0.0, 0.8, 0.02)
    decisions = {d.pool: d for d in scaler.decide(0.0, obs, {"prefill": 1, "decode": 2})}
    assert (decisions["prefill"].desired, decisions["decode"].desired) == (2, 2)
    obs2, scaler2 = Observations(FAST.stable_window_s), Autoscaler(FAST)
    obs2.gauges(0.0, {"prefill": PoolGauges(1, 0.1, 0), "decode": PoolGauges(2, 0.3, 0)})
    obs2.served(0.0, 0.8, 0.08)  # TPOT over too: decode first
    decisions = {d.pool: d for d in scaler2.decide(0.0, obs2, {"prefill": 1, "decode": 2})}
    assert (decisions["prefill"].desired, decisions["decode"].desired) == (1, 3)
    assert decisions["decode"].signal == "tpot"


def test_kv_usage_over_its_limit_grows_decode() -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    obs.gauges(0.0, {"decode": PoolGauges(2, 0.95, 0)})
    [decision] = scaler.decide(0.0, obs, {"decode": 2})
    assert (decision.desired, decision.signal) == (3, "kv_usage")


def test_a_pool_the_fleet_lacks_is_not_managed() -> None:
    obs = Observations(FAST.stable_window_s)
    feed(obs, 0.0, replicas=2)
    assert [d.pool for d in Autoscaler(FAST).decide(0.0, obs, {"aggregated": 2, "prefill": 0})] == ["aggregated"]


signals = st.tuples(st.floats(0, 5), st.floats(0, 0.3), st.floats(0, 1), st.integers(0, 60), st.integers(1, 8))


@settings(max_examples=200, deadline=None)
@given(st.lists(signals, min_size=1, max_size=40))
def test_bounds_and_step_limits_hold_whatever_the_signals(history: list) -> None:
    obs, scaler = Observations(FAST.stable_window_s), Autoscaler(FAST)
    previous: int | None = None
    for t, (ttft, tpot, kv, waiting, replicas) in enumerate(history):
        feed(obs, float(t), replicas=replicas, ttft=ttft, tpot=tpot, kv=kv, waiting=waiting)
        obs.forget_before(float(t))
        [decision] = scaler.decide(float(t), obs, {"aggregated": replicas})
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
    assert scaler.decide(29.0, obs, {"aggregated": 3})[0].desired == 2
