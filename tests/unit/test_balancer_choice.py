"""Which balancer replica an ingress asks (`BalancerReplicas`): those heard from within the TTL, in turn."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from contracts.balancer import BalancerHeartbeat
from services.ingress.balancers import BalancerReplicas

TTL_S = 3.0


def beat(balancer_id: str, stopping: bool = False) -> BalancerHeartbeat:
    return BalancerHeartbeat(balancer_id, stopping)


def test_none_heard_none_chosen() -> None:
    assert BalancerReplicas(TTL_S).choose(0.0) is None


def test_live_replicas_are_chosen_in_turn() -> None:
    replicas = BalancerReplicas(TTL_S)
    for balancer_id in ("a", "b", "c"):
        replicas.heard(beat(balancer_id), 0.0)
    chosen = [replicas.choose(1.0) for _ in range(9)]
    assert Counter(chosen) == {"a": 3, "b": 3, "c": 3}
    assert all(chosen[k] != chosen[k + 1] for k in range(8))


def test_a_replica_silent_past_the_ttl_is_not_chosen_and_is_reported_once() -> None:
    replicas = BalancerReplicas(TTL_S)
    replicas.heard(beat("a"), 0.0)
    replicas.heard(beat("b"), 0.0)
    replicas.heard(beat("a"), 2.0)
    assert {replicas.choose(TTL_S + 0.5) for _ in range(4)} == {"a"}
    assert replicas.fallen_silent(TTL_S + 0.5) == ["b"]
    assert replicas.fallen_silent(TTL_S + 0.6) == []
    replicas.heard(beat("b"), 4.0)  # back
    assert {replicas.choose(4.0) for _ in range(4)} == {"a", "b"}


def test_a_stopping_or_unlistening_replica_is_not_chosen_but_still_reported_when_silent() -> None:
    replicas = BalancerReplicas(TTL_S)
    for balancer_id in ("a", "b", "c"):
        replicas.heard(beat(balancer_id), 0.0)
    replicas.heard(beat("b", stopping=True), 1.0)
    replicas.forget("c")  # NATS said nobody listens on its subject
    assert {replicas.choose(1.0) for _ in range(4)} == {"a"}
    assert replicas.live(1.0) == ["a"]
    # Whatever they were sent and dropped is given up once they have been silent for the TTL.
    assert sorted(replicas.fallen_silent(1.0 + TTL_S + 0.1)) == ["a", "b", "c"]
    replicas.heard(beat("b"), 5.0)
    assert replicas.choose(5.0) == "b"


def test_every_replica_silent_means_none_to_ask_until_one_beats_again() -> None:
    replicas = BalancerReplicas(TTL_S)
    assert not replicas.all_silent(0.0)  # none heard yet: the queue group is asked
    replicas.heard(beat("a"), 0.0)
    replicas.heard(beat("b"), 0.0)
    replicas.heard(beat("a"), 2.0)
    replicas.fallen_silent(TTL_S + 0.5)
    assert not replicas.all_silent(TTL_S + 0.5)  # a still beats
    replicas.fallen_silent(2.0 + TTL_S + 0.5)
    assert replicas.all_silent(2.0 + TTL_S + 0.5)
    replicas.heard(beat("b"), 6.0)
    assert not replicas.all_silent(6.0) and replicas.choose(6.0) == "b"


def test_replicas_that_said_they_stop_are_not_counted_silent() -> None:
    replicas = BalancerReplicas(TTL_S)
    replicas.heard(beat("a"), 0.0)
    replicas.heard(beat("a", stopping=True), 1.0)
    replicas.fallen_silent(1.0 + TTL_S + 0.1)
    assert not replicas.all_silent(1.0 + TTL_S + 0.1)


def test_forgetting_an_unknown_replica_changes_nothing() -> None:
    replicas = BalancerReplicas(TTL_S)
    replicas.forget("x")
    assert replicas.fallen_silent(100.0) == []


events = st.lists(
    st.tuples(st.sampled_from(["beat", "stop", "forget", "choose", "silent"]), st.sampled_from("abcd"),
              st.floats(0.0, 2.0)),
    max_size=60,
)


@given(events)
def test_only_live_replicas_are_chosen_and_every_silent_one_is_reported(steps) -> None:
    """Chosen: heard from within the TTL, and neither stopping nor found unlistening since. Reported silent: every
    replica heard from once (stopping or not) whose last heartbeat is older than the TTL, once."""
    replicas = BalancerReplicas(TTL_S)
    now = 0.0
    last_heard: dict[str, float] = {}
    choosable: set[str] = set()
    for action, balancer_id, advance in steps:
        now += advance
        if action in ("beat", "stop"):
            replicas.heard(beat(balancer_id, stopping=action == "stop"), now)
            last_heard[balancer_id] = now
            (choosable.add if action == "beat" else choosable.discard)(balancer_id)
        elif action == "forget":
            replicas.forget(balancer_id)
            choosable.discard(balancer_id)
        elif action == "silent":
            silent = {b for b, at in last_heard.items() if now - at > TTL_S}
            assert sorted(replicas.fallen_silent(now)) == sorted(silent)
            for gone in silent:
                del last_heard[gone]
                choosable.discard(gone)
        else:
            live = {b for b in choosable if now - last_heard[b] <= TTL_S}
            chosen = replicas.choose(now)
            assert (chosen in live) if live else chosen is None
