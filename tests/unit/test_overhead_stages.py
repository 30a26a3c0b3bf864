"""The stage breakdown of loadtest.dataplane.overhead_stages from synthetic wire sightings."""

from __future__ import annotations

import pytest

from contracts import subjects
from loadtest.dataplane.overhead_stages import STAGES_A, STAGES_B, Window, assign, breakdown

INBOX = subjects.worker_inbox("w0")
STREAM = f"{subjects.PREFIX}.stream.i-1.batch"


def ingress_request(sent: float, noise: bool = True) -> tuple[Window, list[tuple[float, str, str]]]:
    """A request through the ingress at `sent` (seconds), each stage 1 ms after the one before, with unrelated traffic."""
    window = Window("ingress", sent, answered=sent + 0.006)
    sightings = [
        (sent + 0.001, subjects.ROUTE, "_INBOX.a.1"),
        (sent + 0.002, "_INBOX.a.1", ""),
        (sent + 0.003, INBOX, "_INBOX.a.2"),
        (sent + 0.004, "_INBOX.a.2", ""),
        (sent + 0.0045, STREAM, ""),
        (sent + 0.0055, subjects.REQUEST_FINISHED, ""),
    ]
    if noise:  # a reply to someone else's request, and a heartbeat, between the stages
        sightings += [(sent + 0.0015, "_INBOX.other.7", ""), (sent + 0.0025, subjects.heartbeat("w0"), "")]
    return window, sightings


def test_each_stage_is_timed_from_its_own_messages_only() -> None:
    windows, sightings = [], []
    for number in range(3):
        window, seen = ingress_request(number * 0.01)
        windows.append(window)
        sightings += seen
    assign(windows, sightings)
    report = breakdown(windows, STAGES_A, INBOX)
    stages = report["stages_ms"]
    assert report["requests"] == 3
    assert report["total_ms"]["p50"] == pytest.approx(6.0)
    for name in ("sent -> route request", "route request -> route reply", "route reply -> hand-over", "hand-over -> accept"):
        assert stages[name]["p50"] == pytest.approx(1.0) and stages[name]["n"] == 3, name
    assert stages["accept -> frames"]["p50"] == pytest.approx(0.5)
    assert stages["frames -> response"]["p50"] == pytest.approx(1.5)


def test_a_message_seen_after_the_answer_belongs_to_no_request() -> None:
    window, seen = ingress_request(0.0, noise=False)
    late = [(at + 0.01, subject, reply) if subject == STREAM else (at, subject, reply) for at, subject, reply in seen]
    assign([window], late)
    stages = breakdown([window], STAGES_A, INBOX)["stages_ms"]
    assert stages["accept -> frames"]["n"] == 0 and stages["frames -> response"]["n"] == 0
    assert stages["hand-over -> accept"]["n"] == 1


def test_the_direct_path_has_no_route() -> None:
    window = Window("direct", 0.0, answered=0.003)
    assign([window], [(0.001, INBOX, "_INBOX.b.1"), (0.002, "_INBOX.b.1", ""), (0.0025, STREAM, "")])
    stages = breakdown([window], STAGES_B, INBOX)["stages_ms"]
    assert [stages[name]["p50"] for name in stages] == pytest.approx([1.0, 1.0, 0.5, 0.5])
