"""Degradation under overload (services/balancer/degradation.py): predicted waits, shedding, shorter answers, eviction."""

from __future__ import annotations

import math

import pytest

from contracts.messages import ErrorReply
from services.balancer.central_queue import CentralQueue
from services.balancer.degradation import Degradation, DepartureRate, predicted_wait_s
from services.balancer.router import Queued
from shared.config import DegradationSettings, QueueSettings
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, request, router

ON = DegradationSettings(reduce_max_tokens=True, shed=True, ttft_target_s=0.5, max_tokens_factor=0.5, min_max_tokens=4)


def test_departure_rate_over_its_window() -> None:
    rate = DepartureRate(window_s=10.0)
    assert rate.per_s(0.0) == 0.0
    for t in range(20):
        rate.note(float(t) / 2)  # two per second for ten seconds
    assert rate.per_s(10.0) == pytest.approx(2.0)
    assert rate.per_s(30.0) == 0.0  # nothing left in the window


def test_predicted_wait_counts_only_classes_served_first() -> None:
    queue = CentralQueue(100)
    for i in range(6):
        queue.push(request(f"low{i}", priority=0), 0.0, 100.0)
    for i in range(2):
        queue.push(request(f"high{i}", priority=1), 0.0, 100.0)
    assert predicted_wait_s(queue, 1, 1.0) == 3.0  # two ahead, then its own turn
    assert predicted_wait_s(queue, 0, 1.0) == 9.0
    assert predicted_wait_s(queue, 2, 1.0) == 1.0  # nobody ahead: the next slot to free
    assert predicted_wait_s(queue, 0, 0.0) == math.inf


def degradation(settings: DegradationSettings, departures_per_s: float) -> Degradation:
    degradation = Degradation(settings, retry_after_s=1.0)
    for i in range(int(departures_per_s * 10)):
        degradation.departures.note(i / departures_per_s)
    return degradation


def test_the_backlog_a_request_may_be_placed_behind_is_the_longer_of_target_and_queue_wait() -> None:
    queue = CentralQueue(100)
    settings = DegradationSettings(ttft_target_s=0.5)
    # No departure measured yet: no prediction, so no bound.
    assert Degradation(settings, retry_after_s=1.0).backlog_bound_s(queue, request("new"), now=0.0) == math.inf
    d = degradation(settings, departures_per_s=10.0)
    now = 10.0
    assert d.backlog_bound_s(queue, request("new"), now) == 0.5  # a slot frees in 0.1 s: the target is the bound
    for i in range(29):
        queue.push(request(f"q{i}"), now, now + 100.0)
    assert d.backlog_bound_s(queue, request("new"), now) == pytest.approx(3.0)  # 29 ahead, then its turn, at 10 per second
    assert d.backlog_bound_s(queue, request("new", priority=1), now) == 0.5  # a higher class has nobody ahead of it


def test_a_request_that_would_wait_past_its_deadline_is_refused_at_once() -> None:
    queue = CentralQueue(100)
    for i in range(20):
        queue.push(request(f"q{i}"), 0.0, 100.0)
    d = degradation(DegradationSettings(shed=True), departures_per_s=1.0)
    now = 10.0
    refused = d.before_queueing(request("late"), queue, deadline=now + 5.0, now=now)  # 21 s ahead, 5 s left
    assert isinstance(refused, ErrorReply) and refused.status == 429 and refused.retry_after_s >= 20
    # A higher class has nobody ahead of it: it waits.
    assert d.before_queueing(request("vip", priority=1), queue, deadline=now + 5.0, now=now).request_id == "vip"
    assert d.counts["shed"] == 1
    # Shedding off: it waits (and times out later, as before).
    off = degradation(DegradationSettings(), departures_per_s=1.0)  # off by default
    assert off.before_queueing(request("late"), queue, deadline=now + 5.0, now=now).request_id == "late"


def test_under_overload_low_priorities_wait_for_shorter_answers() -> None:
    queue = CentralQueue(100)
    for i in range(4):
        queue.push(request(f"q{i}"), 0.0, 100.0)
    d = degradation(ON, departures_per_s=2.0)  # 2.5 s predicted: over the 0.5 s target, within the deadline
    now = 10.0
    low = d.before_queueing(request("low", output=100), queue, deadline=now + 60, now=now)
    assert low.max_tokens == 50 and d.counts["max_tokens"] == 1
    assert d.before_queueing(request("high", output=100, priority=1), queue, deadline=now + 60, now=now).max_tokens == 100
    assert d.before_queueing(request("short", output=5), queue, deadline=now + 60, now=now).max_tokens == 4  # min 4
    calm = degradation(ON, departures_per_s=100.0)  # 0.05 s predicted: no overload
    assert calm.before_queueing(request("low", output=100), queue, deadline=now + 60, now=now).max_tokens == 100


def test_a_full_queue_makes_room_for_a_higher_class_by_refusing_the_newest_lowest() -> None:
    r = router(queue_length=3, max_per_chain=1)
    heartbeats = [heartbeat("w0")]
    assert not isinstance(r.admit(request("running"), heartbeats, NOW_WALL), (Queued, ErrorReply))
    for name, priority in (("a", 0), ("b", 0), ("c", 1)):
        assert isinstance(r.admit(request(name, priority=priority), heartbeats, NOW_WALL), Queued)
    outcome = r.admit(request("vip", priority=2), heartbeats, NOW_WALL)
    assert isinstance(outcome, Queued) and outcome.evicted is not None and outcome.evicted.request_id == "b"
    assert r.degradation.evicted_reply(outcome.evicted).status == 429
    # Nobody below the lowest class: the newcomer is the one refused.
    refused = r.admit(request("d", priority=0), heartbeats, NOW_WALL)
    assert isinstance(refused, ErrorReply) and refused.code == "queue_full"


def test_the_router_sheds_and_degrades_from_measured_departures() -> None:
    r = router(max_per_chain=1, queue=QueueSettings(max_wait_s=5.0))
    r.degradation = Degradation(ON, retry_after_s=1.0)
    heartbeats = [heartbeat("w0")]
    assert not isinstance(r.admit(request("running", output=100), heartbeats, NOW_WALL), (Queued, ErrorReply))
    # One departure a second measured; the queue already holds four.
    for i in range(10):
        r.degradation.departures.note(NOW_WALL - 9 + i)
    for i in range(4):
        r.queue.push(request(f"q{i}"), NOW_WALL, NOW_WALL + 5)
    queued = r.admit(request("low", output=100), heartbeats, NOW_WALL)
    assert isinstance(queued, Queued) and queued.entry.request.max_tokens == 50  # 5 s predicted: over target, in time
    for i in range(4, 8):
        r.queue.push(request(f"q{i}"), NOW_WALL, NOW_WALL + 5)
    shed = r.admit(request("late"), heartbeats, NOW_WALL)
    assert isinstance(shed, ErrorReply) and shed.status == 429
