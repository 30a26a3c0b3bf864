"""The health state machine: suspect on repeated bad probes or complaints, recovery with hysteresis."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from services.health_prober.health import NodeHealth
from shared.config import HealthSettings

SETTINGS = HealthSettings(bad_probes_to_suspect=2, bad_probes_to_unhealthy=4, good_probes_to_recover=3,
                          feedback_to_suspect=3, feedback_window_s=10, slow_factor=5, slow_floor_s=0.1)


def healthy_node() -> NodeHealth:
    node = NodeHealth("w0", SETTINGS, 0.0)
    for t in range(5):
        node.observe_probe(0.01, float(t))
    return node


def test_one_failure_is_not_enough_two_make_suspect_four_unhealthy() -> None:
    node = healthy_node()
    node.observe_probe(None, 10)
    assert node.state == "healthy"
    node.observe_probe(None, 11)
    assert node.state == "suspect" and node.verdict(11).weight == SETTINGS.suspect_weight
    node.observe_probe(None, 12)
    node.observe_probe(None, 13)
    assert node.state == "unhealthy" and node.verdict(13).weight == 0.0


def test_far_slower_than_its_own_baseline_counts_as_bad() -> None:
    node = healthy_node()
    node.observe_probe(0.05, 10)  # 5x of 10 ms is under the 100 ms floor: still fine
    assert node.state == "healthy"
    node.observe_probe(0.5, 11)
    node.observe_probe(0.5, 12)
    assert node.state == "suspect" and "baseline" in node.reason


def test_busy_is_not_sick_a_probe_that_waited_behind_queued_requests_counts_neither_way() -> None:
    node = healthy_node()
    for t in range(10, 20):
        node.observe_probe(0.5 if t % 2 else math.inf, t, queued=True)
    assert node.state == "healthy"
    # A refused probe is bad however busy the node is; so are slow probes and timeouts with nothing queued.
    node.observe_probe(None, 20, queued=True)
    node.observe_probe(None, 21, queued=True)
    assert node.state == "suspect" and node.reason == "probe failed"
    node = healthy_node()
    node.observe_probe(math.inf, 10)
    node.observe_probe(0.5, 11)
    assert node.state == "suspect"


def test_recovery_needs_several_good_probes_in_a_row() -> None:
    node = healthy_node()
    for t in range(10, 14):
        node.observe_probe(None, t)
    assert node.state == "unhealthy"
    node.observe_probe(0.01, 20)
    node.observe_probe(0.01, 21)
    assert node.state == "unhealthy"
    node.observe_probe(None, 22)  # a relapse restarts the count
    node.observe_probe(0.01, 23)
    node.observe_probe(0.01, 24)
    assert node.state == "unhealthy"
    node.observe_probe(0.01, 25)
    assert node.state == "healthy"


def test_client_complaints_make_a_node_suspect_while_probes_pass() -> None:
    node = healthy_node()
    for t in (10.0, 11.0, 12.0):
        node.observe_feedback("slow", t)
    assert node.state == "suspect" and "complaints" in node.reason
    for t in range(13, 16):
        node.observe_probe(0.01, t)
    assert node.state == "suspect"  # complaints still in the window
    for t in range(30, 33):
        node.observe_probe(0.01, t)
    assert node.state == "healthy"


def test_a_restarted_node_is_judged_afresh_and_only_by_what_was_heard_since_it_started() -> None:
    node = healthy_node()
    assert node.started(1.0, 5.0) is False  # the first start seen: nothing to forget
    # The process dies: every stream on it complains, probes fail.
    for t in (10.0, 10.1, 10.2, 10.3):
        node.observe_feedback("timeout", t)
    for t in range(11, 15):
        node.observe_probe(None, t)
    assert node.state == "unhealthy"
    assert node.started(1.0, 15.0) is False  # the same process: nothing changes
    assert node.state == "unhealthy"
    # It comes back as a new process at 15.5; one complaint about it is heard at 16.
    node.observe_feedback("slow", 16.0)
    assert node.started(15.5, 16.5) is True
    verdict = node.verdict(16.5)
    assert (verdict.state, verdict.weight, verdict.feedback_in_window, verdict.baseline_latency_s) == ("healthy", 1.0, 1, None)
    # Streams the crash broke may complain only now: naming the killed process, that is not held against this one.
    for t in (17.0, 17.1, 17.2, 17.3):
        node.observe_feedback("timeout", t, started_at=1.0)
    assert node.state == "healthy" and node.feedback_in_window(17.3) == 1
    # It is judged like any node: complaints naming it, or naming none, count.
    node.observe_feedback("slow", 17.5, started_at=15.5)
    node.observe_feedback("slow", 18.0)
    assert node.state == "suspect" and node.feedback_in_window(18.0) == 3


def test_complaints_heard_before_a_node_first_seen_started_are_not_held_against_it() -> None:
    # A prober hears complaints about a process that died before any probe round saw the one that replaced it.
    node = NodeHealth("w0", SETTINGS, 0.0)
    for t in (10.0, 10.1, 10.2):
        node.observe_feedback("timeout", t)
    node.observe_feedback("timeout", 12.5, started_at=1.0)  # heard after the new start, but naming the old process
    assert node.state == "suspect"
    assert node.started(12.0, 13.0) is True
    assert node.state == "healthy" and node.feedback_in_window(13.0) == 0
    # Complaints heard after it started are about it: kept.
    fresh = NodeHealth("w1", SETTINGS, 0.0)
    for t in (10.0, 10.1, 10.2):
        fresh.observe_feedback("timeout", t)
    assert fresh.started(9.0, 13.0) is False
    assert fresh.state == "suspect"


def test_baseline_is_not_learnt_while_sick() -> None:
    node = healthy_node()
    baseline = node.baseline
    node.observe_probe(None, 10)
    node.observe_probe(None, 11)
    node.observe_probe(0.04, 12)
    assert node.baseline == baseline


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(0.001, 2.0), st.just("feedback")), max_size=60))
def test_weight_always_matches_state(events) -> None:
    node = NodeHealth("w", SETTINGS, 0.0)
    for t, event in enumerate(events):
        if event == "feedback":
            node.observe_feedback("error", float(t))
        else:
            node.observe_probe(event, float(t))
        verdict = node.verdict(float(t))
        assert verdict.weight == {"healthy": 1.0, "suspect": SETTINGS.suspect_weight, "unhealthy": 0.0}[verdict.state]
        assert verdict.since <= t
