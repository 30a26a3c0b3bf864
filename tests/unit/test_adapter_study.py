"""The adapter study's measure of slot demand: distinct adapters with a request in flight, over time."""

from __future__ import annotations

import pytest

from loadtest.routing.adapter_study import adapters_in_flight


def record(model: str, sent_s: float, end_s: float | None) -> dict:
    return {"model": model, "sent_s": sent_s, "end_s": end_s}


def test_adapters_in_flight_counts_each_adapter_once_while_any_of_its_requests_runs() -> None:
    # a: two overlapping requests over [0, 10); b: one over [0, 5); from 10 on only the late one, which counts until
    # the last sending (10).
    records = [record("a", 0.0, 6.0), record("a", 4.0, 10.0), record("b", 0.0, 5.0), record("c", 10.0, 12.0),
               record("lost", 1.0, None)]
    assert adapters_in_flight(records, step_s=1.0, settle_s=0.0) == pytest.approx((5 * 2 + 5 * 1 + 1) / 11)
    assert adapters_in_flight(records, step_s=1.0, settle_s=20.0) is None  # nothing sampled
    assert adapters_in_flight([]) is None
