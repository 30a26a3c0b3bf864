"""Bench metrics (loadtest/bench/metrics.py) on hand-made request records."""

from __future__ import annotations

import math

import pytest

from loadtest.bench.client import RequestRecord, check_local
from loadtest.bench.metrics import (
    Slo,
    WorkerRun,
    coefficient_of_variation,
    inter_token_s,
    late_attainment,
    meets_slo,
    percentile,
    summarize,
    tpot_s,
    ttft_s,
)

SLO = Slo(ttft_s=0.5, tpot_s=0.05)


def _record(sent: float, first: float | None, tokens: int, step: float, *, request_id: str, prompt: int = 100,
            cached: int = 0, error: str | None = None, status: int = 200) -> RequestRecord:
    """A streamed request: first token at `first`, then one token every `step` seconds."""
    times = [] if first is None else [first + i * step for i in range(tokens)]
    return RequestRecord(
        session_id=request_id, group="g", turn=0, api="completions", max_tokens=tokens, scheduled_s=sent,
        sent_s=sent, first_token_s=first, token_times_s=times, end_s=None if error else (times[-1] if times else sent),
        status=status, error=error, request_id=request_id, prompt_tokens=None if error else prompt,
        completion_tokens=None if error else tokens, cached_tokens=None if error else cached,
    )


def test_per_request_latencies() -> None:
    record = _record(1.0, 1.2, 11, 0.01, request_id="a")
    assert ttft_s(record) == pytest.approx(0.2)
    # (e2e - ttft) / (tokens - 1) = (0.3 - 0.2) / 10
    assert tpot_s(record) == pytest.approx(0.01)
    assert inter_token_s(record) == pytest.approx([0.01] * 10)
    single = _record(0.0, 0.1, 1, 0.0, request_id="b")
    assert tpot_s(single) is None
    assert meets_slo(single, SLO)  # one token: TPOT cannot fail


def test_slo_needs_both_ttft_and_tpot() -> None:
    assert meets_slo(_record(0.0, 0.4, 5, 0.04, request_id="ok"), SLO)
    assert not meets_slo(_record(0.0, 0.6, 5, 0.01, request_id="slow-first"), SLO)
    assert not meets_slo(_record(0.0, 0.1, 5, 0.06, request_id="slow-decode"), SLO)
    assert not meets_slo(_record(0.0, None, 5, 0.0, request_id="failed", error="http_503: busy", status=503), SLO)


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_coefficient_of_variation() -> None:
    assert coefficient_of_variation([5, 5, 5, 5]) == 0.0
    assert coefficient_of_variation([10, 0]) == pytest.approx(1.0)
    assert coefficient_of_variation([1, 2, 3]) == pytest.approx(math.sqrt(2 / 3) / 2)
    assert coefficient_of_variation([]) is None
    assert coefficient_of_variation([0, 0]) is None


def test_summary_of_a_run() -> None:
    records = [
        _record(0.0, 0.2, 11, 0.01, request_id="r1", prompt=100, cached=0),  # meets both SLOs
        _record(0.5, 1.5, 11, 0.01, request_id="r2", prompt=100, cached=80),  # TTFT 1.0 s: misses
        _record(1.0, 1.1, 3, 0.1, request_id="r3", prompt=200, cached=100),  # TPOT 0.1 s: misses
        _record(1.5, None, 3, 0.0, request_id="r4", error="http_503: no capacity", status=503),
        _record(2.0, 2.1, 2, 0.05, request_id="r5", prompt=100, cached=20),  # meets; ends at 2.15
    ]
    runs = {
        "r1": WorkerRun("w0", 0.25), "r2": WorkerRun("w0", 0.9), "r3": WorkerRun("w1", 0.3),
        "r5": WorkerRun("w0", 0.1), "not-ours": WorkerRun("w1", 1.0),
    }
    summary = summarize(records, SLO, runs, worker_ids=["w0", "w1", "w2"])

    assert summary["requests"] == 5 and summary["succeeded"] == 4 and summary["failed"] == 1
    assert summary["errors"] == {"http_503": 1}
    span = 2.15 - 0.0
    assert summary["span_s"] == pytest.approx(span)
    assert summary["request_throughput_rps"] == pytest.approx(4 / span)
    assert summary["goodput_rps"] == pytest.approx(2 / span)
    assert summary["slo_attainment"] == pytest.approx(2 / 5)
    assert summary["output_token_throughput_tps"] == pytest.approx((11 + 11 + 3 + 2) / span)
    assert summary["total_token_throughput_tps"] == pytest.approx((27 + 500) / span)
    assert summary["prefix_cache_hit_rate"] == pytest.approx(200 / 500)
    assert summary["ttft_ms"]["count"] == 4
    assert summary["ttft_ms"]["p50"] == pytest.approx(150.0)  # 100, 100, 200, 1000 ms
    assert summary["ttft_ms"]["max"] == pytest.approx(1000.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx(30.0)  # 10, 10, 50, 100 ms
    assert summary["itl_ms"]["count"] == 10 + 10 + 2 + 1
    assert summary["e2e_ms"]["max"] == pytest.approx(1100.0)
    # E2E minus the worker's own duration: 0.3-0.25, 1.1-0.9, 0.3-0.3, 0.15-0.1
    assert summary["wait_before_worker_ms"]["mean"] == pytest.approx(1000 * (0.05 + 0.2 + 0.0 + 0.05) / 4)
    # Only this run's requests count; the idle worker counts as 0.
    assert summary["requests_per_worker"] == {"w0": 3, "w1": 1, "w2": 0}
    assert summary["load_cv"] == pytest.approx(coefficient_of_variation([3, 1, 0]))
    assert summary["finished_events_matched"] == 4


def test_summary_of_nothing_is_well_formed() -> None:
    summary = summarize([], SLO)
    assert summary["requests"] == 0
    assert summary["request_throughput_rps"] == 0.0
    assert summary["ttft_ms"] == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    assert summary["prefix_cache_hit_rate"] is None
    assert summary["load_cv"] is None


def test_record_json_leaves_the_answer_text_out() -> None:
    record = _record(0.0, 0.1, 2, 0.01, request_id="x")
    record.text = " some answer"
    data = record.to_json()
    assert "text" not in data
    assert data["request_id"] == "x" and data["completion_tokens"] == 2


@pytest.mark.parametrize("url", ["http://localhost:8000", "http://10.0.0.1:8000", "https://127.0.0.1:8000",
                                 "http://127.0.0.1"])
def test_client_refuses_non_local_targets(url: str) -> None:
    with pytest.raises(ValueError, match="only http://127.0.0.1"):
        check_local(url)
    assert check_local("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"


def test_late_attainment_counts_the_last_quarter_of_the_arrivals_and_not_the_fleet_emptying() -> None:
    # Sessions arrive from 0 to 10 s; a fleet falling behind misses the SLO from 8 s on.
    records = [_record(t / 2, t / 2 + (0.9 if t / 2 >= 8 else 0.1), 3, 0.01, request_id=f"s{t}") for t in range(21)]
    # Later turns scheduled after the last arrival meet an emptying fleet: left out, however they fared.
    later = [_record(10.5 + t, 10.6 + t, 3, 0.01, request_id=f"t{t}") for t in range(10)]
    for record in later:
        record.turn = 1
    whole = summarize(records + later, SLO)
    assert whole["slo_attainment"] == pytest.approx(26 / 31)
    # From 7.5 s to 10 s: 7.5 meets it, 8.0 to 10.0 do not.
    assert late_attainment(records + later, SLO) == pytest.approx(1 / 6)
    assert whole["slo_attainment_late"] == pytest.approx(1 / 6)
    assert late_attainment(records, SLO, share=1.0) == pytest.approx(16 / 21)
    assert late_attainment(later, SLO) is None  # no session arrived among these
    assert late_attainment([], SLO) is None
