"""The routing study's capacity search: a bracket around the rate where attainment falls below 90%."""

from hypothesis import given
from hypothesis import strategies as st

from loadtest.routing_study import search_capacity


def falling_at(threshold: float):
    return lambda rate: 1.0 if rate <= threshold else 0.5


@given(threshold=st.floats(1.0, 1000.0), guess=st.floats(1.0, 1000.0), resolution=st.sampled_from([0.02, 0.05, 0.1]))
def test_brackets_the_threshold_within_the_resolution(threshold, guess, resolution):
    search = search_capacity(falling_at(threshold), guess, resolution, max_probes=40)
    assert search.capacity <= threshold < search.ceiling
    assert search.ceiling / search.capacity <= 1 + resolution
    assert all((attained >= 0.9) == (rate <= threshold) for rate, attained in search.probes)


def test_stops_at_the_probe_budget_and_reports_what_it_found():
    search = search_capacity(falling_at(1e9), guess=10.0, max_probes=5)
    assert len(search.probes) == 5
    assert search.ceiling is None
    assert search.capacity == 10.0 * 1.5**4


def test_a_policy_that_never_attains_has_no_capacity():
    search = search_capacity(lambda rate: 0.2, guess=10.0, max_probes=6)
    assert search.capacity == 0.0
    assert search.ceiling == 10.0 / 1.5**5
