"""The ingress's request state machine (`RequestFlight`): each transition, and properties over any run.

Properties, for any sequence of route answers, refusals, frames and interruptions:
* the run ends in exactly one outcome, done or failed, and hears nothing after it;
* the client's frames are numbered 0, 1, 2, ... and its tokens are the request's output, none repeated or skipped,
  however often it resumed; each resumption carries exactly the tokens the client has;
* it fails only at a bound, and never runs past one (a request with n > 1 resumes only before its first token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.messages import StreamEnd, Timings, TokenChunk, Usage
from services.ingress.flight import (
    AwaitBalancer, Done, Fail, FlightOver, HandOver, RequestFlight, Route, StreamInterrupted, Yield,
)
from shared.config import IngressSettings


def chunk(seq: int, *tokens: int) -> TokenChunk:
    return TokenChunk(request_id="r1", seq=seq, token_ids=list(tokens), text="")


def end(seq: int) -> StreamEnd:
    return StreamEnd(request_id="r1", seq=seq, finish_reason="length", usage=Usage(1, 1), timings=Timings(), worker_id="w0")


def failed(worker_id: str) -> StreamInterrupted:
    return StreamInterrupted(f"worker {worker_id} failed: engine error", "error", worker_id)


def gone(worker_id: str) -> StreamInterrupted:
    return StreamInterrupted(f"worker {worker_id} is gone", "timeout", worker_id, node_lost=True)


def restarted(worker_id: str) -> StreamInterrupted:
    return StreamInterrupted(f"worker {worker_id} restarted", "timeout", worker_id, restarted=True)


def handed_back(worker_id: str) -> StreamInterrupted:
    return StreamInterrupted(f"worker {worker_id} handed the request back: draining", None, worker_id, handed_back=True)


def reconnected(worker_id: str) -> StreamInterrupted:
    return StreamInterrupted("NATS reconnected and the stream went quiet", None)


def preempted(worker_id: str) -> StreamInterrupted:
    return StreamInterrupted("preempted to make room", None, preempted=True)


def running(settings: IngressSettings | None = None, max_tokens: int = 10, n: int = 1) -> RequestFlight:
    """A flight routed and handed over to its first node."""
    flight = RequestFlight(settings or IngressSettings(), max_tokens, n)
    flight.start()
    flight.on_decision(0)
    return flight


def error_of(action: object) -> tuple[int, str | None, str]:
    assert isinstance(action, Fail)
    return action.error.status, action.error.code, action.error.message


# --- routing ------------------------------------------------------------------------------


def test_a_request_starts_with_a_first_route_that_excludes_nothing() -> None:
    flight = RequestFlight(IngressSettings(), 10)
    assert flight.start() == Route(1, (), ())
    assert not flight.over
    with pytest.raises(FlightOver):
        flight.start()


def test_a_route_nobody_answered_is_asked_again_once_then_fails() -> None:
    flight = RequestFlight(IngressSettings(), 10)
    flight.start()
    assert flight.on_unanswered("timed out") == Route(2, (), ())
    assert error_of(flight.on_unanswered("timed out again")) == (503, "balancer_unavailable",
                                                                 "routing failed: timed out again")
    assert flight.outcome == "failed"


def test_a_route_nobody_answered_after_a_resumption_is_still_only_asked_again_once() -> None:
    flight = RequestFlight(IngressSettings(), 10)
    flight.start()
    flight.on_unanswered("timed out")
    flight.on_decision(0)
    flight.on_frame(chunk(0, 7))
    assert flight.on_interrupted(failed("w0")) == Route(3, ("w0",), (7,))
    assert isinstance(flight.on_unanswered("timed out"), Fail)


def test_with_no_balancer_the_route_is_held_and_asked_again_sooner_then_later_until_the_wait_is_over() -> None:
    flight = RequestFlight(IngressSettings(balancer_wait_s=3.0), 10)
    flight.start()
    waits = []
    now = 100.0
    while isinstance(held := flight.on_no_balancer(now, time_left_s=600.0), AwaitBalancer):
        assert held.route == Route(len(waits) + 2, (), ())  # asked again as a new attempt
        waits.append(held.wait_s)
        now += held.wait_s
    assert waits[:4] == [0.1, 0.2, 0.4, 0.8] and max(waits) == 1.0
    assert sum(waits) == pytest.approx(3.0)  # the last wait ends with the window, not past it
    status, code, message = error_of(held)
    assert (status, code) == (503, "balancer_unavailable") and "waited 3.0s" in message
    assert held.error.retry_after_s == 1.0 and flight.balancer_waits == len(waits)


def test_a_balancer_that_answers_ends_the_wait_and_a_later_one_starts_a_fresh_window() -> None:
    flight = RequestFlight(IngressSettings(balancer_wait_s=1.0), 10)
    flight.start()
    assert isinstance(flight.on_no_balancer(0.0, 600.0), AwaitBalancer)
    assert isinstance(flight.on_no_balancer(0.9, 600.0), AwaitBalancer)
    flight.on_decision(0)
    flight.on_frame(chunk(0, 7))
    flight.on_interrupted(gone("w0"))
    held = flight.on_no_balancer(50.0, 600.0)
    assert isinstance(held, AwaitBalancer) and held.wait_s == 0.1 and held.route.produced == (7,)
    assert isinstance(flight.on_no_balancer(50.99, 600.0), AwaitBalancer)
    assert isinstance(flight.on_no_balancer(51.0, 600.0), Fail)


def test_the_wait_for_a_balancer_ends_with_the_requests_deadline() -> None:
    flight = RequestFlight(IngressSettings(balancer_wait_s=5.0), 10)
    flight.start()
    held = flight.on_no_balancer(0.0, time_left_s=0.05)
    assert isinstance(held, AwaitBalancer) and held.wait_s == 0.05
    assert isinstance(flight.on_no_balancer(0.05, time_left_s=0.0), Fail)


def test_no_wait_for_a_balancer_when_the_setting_is_zero() -> None:
    flight = RequestFlight(IngressSettings(balancer_wait_s=0.0), 10)
    flight.start()
    assert error_of(flight.on_no_balancer(0.0, 600.0))[:2] == (503, "balancer_unavailable")
    with pytest.raises(FlightOver):
        flight.on_no_balancer(0.0, 600.0)


def test_a_decision_under_the_tokens_left_caps_the_request() -> None:
    flight = running(max_tokens=10)
    flight.on_frame(chunk(0, 1, 2, 3))
    flight.on_interrupted(failed("w0"))
    # 7 left: a balancer that allows 4 caps the request at 3 + 4.
    assert flight.on_decision(4) == HandOver(7, capped=True)
    assert flight.max_tokens == 7


@pytest.mark.parametrize("allowed", [0, 10, 11])
def test_a_decision_that_allows_what_is_left_or_more_leaves_the_request_alone(allowed: int) -> None:
    flight = RequestFlight(IngressSettings(), 10)
    flight.start()
    assert flight.on_decision(allowed) == HandOver(10, capped=False)


# --- hand-over ----------------------------------------------------------------------------


def test_a_node_that_does_not_accept_is_excluded_and_the_request_routed_again() -> None:
    flight = running(IngressSettings(dispatch_attempts=3))
    assert flight.on_refused("w0") == Route(2, ("w0",), ())
    flight.on_decision(0)
    assert flight.on_refused("w1") == Route(3, ("w0", "w1"), ())
    flight.on_decision(0)
    assert error_of(flight.on_refused("w2")) == (503, "no_capacity", "no worker accepted the request after 3 attempts")
    assert flight.excluded == ["w0", "w1", "w2"]


def test_one_dispatch_attempt_fails_at_the_first_refusal() -> None:
    action = running(IngressSettings(dispatch_attempts=1)).on_refused("w0")
    assert isinstance(action, Fail) and action.error.retry_after_s == 1.0


# --- relaying -----------------------------------------------------------------------------


def test_frames_pass_unchanged_until_a_resumption_then_go_on_in_the_clients_numbering() -> None:
    flight = running()
    first = chunk(0, 1, 2)
    assert flight.on_frame(first) == Yield(first)
    assert flight.on_frame(chunk(1, 3)).frame is not None
    assert flight.on_interrupted(failed("w0")) == Route(2, ("w0",), (1, 2, 3))
    flight.on_decision(0)
    # The new node numbers its frames from 0; the client's stream goes on at 2.
    assert flight.on_frame(chunk(0, 4)) == Yield(chunk(2, 4))
    done = flight.on_frame(end(1))
    assert done == Done(end(3))
    assert flight.outcome == "done" and flight.produced == [1, 2, 3, 4]


def test_nothing_is_heard_after_the_end() -> None:
    flight = running()
    flight.on_frame(end(0))
    for event in (lambda: flight.on_frame(chunk(1, 5)), lambda: flight.on_interrupted(failed("w0")),
                  lambda: flight.on_refused("w0"), lambda: flight.on_unanswered("x"), lambda: flight.on_decision(0)):
        with pytest.raises(FlightOver):
            event()


def test_tokens_produced_outside_frames_are_what_a_resumption_carries() -> None:
    flight = running()
    flight.on_tokens([4, 5])
    flight.on_tokens([6])
    assert flight.on_interrupted(gone("w0")) == Route(2, ("w0",), (4, 5, 6))


# --- interruptions ------------------------------------------------------------------------


def test_a_failure_resumes_elsewhere_up_to_the_migration_bound() -> None:
    flight = running(IngressSettings(migration_attempts=2))
    assert flight.on_interrupted(failed("w0")) == Route(2, ("w0",), ())
    flight.on_decision(0)
    assert flight.on_interrupted(handed_back("w1")) == Route(3, ("w0", "w1"), ())
    flight.on_decision(0)
    assert error_of(flight.on_interrupted(failed("w2"))) == (
        502, "stream_interrupted", "request failed after 2 resumptions: worker w2 failed: engine error")


def test_a_dead_node_counts_against_the_node_loss_bound_too() -> None:
    flight = running(IngressSettings(migration_attempts=2, node_loss_resumes=1))
    assert flight.on_interrupted(gone("w0")) == Route(2, ("w0",), ())
    flight.on_decision(0)
    assert error_of(flight.on_interrupted(restarted("w1"))) == (
        502, "stream_interrupted", "request failed: 2 nodes died while running it (the last: worker w1 restarted)")


def test_a_restarted_node_is_not_excluded_the_new_process_may_run_the_request() -> None:
    flight = running(IngressSettings(node_loss_resumes=2))
    flight.on_frame(chunk(0, 9))
    assert flight.on_interrupted(restarted("w0")) == Route(2, (), (9,))
    assert (flight.migrations, flight.node_losses) == (1, 1)


def test_lost_frames_resume_with_nobody_to_exclude() -> None:
    assert running().on_interrupted(reconnected("w0")) == Route(2, (), ())


def test_preemptions_are_bounded_apart_from_failures() -> None:
    flight = running(IngressSettings(preemption_resumes=2, migration_attempts=0))
    for attempt in (2, 3):
        # Not excluded: the node that preempted it may take it back.
        assert flight.on_interrupted(preempted("w0")) == Route(attempt, (), ())
        flight.on_decision(0)
    action = flight.on_interrupted(preempted("w0"))
    assert error_of(action) == (503, "preempted", "preempted 3 times")
    assert isinstance(action, Fail) and action.error.retry_after_s == 1.0
    assert flight.migrations == 0


def test_a_request_with_several_choices_resumes_only_before_its_first_token() -> None:
    flight = running(n=2)
    assert isinstance(flight.on_interrupted(failed("w0")), Route)
    flight.on_decision(0)
    flight.on_frame(chunk(0, 1))
    assert error_of(flight.on_interrupted(preempted("w1"))) == (
        502, "stream_interrupted",
        "request failed: preempted to make room (a request with n > 1 resumes only before its first token)")


@given(st.integers(0, 4), st.integers(0, 4))
def test_when_every_resumption_follows_a_node_death_the_tighter_bound_holds(migrations: int, node_losses: int) -> None:
    # The simulator's fleet loses requests only with their nodes.
    flight = running(IngressSettings(migration_attempts=migrations, node_loss_resumes=node_losses))
    resumed = 0
    while isinstance(flight.on_interrupted(gone(f"w{resumed}")), Route):
        resumed += 1
        flight.on_decision(0)
    assert resumed == min(migrations, node_losses)


# --- any run ------------------------------------------------------------------------------

OUTPUT = list(range(1000, 1100))  # the request's output, the same from wherever it resumes
INTERRUPTIONS = {"failed": failed, "gone": gone, "restarted": restarted, "handed_back": handed_back,
                 "reconnected": reconnected, "preempted": preempted}


@dataclass
class Client:
    seqs: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def got(self, frame: TokenChunk | StreamEnd) -> None:
        self.seqs.append(frame.seq)
        if isinstance(frame, TokenChunk):
            self.tokens.extend(frame.token_ids)


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    max_tokens=st.integers(1, 12),
    n=st.sampled_from([1, 1, 2]),
    dispatch_attempts=st.integers(1, 4),
    migration_attempts=st.integers(0, 3),
    node_loss_resumes=st.integers(0, 3),
    preemption_resumes=st.integers(0, 3),
    balancer_wait_s=st.sampled_from([0.0, 0.25, 5.0]),
)
def test_any_run_ends_once_relays_the_output_exactly_once_and_keeps_its_bounds(
    data: st.DataObject, max_tokens: int, n: int, dispatch_attempts: int, migration_attempts: int,
    node_loss_resumes: int, preemption_resumes: int, balancer_wait_s: float,
) -> None:
    limits = IngressSettings(dispatch_attempts=dispatch_attempts, migration_attempts=migration_attempts,
                             node_loss_resumes=node_loss_resumes, preemption_resumes=preemption_resumes,
                             balancer_wait_s=balancer_wait_s)
    flight = RequestFlight(limits, max_tokens, n)
    client = Client()
    excluded: list[str] = []
    # Resumptions as this side counts them: after a failure (of those, after a node died), after a preemption.
    resumed = {"migrated": 0, "node_lost": 0, "preempted": 0}
    events = 0
    # A clock for the waits for a balancer, and how long the present run of them has lasted.
    now = waited_for_a_balancer = 0.0

    def trouble(odds: int) -> bool:
        """Something goes wrong (one time in `odds`); after 60 events the fleet behaves, and the request ends."""
        nonlocal events
        events += 1
        return events < 60 and data.draw(st.integers(0, odds - 1)) == 0

    action: Route | Fail = flight.start()
    outcome = None
    while outcome is None:
        if isinstance(action, Fail):
            outcome = "failed"
            break
        # A resumption carries exactly what the client has; it avoids every node at fault so far.
        assert list(action.produced) == client.tokens and list(action.exclude) == excluded
        if trouble(4):
            action = flight.on_unanswered("timed out")
            continue
        if trouble(4):
            held = flight.on_no_balancer(now, time_left_s=600.0)
            if isinstance(held, AwaitBalancer):
                assert 0 < held.wait_s <= balancer_wait_s - waited_for_a_balancer + 1e-9
                now += held.wait_s
                waited_for_a_balancer += held.wait_s
                action = held.route
            else:
                action = held
            continue
        waited_for_a_balancer = 0.0
        allowed = data.draw(st.integers(0, max_tokens)) if trouble(3) else 0
        limit = flight.on_decision(allowed).max_tokens
        node = f"w{events}"
        if trouble(5):
            excluded.append(node)
            action = flight.on_refused(node)
            continue
        position, node_seq = len(client.tokens), 0
        while True:
            if trouble(4):
                interruption = INTERRUPTIONS[data.draw(st.sampled_from(sorted(INTERRUPTIONS)))](node)
                action = flight.on_interrupted(interruption)
                if isinstance(action, Route):
                    assert n == 1 or not client.tokens  # interleaved choices cannot be resumed
                    if interruption.culprit and not interruption.restarted:
                        excluded.append(interruption.culprit)
                    resumed["preempted" if interruption.preempted else "migrated"] += 1
                    resumed["node_lost"] += interruption.node_lost
                break
            if position >= limit:
                relayed = flight.on_frame(end(node_seq))
                assert isinstance(relayed, Done)
                client.got(relayed.frame)
                outcome = "done"
                break
            tokens = OUTPUT[position:min(limit, position + data.draw(st.integers(1, 3)))]
            relayed = flight.on_frame(chunk(node_seq, *tokens))
            assert isinstance(relayed, Yield)
            client.got(relayed.frame)
            position, node_seq = position + len(tokens), node_seq + 1

    # Exactly one outcome, and nothing after it.
    assert flight.outcome == outcome and flight.over
    with pytest.raises(FlightOver):
        flight.on_frame(chunk(0, 1))
    # Neither duplicated nor skipped: one numbering, the output in order; all of it when done.
    assert client.seqs == list(range(len(client.seqs)))
    assert client.tokens == OUTPUT[:len(client.tokens)] == list(flight.produced)
    if outcome == "done":
        assert len(client.tokens) == flight.max_tokens
    # Within the bounds; a failure only at one of them.
    assert resumed["migrated"] <= migration_attempts and resumed["node_lost"] <= node_loss_resumes
    assert resumed["preempted"] <= preemption_resumes and flight.refusals <= dispatch_attempts
    assert flight.unanswered <= 2
    if outcome == "failed":
        assert isinstance(action, Fail)
        code = action.error.code
        reached = {
            "no_capacity": flight.refusals == dispatch_attempts,
            "balancer_unavailable": flight.unanswered == 2 or waited_for_a_balancer >= balancer_wait_s - 1e-9,
            "preempted": resumed["preempted"] == preemption_resumes,
            "stream_interrupted": (resumed["migrated"] == migration_attempts or resumed["node_lost"] == node_loss_resumes
                                   or (n > 1 and bool(client.tokens))),
        }
        assert reached[code or ""]
