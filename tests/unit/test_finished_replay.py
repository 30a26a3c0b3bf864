"""Finished events a restarted balancer missed, published to it again (`FinishedReplay`)."""

from __future__ import annotations

import pytest

from contracts.balancer import BalancerHeartbeat
from contracts.messages import RequestFinished, Usage
from services.worker.finished_replay import FinishedReplay

SILENCE_S = 1.5


def finished(request_id: str) -> RequestFinished:
    return RequestFinished(request_id=request_id, worker_id="w0", finish_reason="length", usage=Usage(1, 1), duration_s=0.1)


def beat(balancer_id: str, stopping: bool = False) -> BalancerHeartbeat:
    return BalancerHeartbeat(balancer_id, stopping)


def ids(events: list[RequestFinished]) -> list[str]:
    return [event.request_id for event in events]


def test_a_replacement_balancer_gets_what_was_published_since_shortly_before_the_last_one_was_heard() -> None:
    replay = FinishedReplay(SILENCE_S)
    replay.published(finished("long-ago"), 0.0)
    assert replay.heard(beat("b1"), 1.0) == []  # the first balancer this worker hears: nothing was missed
    replay.published(finished("heard-by-b1"), 2.0)
    replay.heard(beat("b1"), 9.0)
    replay.heard(beat("b1"), 10.0)  # b1's last heartbeat; it dies soon after
    replay.published(finished("maybe-missed"), 9.0)
    replay.published(finished("missed"), 11.0)
    again = replay.heard(beat("b2"), 12.0)  # b1 still within a TTL of seconds, but silent for more than 1.5 s
    assert ids(again) == ["maybe-missed", "missed"]
    assert replay.heard(beat("b2"), 13.0) == []  # once


def test_a_new_replica_beside_a_live_one_gets_nothing_again() -> None:
    replay = FinishedReplay(SILENCE_S)
    replay.heard(beat("b1"), 0.0)
    replay.published(finished("r1"), 1.0)
    replay.heard(beat("b1"), 2.0)
    assert replay.heard(beat("b2"), 3.0) == []  # b1 beats: it heard every event and freed its slot for all


def test_a_replica_silent_past_the_ttl_and_back_gets_what_it_may_have_missed() -> None:
    replay = FinishedReplay(SILENCE_S)
    replay.heard(beat("b1"), 0.0)
    replay.published(finished("r1"), 5.0)
    assert ids(replay.heard(beat("b1"), 10.0)) == ["r1"]


def test_a_replica_that_said_it_stops_does_not_count_as_live() -> None:
    replay = FinishedReplay(SILENCE_S)
    replay.heard(beat("b1"), 0.0)
    replay.heard(beat("b1", stopping=True), 1.0)
    replay.published(finished("r1"), 1.5)
    assert ids(replay.heard(beat("b2"), 2.0)) == ["r1"]  # heard by nobody


def test_events_are_kept_for_a_while_only() -> None:
    replay = FinishedReplay(SILENCE_S, keep_s=10.0, keep_at_most=2)
    replay.heard(beat("b1"), 0.0)
    for k in range(3):
        replay.published(finished(f"r{k}"), 1.0 + k)
    assert ids(replay.heard(beat("b2"), 5.0)) == ["r1", "r2"]


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="keep_at_most"):
        FinishedReplay(SILENCE_S, keep_at_most=0)
