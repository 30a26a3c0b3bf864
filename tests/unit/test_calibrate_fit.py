"""`kvlane calibrate`'s fit, without an engine: latencies made by the sim itself must give back its profile."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loadtest.calibrate import (
    COEFFICIENTS,
    LONE_FIRST_STEP,
    EngineLimits,
    RequestTrace,
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
                       lone_first_step=LONE_FIRST_STEP)


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


def test_the_fit_recovers_a_profile_with_per_request_terms() -> None:
    fit = fit_rows(fitting_rows(grid_traces(TRUE), MAX_TOKENS, LIMITS))
    expected = np.array([getattr(TRUE, key) for key in COEFFICIENTS])
    assert fit.coefficients == pytest.approx(expected, rel=1e-3)
    assert fit.ttft_mape < 1e-4 and fit.itl_mape < 1e-4
    profile = fit.profile("fitted")
    assert profile.lone_first_step == LONE_FIRST_STEP
    assert profile.per_request == pytest.approx(TRUE.per_request, rel=1e-3)


def test_a_profile_without_per_request_terms_fits_them_as_zero() -> None:
    plain = StepTimeProfile(name="plain", a=2e-3, b=1.5e-5, c=3e-5, d=1.5e-7, lone_first_step=LONE_FIRST_STEP)
    fit = fit_rows(fitting_rows(grid_traces(plain), MAX_TOKENS, LIMITS))
    per_request, per_output_token = fit.coefficients[-2:]
    assert per_request == pytest.approx(0.0, abs=1e-7)
    assert per_output_token == pytest.approx(0.0, abs=1e-7)
    assert fit.coefficients[:4] == pytest.approx([2e-3, 1.5e-5, 3e-5, 1.5e-7], rel=1e-3)
