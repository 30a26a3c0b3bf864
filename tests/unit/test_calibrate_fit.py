"""`kvlane calibrate`'s fit, without an engine: latencies made by the sim itself must give back its profile."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loadtest.simulation.calibrate import (
    COEFFICIENTS,
    LONE_FIRST_STEP,
    EngineLimits,
    RequestTrace,
    Rows,
    fit_rows,
    fitting_rows,
    make_prompts,
    sim_scheduler,
)
from services.worker.sim import SimRequest, StepTimeProfile

LIMITS = EngineLimits(max_num_seqs=16, max_batched_tokens=256, block_size=16, num_blocks=1024)
MAX_TOKENS = 6
# Magnitudes of the tiny CPU model's fit, each term far from the others.
TRUE = StepTimeProfile(name="true", a=2e-3, b=1.5e-5, c=3e-5, d=1.5e-7, per_request=2e-4, per_output_token=5e-5,
                       b2=4e-8, wake_latency=3e-3, lone_first_step=LONE_FIRST_STEP)  # b2: +2.6 ms at 256 tokens


def sim_traces(profile: StepTimeProfile, prompts: list[list[int]]) -> list[RequestTrace]:
    """What a client of an engine that behaves exactly like the sim would record for one batch."""
    scheduler = sim_scheduler(LIMITS, profile)
    traces = [RequestTrace(batch=len(prompts), prompt_token_ids=ids) for ids in prompts]
    for index, ids in enumerate(prompts):
        scheduler.add(SimRequest(str(index), ids, MAX_TOKENS))
    now = 0.0
    while scheduler.has_work():
        outcome = scheduler.step()
        now += outcome.duration_s
        for request_id, _ in outcome.emitted:
            traces[int(request_id)].chunks.append((now, 1))
    return traces


def grid_traces(profile: StepTimeProfile) -> list[RequestTrace]:
    rng = random.Random(0)
    # Batches over the token budget too, so that prefills are chunked and join running decodes.
    return [trace for length in (16, 64, 200) for batch in (1, 3, 8)
            for trace in sim_traces(profile, make_prompts(rng, batch, length, vocab_size=1000))]


def test_the_fit_recovers_a_profile_with_every_term() -> None:
    fit = fit_rows(fitting_rows(grid_traces(TRUE), MAX_TOKENS, LIMITS))
    expected = np.array([getattr(TRUE, key) for key in COEFFICIENTS])
    assert fit.coefficients == pytest.approx(expected, rel=1e-3)
    assert fit.ttft_mape < 1e-4 and fit.itl_mape < 1e-4
    profile = fit.profile("fitted")
    assert profile.lone_first_step == LONE_FIRST_STEP
    assert profile.per_request == pytest.approx(TRUE.per_request, rel=1e-3)
    assert profile.b2 == pytest.approx(TRUE.b2, rel=1e-3)
    assert profile.wake_latency == pytest.approx(TRUE.wake_latency, rel=1e-3)


def test_a_profile_without_the_later_terms_fits_them_as_zero() -> None:
    plain = StepTimeProfile(name="plain", a=2e-3, b=1.5e-5, c=3e-5, d=1.5e-7, lone_first_step=LONE_FIRST_STEP)
    fit = fit_rows(fitting_rows(grid_traces(plain), MAX_TOKENS, LIMITS))
    fitted = dict(zip(COEFFICIENTS, fit.coefficients, strict=True))
    for key in ("per_request", "per_output_token", "wake_latency"):
        assert fitted[key] == pytest.approx(0.0, abs=1e-7), key
    assert fitted["b2"] == pytest.approx(0.0, abs=1e-12)
    assert fit.coefficients[:4] == pytest.approx([2e-3, 1.5e-5, 3e-5, 1.5e-7], rel=1e-3)


def test_skewed_noise_leaves_the_fitted_itl_at_the_measured_median() -> None:
    """Latencies scattered around the truth (median factor 1, right-skewed in seconds): the fit targets the p50.

    Dividing each row by its own measurement instead would make the best
    value the 1/measurement-weighted median, ~exp(-sigma^2) = 0.85 of the
    p50 here, as every measured cell of a CPU engine showed.
    """
    exact = fitting_rows(grid_traces(TRUE), MAX_TOKENS, LIMITS)
    rng = np.random.default_rng(0)
    noisy = Rows()
    for _ in range(5):
        noisy.ttft_x += exact.ttft_x
        noisy.itl_x += exact.itl_x
        noisy.ttft_cell += exact.ttft_cell
        noisy.itl_cell += exact.itl_cell
        noisy.ttft_y += list(np.array(exact.ttft_y) * rng.lognormal(0.0, 0.4, len(exact.ttft_y)))
        noisy.itl_y += list(np.array(exact.itl_y) * rng.lognormal(0.0, 0.4, len(exact.itl_y)))
    fit = fit_rows(noisy)

    def p50_ratios(x: list[np.ndarray], y: list[float], cells: list[tuple[int, int]]) -> list[float]:
        fitted, measured = np.array(x) @ fit.coefficients, np.array(y)
        return [float(np.median(fitted[[i for i, c in enumerate(cells) if c == cell]])
                      / np.median(measured[[i for i, c in enumerate(cells) if c == cell]]))
                for cell in sorted(set(cells))]

    itl = p50_ratios(noisy.itl_x, noisy.itl_y, noisy.itl_cell)
    ttft = p50_ratios(noisy.ttft_x, noisy.ttft_y, noisy.ttft_cell)
    assert float(np.median(itl)) == pytest.approx(1.0, abs=0.05)
    # 5 to 40 TTFTs per cell against ~6x as many ITLs: only a loose check that TTFT is not given up for ITL.
    assert float(np.median(ttft)) == pytest.approx(1.0, abs=0.2)
