"""Scale from zero, pure parts: the autoscaler takes an idle pool to zero and back on a wake; the balancer holds
requests for a model at zero instead of refusing them, wakes the autoscaler, and serves them once a worker comes."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.autoscaler import PoolDecision, PoolKey, ScalingDecision
from contracts.messages import Heartbeat
from services.autoscaler.core import Autoscaler, Observations, PoolGauges
from services.balancer.central_queue import CentralQueue
from services.balancer.core import DRAIN, BalancerCore, Refused, Reserve, Waiting
from services.balancer.from_zero import FromZero, WakeAutoscaler
from shared.config import AutoscalerSettings, ModelPoolBounds, PoolBounds
from shared.scale_from_zero import ModelsFromZero
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, request, router

TO_ZERO = AutoscalerSettings(interval_s=1.0, stable_window_s=10.0, panic_window_s=2.0, up_cooldown_s=3.0, down_cooldown_s=5.0,
                             idle_to_zero_s=20.0, aggregated=PoolBounds(min=0, max=3), prefill=PoolBounds(min=1, max=2),
                             decode=PoolBounds(min=1, max=2))


AGGREGATED = PoolKey("m", "aggregated")


def idle(obs: Observations, at: float, replicas: int, running: int = 0) -> None:
    obs.gauges(at, {AGGREGATED: PoolGauges(replicas, 0.0, 0, running)} if replicas else {})


def scaler_seeing(model: str = "m") -> Autoscaler:
    scaler = Autoscaler(TO_ZERO)
    scaler.remember([heartbeat("w0", model=model).registration])
    return scaler


def decide(scaler: Autoscaler, obs: Observations, at: float, replicas: int) -> PoolDecision:
    [decision] = scaler.decide(at, obs, {AGGREGATED: replicas})
    return decision


# --- the autoscaler ----------------------------------------------------------------------------


def test_an_idle_pool_whose_min_is_zero_goes_to_zero_after_its_idle_window_and_stays_listed() -> None:
    obs, scaler = Observations(TO_ZERO.stable_window_s), scaler_seeing()
    for t in range(20):
        idle(obs, float(t), replicas=1)
        assert decide(scaler, obs, float(t), 1).desired == 1, t
    idle(obs, 20.0, replicas=1)
    to_zero = decide(scaler, obs, 20.0, 1)
    assert to_zero.desired == 0 and "idle for 20s" in to_zero.reason
    idle(obs, 21.0, replicas=0)
    at_zero = decide(scaler, obs, 21.0, 0)
    # Still decided on (the actuator and KEDA read 0), and no pressure brings it back.
    assert (at_zero.pool, at_zero.desired) == ("aggregated", 0) and "until a request waits" in at_zero.reason


def test_a_served_or_running_request_restarts_the_idle_window() -> None:
    obs, scaler = Observations(TO_ZERO.stable_window_s), scaler_seeing()
    zero_at = None
    for t in range(60):
        idle(obs, float(t), replicas=1, running=1 if t == 12 else 0)
        if t == 25:
            obs.served(25.0, "m", 0.1, 0.01)
        if decide(scaler, obs, float(t), 1).desired == 0:
            zero_at = t
            break
    assert zero_at == 25 + TO_ZERO.idle_to_zero_s


def test_a_pool_whose_min_is_above_zero_never_goes_there() -> None:
    settings_ = AutoscalerSettings(stable_window_s=10.0, down_cooldown_s=5.0, idle_to_zero_s=20.0, aggregated=PoolBounds(min=1))
    obs, scaler = Observations(10.0), Autoscaler(settings_)
    scaler.remember([heartbeat("w0").registration])
    for t in range(100):
        idle(obs, float(t), replicas=1)
        assert decide(scaler, obs, float(t), 1).desired == 1
    assert scaler.from_zero() == [] and scaler.wake(100.0, "m") == []


def at_zero() -> tuple[Observations, Autoscaler]:
    obs, scaler = Observations(TO_ZERO.stable_window_s), scaler_seeing()
    for t in range(21):
        idle(obs, float(t), replicas=1)
        decide(scaler, obs, float(t), 1)
    assert decide(scaler, obs, 21.0, 0).desired == 0
    return obs, scaler


def test_a_wake_for_the_pool_s_model_takes_it_to_one_at_the_next_decision() -> None:
    obs, scaler = at_zero()
    assert scaler.wake(30.0, "other") == []  # a model no pool at zero serves changes nothing
    assert decide(scaler, obs, 30.0, 0).desired == 0
    assert scaler.wake(31.0, "m") == ["aggregated"]
    woken = decide(scaler, obs, 31.0, 0)
    assert woken.desired == 1 and "a request waits" in woken.reason


def test_wakes_repeated_while_requests_wait_keep_a_slow_worker_asked_for() -> None:
    obs, scaler = at_zero()
    scaler.wake(30.0, "m")
    assert decide(scaler, obs, 30.0, 0).desired == 1
    for t in range(31, 45):  # far past the up-cooldown, and no worker yet
        scaler.wake(float(t), "m")
        assert decide(scaler, obs, float(t), 0).desired == 1, t
    # The last wake is answered; with none after it, the worker that never came is not asked for again.
    assert decide(scaler, obs, 48.0, 0).desired == 1
    assert decide(scaler, obs, 52.0, 0).desired == 0


def woken_at_30_with_a_replica_at_33() -> tuple[Observations, Autoscaler]:
    """A pool at zero woken at 30 s, whose worker has registered by 33 s; its decision at 33 s keeps that one."""
    obs, scaler = at_zero()
    scaler.wake(30.0, "m")
    decide(scaler, obs, 30.0, 0)
    idle(obs, 33.0, replicas=1)
    assert decide(scaler, obs, 33.0, 1).desired == 1
    return obs, scaler


def test_the_woken_pool_serves_then_goes_back_to_zero_when_idle_again() -> None:
    obs, scaler = woken_at_30_with_a_replica_at_33()
    # It arrived at zero and waited for the worker: that wait is no pressure on the worker that serves it.
    obs.served(33.5, "m", 2.5, 0.01, arrived_at=30.0)
    idle(obs, 34.0, replicas=1)
    assert decide(scaler, obs, 34.0, 1).desired == 1
    for t in range(35, 53):
        idle(obs, float(t), replicas=1)
        assert decide(scaler, obs, float(t), 1).desired == 1, t
    idle(obs, 53.5, replicas=1)
    assert decide(scaler, obs, 53.5, 1).desired == 0


def test_a_request_that_arrived_once_a_replica_served_counts_its_ttft_in_full() -> None:
    obs, scaler = woken_at_30_with_a_replica_at_33()
    obs.served(34.0, "m", 2.5, 0.01, arrived_at=33.2)
    idle(obs, 34.0, replicas=1)
    assert decide(scaler, obs, 34.0, 1).desired > 1


def test_from_zero_names_the_newest_registration_of_each_model_of_a_pool_that_may_be_at_zero() -> None:
    scaler = Autoscaler(TO_ZERO)
    older, newer = heartbeat("w0", started_at=1.0).registration, heartbeat("w1", started_at=2.0).registration
    scaler.remember([newer, older])
    scaler.remember([heartbeat("d0", model="big", role="decode").registration])  # decode's min is 1
    assert scaler.from_zero() == [newer]


OTHER = PoolKey("n", "aggregated")


def both_at_zero() -> tuple[Observations, Autoscaler]:
    """Models m and n, each with an aggregated pool whose min is 0, both gone to zero at 20 s."""
    obs, scaler = Observations(TO_ZERO.stable_window_s), scaler_seeing()
    scaler.remember([heartbeat("n0", model="n").registration])
    for t in range(21):
        obs.gauges(float(t), {AGGREGATED: PoolGauges(1, 0.0, 0), OTHER: PoolGauges(1, 0.0, 0)})
        scaler.decide(float(t), obs, {AGGREGATED: 1, OTHER: 1})
    assert [d.desired for d in scaler.decide(21.0, obs, {})] == [0, 0]
    return obs, scaler


def test_a_wake_for_one_model_takes_only_its_pool_from_zero() -> None:
    obs, scaler = both_at_zero()
    assert scaler.from_zero() == [heartbeat("w0").registration, heartbeat("n0", model="n").registration]
    assert scaler.wake(30.0, "m") == ["aggregated"]
    decisions = {d.key: d for d in scaler.decide(30.0, obs, {})}
    assert (decisions[AGGREGATED].desired, decisions[OTHER].desired) == (1, 0)
    assert "until a request waits" in decisions[OTHER].reason


def test_one_model_s_requests_do_not_keep_another_model_s_pool_from_zero() -> None:
    obs, scaler = Observations(TO_ZERO.stable_window_s), scaler_seeing()
    scaler.remember([heartbeat("n0", model="n").registration])
    went_to_zero = {}
    for t in range(40):
        obs.gauges(float(t), {AGGREGATED: PoolGauges(1, 0.0, 0), OTHER: PoolGauges(1, 0.0, 0)})
        obs.served(float(t), "m", 0.1, 0.01)  # m serves all along; n serves nothing
        for decision in scaler.decide(float(t), obs, {AGGREGATED: 1, OTHER: 1}):
            if decision.desired == 0:
                went_to_zero.setdefault(decision.model, t)
    assert went_to_zero == {"n": TO_ZERO.idle_to_zero_s}


def test_a_model_whose_own_min_is_above_zero_is_neither_served_from_zero_nor_woken() -> None:
    settings_ = AutoscalerSettings(aggregated=PoolBounds(min=0, max=3),
                                   models={"n": ModelPoolBounds(aggregated=PoolBounds(min=1, max=3))})
    scaler = Autoscaler(settings_)
    scaler.remember([heartbeat("w0").registration, heartbeat("n0", model="n").registration])
    assert scaler.from_zero() == [heartbeat("w0").registration]
    assert scaler.wake(1.0, "n") == [] and scaler.wake(1.0, "m") == ["aggregated"]


events = st.lists(st.tuples(st.sampled_from(["idle", "running", "served", "wake"]), st.floats(0.1, 8.0)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(events)
def test_zero_is_reached_only_idle_and_left_only_for_a_wake(history: list[tuple[str, float]]) -> None:
    """The actuator obeys at once (what runs is what was decided): whatever happens, the pool goes to zero only
    after a full idle window, and leaves zero only for a wake since it got there."""
    obs, scaler = Observations(TO_ZERO.stable_window_s), scaler_seeing()
    now, replicas, active_at, woken_at, zero_at = 0.0, 1, 0.0, -math.inf, -math.inf
    for kind, gap in history:
        now += gap
        idle(obs, now, replicas, running=1 if kind == "running" and replicas else 0)
        if kind == "running" and replicas:
            active_at = now
        if kind == "served":
            obs.served(now, "m", 0.1, 0.01)
            active_at = now
        if kind == "wake":
            scaler.wake(now, "m")
            woken_at = active_at = now
        desired = decide(scaler, obs, now, replicas).desired
        assert TO_ZERO.aggregated.min <= desired <= TO_ZERO.aggregated.max
        if replicas and not desired:
            assert now - active_at >= TO_ZERO.idle_to_zero_s
            zero_at = now
        if not replicas and desired:
            assert woken_at > zero_at
        obs.forget_before(now)
        replicas = desired


# --- what ingresses and balancers know -----------------------------------------------------------


def decision(at: float, *models: str) -> ScalingDecision:
    return ScalingDecision("a", at, [], [heartbeat(f"w-{m}", model=m).registration for m in models])


def test_the_last_decision_heard_says_which_models_are_served_from_zero() -> None:
    models = ModelsFromZero()
    assert "m" not in models and models.registration("m") is None
    models.heard(decision(2.0, "m", "n"))
    assert models.models() == ["m", "n"] and models.registration("m") == heartbeat("w-m").registration
    # Whatever its stamp: one from a clock far ahead must not hide the next.
    models.heard(decision(1.0, "n"))
    assert "m" not in models and models.models() == ["n"]


# --- the balancer ------------------------------------------------------------------------------


class Fleet:
    """Heartbeats the core sees, changed by the test."""

    def __init__(self) -> None:
        self.heartbeats: list[Heartbeat] = []

    def routable(self, model: str) -> list[Heartbeat]:
        return [hb for hb in self.heartbeats if hb.registration.model == model and not hb.draining]


def core_at_zero(models: tuple[str, ...] = ("m",)) -> tuple[BalancerCore, Fleet]:
    fleet = Fleet()
    core = BalancerCore(router(max_per_chain=1, clock=lambda: NOW_WALL), fleet.routable, lambda: fleet.heartbeats,
                        FromZero(frozenset(models)))
    return core, fleet


def test_a_request_for_a_model_at_zero_waits_and_wakes_the_autoscaler_once_a_second() -> None:
    core, _ = core_at_zero()
    first = core.route(request("r1"), NOW_WALL)
    assert first[0] == WakeAutoscaler("m", 1) and isinstance(first[-1], Waiting) and len(first) == 2
    again = core.route(request("r2"), NOW_WALL + 0.5)
    assert len(again) == 1 and isinstance(again[0], Waiting)
    later = core.route(request("r3"), NOW_WALL + 1.0)
    assert later[0] == WakeAutoscaler("m", 3)


def test_held_requests_are_placed_once_a_worker_registers() -> None:
    core, fleet = core_at_zero()
    core.route(request("r1"), NOW_WALL)
    fleet.heartbeats.append(heartbeat("w0"))
    assert core.heartbeat(fleet.heartbeats[0]) == [DRAIN]
    [reserve] = core.dispatch()
    assert isinstance(reserve, Reserve) and reserve.placement.chain.worker_id == "w0" and reserve.entry is not None


def test_a_model_neither_served_nor_scaled_from_zero_is_not_found() -> None:
    core, _ = core_at_zero()
    [refused] = core.route(request("r1", model="other"), NOW_WALL)
    assert isinstance(refused, Refused) and (refused.reply.code, refused.reply.status) == ("model_not_found", 404)
    assert len(core.router.queue) == 0


def test_a_request_still_held_at_its_deadline_is_told_no_worker_started_with_retry_after() -> None:
    core, _ = core_at_zero()
    core.route(request("r1", timeout_s=5.0), NOW_WALL)
    [entry] = core.router.queue.in_order()
    by_timer = core.queue_deadline(entry).reply
    core.route(request("r2", timeout_s=5.0), NOW_WALL)
    by_tick = next(e for e in core.tick(NOW_WALL + 6.0) if isinstance(e, Refused)).reply
    for reply in (by_timer, by_tick):
        assert (reply.code, reply.status) == ("scaling_from_zero", 503) and reply.retry_after_s
        assert "no worker of model 'm' started within 5.0s" in reply.message


def test_a_served_model_s_queued_request_still_times_out_waiting_for_a_slot() -> None:
    core, fleet = core_at_zero()
    fleet.heartbeats.append(heartbeat("w0"))
    core.heartbeat(fleet.heartbeats[0])
    core.route(request("r1"), NOW_WALL)  # takes the only slot
    assert isinstance(core.route(request("r2", timeout_s=5.0), NOW_WALL)[-1], Waiting)
    reply = next(e for e in core.tick(NOW_WALL + 6.0) if isinstance(e, Refused)).reply
    assert reply.code == "queue_timeout"


def test_the_tick_wakes_again_while_requests_wait_and_counts_them_per_model() -> None:
    core, fleet = core_at_zero(("m", "n"))
    from_zero = core.from_zero
    core.route(request("r1"), NOW_WALL)
    core.route(request("r2", model="n"), NOW_WALL)
    core.route(request("r3", model="n"), NOW_WALL)
    held = from_zero.waiting(core.router.queue, fleet.routable)
    assert held == Counter({"n": 2, "m": 1})
    assert from_zero.due(NOW_WALL + 0.5, held) == []
    assert from_zero.due(NOW_WALL + 1.0, held) == [WakeAutoscaler("m", 1), WakeAutoscaler("n", 2)]
    fleet.heartbeats.append(heartbeat("w0", model="n"))  # n is served now: its requests wait for a slot, not a worker
    assert from_zero.waiting(core.router.queue, fleet.routable) == Counter({"m": 1})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("mn"), st.floats(0.0, 2.0)), max_size=40))
def test_the_first_held_request_of_a_model_wakes_and_wakes_are_a_second_apart(arrivals: list[tuple[str, float]]) -> None:
    from_zero, now, last = FromZero(frozenset("mn")), 0.0, {}
    for model, gap in arrivals:
        now += gap
        wake = from_zero.held(model, now, lambda: 1)
        if model not in last:
            assert wake is not None
        if wake is not None:
            assert now - last.get(model, -math.inf) >= 1.0
            last[model] = now
        else:
            assert now - last[model] < 1.0


def test_bad_wake_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="wake_every_s"):
        FromZero(wake_every_s=0.0)


def test_waiting_ignores_an_empty_queue_and_models_not_from_zero() -> None:
    queue = CentralQueue(8)
    queue.push(request("r1", model="other"), NOW_WALL, NOW_WALL + 5)
    assert FromZero(frozenset({"m"})).waiting(queue, lambda model: []) == Counter()

