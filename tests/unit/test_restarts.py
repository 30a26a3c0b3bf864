"""The restart policy of `kvlane up`: backoff, its reset after a stable run, and the crash-loop limit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.restarts import GiveUp, Restart, RestartBook, RestartPolicy

POLICY = RestartPolicy(first_delay_s=0.5, max_delay_s=30.0, stable_after_s=60.0, limit=10)


def test_the_delay_doubles_from_the_first_up_to_the_cap() -> None:
    assert [POLICY.delay(n) for n in range(1, 10)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_a_crash_loop_backs_off_and_is_given_up_after_the_limit() -> None:
    book, now = RestartBook(RestartPolicy(limit=3)), 0.0
    book.started("worker-w0", now)
    decisions = []
    for _ in range(4):
        now += 0.1
        decision = book.exited("worker-w0", now)
        decisions.append(decision)
        if isinstance(decision, Restart):
            now = decision.at
            assert book.due(now) == ["worker-w0"]
            book.started("worker-w0", now)
    assert [d.delay_s for d in decisions[:3]] == [0.5, 1.0, 2.0]
    assert [d.restarts for d in decisions[:3]] == [1, 2, 3]
    assert decisions[3] == GiveUp(failures=4, ran_s=pytest.approx(0.1))
    assert book.restarts("worker-w0") == 3


def test_a_stable_run_starts_the_backoff_over() -> None:
    book = RestartBook(POLICY)
    book.started("ingress", 0.0)
    first = book.exited("ingress", 1.0)
    book.started("ingress", first.at)
    second = book.exited("ingress", first.at + 1.0)
    assert (first.delay_s, second.delay_s) == (0.5, 1.0)
    book.started("ingress", second.at)
    after_a_stable_run = book.exited("ingress", second.at + POLICY.stable_after_s)
    assert after_a_stable_run.delay_s == 0.5
    assert after_a_stable_run.restarts == 3


def test_a_restart_is_due_only_once_its_delay_has_passed() -> None:
    book = RestartBook(POLICY)
    book.started("balancer", 0.0)
    book.started("worker-w1", 0.0)
    restart = book.exited("balancer", 5.0)
    assert book.waiting("balancer") and not book.waiting("worker-w1")
    assert book.due(restart.at - 0.01) == []
    assert book.due(restart.at) == ["balancer"]


def test_restarts_come_due_longest_waiting_first() -> None:
    book = RestartBook(POLICY)
    for name in ("a", "b"):
        book.started(name, 0.0)
    book.exited("b", 1.0)
    book.exited("a", 2.0)
    assert book.due(100.0) == ["b", "a"]


def test_limit_zero_never_restarts() -> None:
    book = RestartBook(RestartPolicy(limit=0))
    book.started("worker-w0", 0.0)
    assert isinstance(book.exited("worker-w0", 1000.0), GiveUp)


def test_a_forgotten_process_leaves_no_history() -> None:
    book = RestartBook(POLICY)
    book.started("worker-w3", 0.0)
    book.exited("worker-w3", 1.0)
    book.forget("worker-w3")
    assert book.due(100.0) == [] and book.counts() == {}


def test_events_out_of_order_are_refused_clearly() -> None:
    book = RestartBook(POLICY)
    with pytest.raises(KeyError, match="never started"):
        book.exited("ghost", 1.0)
    book.started("worker-w0", 0.0)
    book.exited("worker-w0", 1.0)
    with pytest.raises(ValueError, match="exited twice"):
        book.exited("worker-w0", 2.0)


@pytest.mark.parametrize(("settings", "message"), [
    ({"first_delay_s": 0.0}, "first_delay_s must be positive"),
    ({"first_delay_s": 2.0, "max_delay_s": 1.0}, "max_delay_s"),
    ({"stable_after_s": -1.0}, "stable_after_s must be positive"),
    ({"limit": -1}, "limit must be 0 or more"),
])
def test_a_contradictory_policy_is_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RestartPolicy(**settings)


policies = st.builds(
    RestartPolicy,
    first_delay_s=st.floats(0.01, 10.0),
    max_delay_s=st.floats(10.0, 100.0),
    stable_after_s=st.floats(0.1, 100.0),
    limit=st.integers(0, 8),
)


@given(policies, st.integers(1, 2000))
def test_delays_stay_between_the_first_and_the_cap_and_never_shrink(policy: RestartPolicy, failures: int) -> None:
    delay = policy.delay(failures)
    assert policy.first_delay_s <= delay <= policy.max_delay_s
    assert policy.delay(failures + 1) in (min(2 * delay, policy.max_delay_s), delay)
    assert policy.delay(failures + 1) >= delay


@given(policies, st.lists(st.floats(0.0, 200.0), min_size=1, max_size=30))
def test_the_book_follows_the_rules_for_any_history(policy: RestartPolicy, run_lengths: list[float]) -> None:
    """Each run lasts the given time, then exits; the book must decide as the rules say, every time."""
    book, now, quick_exits, restarts = RestartBook(policy), 0.0, 0, 0
    started = now
    book.started("p", started)
    for ran_s in run_lengths:
        now += ran_s
        quick_exits = 1 if now - started >= policy.stable_after_s else quick_exits + 1
        decision = book.exited("p", now)
        if quick_exits > policy.limit:
            assert isinstance(decision, GiveUp) and decision.failures == quick_exits
            return
        assert isinstance(decision, Restart)
        assert decision.delay_s == policy.delay(quick_exits)
        assert decision.at == now + decision.delay_s
        assert book.due(decision.at - decision.delay_s / 2) == []
        now = decision.at
        assert book.due(now) == ["p"]
        started = now
        book.started("p", started)
        restarts += 1
        assert decision.restarts == restarts == book.restarts("p")
        assert not book.waiting("p")
