"""How `loadtest.dataplane.hangup` judges one hang-up: aborted, ended first, stalled or leaked."""

from __future__ import annotations

from loadtest.dataplane.hangup import HangUp


def hang_up(reasons: list[str], tokens: int, seconds_to_hang_up: float = 0.02, ended_before: bool = False) -> HangUp:
    return HangUp("r1", 5, seconds_to_hang_up, 0.0, reasons, tokens, ended_before, 0.01)


def test_verdicts() -> None:
    assert hang_up(["w0:abort"], 7).verdict(4000) == "aborted"
    assert hang_up(["w0:length"], 4000, ended_before=True).verdict(4000) == "ended_first"
    assert hang_up(["w0:length"], 4000).verdict(4000) == "leaked"
    # An attempt that ran on beside one that was aborted is a leak.
    assert hang_up(["w1:length", "w0:abort"], 7).verdict(4000) == "leaked"


def test_a_hang_up_the_fleet_was_too_busy_to_deliver_in_time_is_stalled_not_leaked() -> None:
    late = hang_up(["w0:length"], 4000, seconds_to_hang_up=3.0)
    assert late.verdict(4000, stall_s=1.5) == "stalled"
    assert late.verdict(4000) == "leaked"  # without a bound every run-on is a leak
    # A prompt hang-up that runs on is a leak whatever the bound.
    assert hang_up(["w0:length"], 4000, seconds_to_hang_up=0.05).verdict(4000, stall_s=1.5) == "leaked"
    # An aborted one is aborted however late it came.
    assert hang_up(["w0:abort"], 900, seconds_to_hang_up=3.0).verdict(4000, stall_s=1.5) == "aborted"


def test_a_request_the_worker_ran_within_the_clients_time_may_have_ended_first_whenever_its_event_came() -> None:
    """The worker took it after the client sent it: 0.8 s of running within the client's 1.2 s may have
    ended before the hang-up, with its `RequestFinished` still on the way; 2 s of running did not."""
    def ran(seconds_on_worker: float | None) -> HangUp:
        return HangUp("r1", 5, 1.2, 0.0, ["w0:length"], 4000, False, 0.01, seconds_on_worker)

    assert ran(0.8).verdict(4000) == "ended_first"
    assert ran(1.2).verdict(4000) == "ended_first"
    assert ran(2.0).verdict(4000) == "leaked"
    assert ran(None).verdict(4000) == "leaked"
    # Two attempts, or an abort beside a run to the end, are judged as before.
    two = HangUp("r1", 5, 1.2, 0.0, ["w1:length", "w0:abort"], 7, False, 0.01, 0.5)
    assert two.verdict(4000) == "leaked"
