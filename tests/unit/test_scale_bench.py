"""The pure parts of `loadtest.dataplane.scale_bench`: histogram quantiles and bus rates."""

from __future__ import annotations

from collections import Counter

import pytest

from loadtest.dataplane.scale_bench import ScaleOptions, bus_rates, histogram_quantile, parse_args

INF = float("inf")


def test_quantile_interpolates_within_the_bucket_of_the_rank() -> None:
    before = {0.001: 10.0, 0.002: 10.0, INF: 10.0}
    after = {0.001: 60.0, 0.002: 110.0, INF: 110.0}  # 50 in (0, 1 ms], 50 in (1, 2 ms]
    assert histogram_quantile(before, after, 0.5) == pytest.approx(0.001)
    assert histogram_quantile(before, after, 0.75) == pytest.approx(0.0015)
    assert histogram_quantile(before, after, 0.25) == pytest.approx(0.0005)


def test_quantile_of_no_observations_is_none() -> None:
    same = {0.001: 5.0, INF: 5.0}
    assert histogram_quantile(same, same, 0.5) is None


def test_quantile_beyond_the_last_finite_bucket_is_its_bound() -> None:
    assert histogram_quantile({}, {0.001: 0.0, INF: 4.0}, 0.99) == 0.001


def test_bus_rates_add_full_and_load_heartbeats() -> None:
    before = Counter({"heartbeat_full_msgs": 1, "heartbeat_full_bytes": 500})
    after = Counter({"heartbeat_full_msgs": 3, "heartbeat_full_bytes": 1500, "heartbeat_load_msgs": 18, "heartbeat_load_bytes": 2400})
    rates = bus_rates(before, after, 2.0)
    assert rates["heartbeat_msgs_per_s"] == 10.0
    assert rates["heartbeat_bytes_per_s"] == 1700.0
    assert rates["kv_events_msgs_per_s"] == 0.0


def test_options_are_checked() -> None:
    assert parse_args(["--nodes", "16,64"]).sizes == [16, 64]
    with pytest.raises(ValueError, match="sizes"):
        ScaleOptions(sizes=[0]).check()
    with pytest.raises(ValueError, match="rate"):
        ScaleOptions(rate=0).check()
    with pytest.raises(SystemExit):
        parse_args(["--nodes", "a,b"])
