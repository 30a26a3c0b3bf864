"""`kvlane calibrate`: fit the sim's step-time profile to a real vLLM engine.

The sim charges every batched forward pass (shared/kv/step_profile.py)

    step = a + b*prefill_tokens + c*decode_seqs + d*kv_tokens
             + per_request*new_requests + per_output_token*emitted_tokens
             + b2*prefill_tokens**2 + wake_latency*[first step after reaching an idle engine]

where, as its scheduler counts them, ``kv_tokens`` sums the context each
sequence in the step attends to (a prefill chunk counts its context after
the chunk; a decode counts its context including the fed-back token),
``new_requests`` counts the requests the step admits for the first time and
``emitted_tokens`` the tokens it produces. Client-visible latencies are sums
of steps, so they are linear in the eight coefficients:

* TTFT of a request = the steps from its arrival to the one that finishes its
  prefill. A lone request prefilled in one step gives
  ``TTFT = a + (b + d) * P + per_request + per_output_token`` (P prompt
  tokens): b and d are confounded there, and requests arriving together add
  queueing (earlier chunks, other prompts in the same steps) on top.
* ITL in a decode step of B sequences with contexts L_i:
  ``ITL = a + (c + per_output_token)*B + d*sum(L_i)``; a prefill that joins
  mid-stream adds ``b * chunk + per_request`` to that step.

Rather than approximating the queueing, each measured batch is replayed
through the sim's own ``SimScheduler`` (with the engine's max_num_seqs,
token budget and block size): every step contributes a feature vector
``x = (1, prefill_tokens, decode_seqs, kv_tokens, new_requests,
emitted_tokens, prefill_tokens**2, wakes)``, and every latency the client saw becomes an exact sum of
them:

    TTFT_r   = (sum of x over the steps until r's first output) . coefficients
    ITL_r,k  = (sum of x over the steps since r's previous output) . coefficients

(When vLLM delivers n tokens in one output, that output's equation is
divided by n: n inter-token gaps of equal share.) All equations are solved
together for coefficients >= 0, minimising the absolute error of each
relative to the median measurement of its cell, TTFT and ITL weighing the
same (see ``fit_rows``). The fit error is the mean absolute relative error
(MAPE), reported separately for TTFT and ITL, on the measurements the fit
was made from.

The replay, like the sim the profile is made for, runs the first request of
each batch alone (``lone_first_step``, see ``LONE_FIRST_STEP``). The two
per-request terms differ from ``c`` only in the step that ends a prefill
(it emits a token for a sequence that ``c`` does not count) and in
admissions, so on a few shapes the fit may move cost between them freely.
Every measured batch reaches an idle engine, so ``wake_latency`` is a
constant on every TTFT here and on no ITL: it takes the serving process's
share of the TTFT, which ``a`` and ``per_request`` absorbed before (and
then overcharged every step of a longer burst).

    kvlane calibrate                       # the tiny CPU model, built if needed
    kvlane calibrate --model /models/llama --batch-sizes 1,8,64 --prompt-tokens 128,1024
    # then: KVLANE__WORKER__SIM__PROFILE=file:loadtest/results/calibrated-profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import itertools
import json
import os
import random
import statistics
import tempfile
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from services.worker.sim import SimRequest, SimScheduler, StepTimeProfile, get_profile

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
DEFAULT_OUT = RESULTS_DIR / "calibrated-profile.json"
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)
DEFAULT_PROMPTS = (32, 128, 512)
DEFAULT_MAX_TOKENS = 32
# Prompt token ids are drawn above the tokenizer's special tokens.
LOWEST_TOKEN_ID = 16
COEFFICIENTS = ("a", "b", "c", "d", "per_request", "per_output_token", "b2", "wake_latency")
# A batch sent at once to an idle vLLM engine mostly starts with its first
# request alone (tiny CPU model, batches of 4-16 requests: 159 of 208 on a
# quiet machine, 80 of 144 on a busy one): the engine core steps as soon as
# one request has reached it, while the serving process is still handing it
# the others. A sim that puts the whole batch in its first step had the TTFT
# of 12 x 256 tokens (over the token budget) 20-30% low.
LONE_FIRST_STEP = True


# --- measuring ------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineLimits:
    """The engine's scheduler limits; the sim replays (and later predicts) with the same ones."""

    max_num_seqs: int
    max_batched_tokens: int
    block_size: int
    num_blocks: int


@dataclass
class RequestTrace:
    """One request of a batch as the client saw it."""

    batch: int
    prompt_token_ids: list[int]
    # (seconds since the batch was submitted, tokens in that output), in order.
    chunks: list[tuple[float, int]] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def ttft_s(self) -> float:
        return self.chunks[0][0]

    def itl_s(self) -> list[float]:
        """Per-token gaps; an output carrying n tokens counts as n gaps of 1/n of its wait."""
        return [(t1 - t0) / n for (t0, _), (t1, n) in itertools.pairwise(self.chunks) for _ in range(n)]


def make_prompts(rng: random.Random, count: int, length: int, vocab_size: int) -> list[list[int]]:
    # Fresh random ids per request: nothing may come from a prefix cache.
    return [[rng.randrange(LOWEST_TOKEN_ID, vocab_size) for _ in range(length)] for _ in range(count)]


async def measure_batch(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> list[RequestTrace]:
    """Submit ``prompts`` at once to a vLLM ``AsyncLLM``; every request generates exactly ``max_tokens``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    # One start time for the whole batch: the sim sees the batch arrive at once,
    # so the time vLLM takes to accept the last request is part of its TTFT.
    started = time.perf_counter()

    async def one(index: int, ids: list[int]) -> RequestTrace:
        trace = RequestTrace(batch=len(prompts), prompt_token_ids=ids)
        async for output in engine.generate(TokensPrompt(prompt_token_ids=ids), params, f"{tag}-{index}"):
            if n := len(output.outputs[0].token_ids):
                trace.chunks.append((time.perf_counter() - started, n))
        return trace

    return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))


async def warm_up(engine: Any, batch: int, prompt_lengths: list[int], rng: random.Random) -> None:
    """Discarded batches: first calls pay one-off costs (allocations, kernel selection), not the steady state."""
    vocab = engine.model_config.get_vocab_size()
    for length in prompt_lengths:
        await measure_batch(engine, make_prompts(rng, batch, length, vocab), 4, f"warmup-{length}")


async def measure_cells(engine: Any, cells: list[tuple[int, int]], max_tokens: int, rng: random.Random,
                        tag: str) -> list[list[RequestTrace]]:
    """One batch per (prompt tokens, batch size) cell, in the given order; the traces of each batch."""
    vocab = engine.model_config.get_vocab_size()
    return [await measure_batch(engine, make_prompts(rng, batch, length, vocab), max_tokens,
                                f"{tag}-{i}-{length}-{batch}")
            for i, (length, batch) in enumerate(cells)]


async def measure_grid(engine: Any, batches: list[int], prompt_lengths: list[int], max_tokens: int, repeats: int,
                       seed: int, on_batch: Any = None) -> list[RequestTrace]:
    """Every (prompt length, batch size) cell ``repeats`` times, after a warm-up; traces in batch order."""
    rng = random.Random(seed)
    await warm_up(engine, max(batches), prompt_lengths, rng)
    traces: list[RequestTrace] = []
    for repeat in range(repeats):
        for length, batch in itertools.product(prompt_lengths, batches):
            (batch_traces,) = await measure_cells(engine, [(length, batch)], max_tokens, rng, f"cal-{repeat}")
            traces += batch_traces
            if on_batch is not None:
                on_batch()
    return traces


def engine_limits(engine: Any) -> EngineLimits:
    config = engine.vllm_config
    return EngineLimits(
        max_num_seqs=config.scheduler_config.max_num_seqs,
        max_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        block_size=config.cache_config.block_size,
        num_blocks=config.cache_config.num_gpu_blocks or 1 << 16,
    )


# --- replaying through the sim -----------------------------------------------------------


def sim_scheduler(limits: EngineLimits, profile: StepTimeProfile) -> SimScheduler:
    return SimScheduler(num_blocks=limits.num_blocks, block_size=limits.block_size, max_num_seqs=limits.max_num_seqs,
                        max_batched_tokens=limits.max_batched_tokens, profile=profile, output_token_range=(0, 1 << 16))


def token_features(prompts: list[list[int]], max_tokens: int, limits: EngineLimits) -> list[np.ndarray]:
    """Per request, a (max_tokens x len(COEFFICIENTS)) array: the summed step features up to each of its output tokens.

    Which steps run what does not depend on the coefficients, so the replay
    uses an all-zero profile and keeps the step shapes.
    """
    replay = msgspec.structs.replace(get_profile("zero"), lone_first_step=LONE_FIRST_STEP)
    scheduler = sim_scheduler(limits, replay)
    for index, ids in enumerate(prompts):
        scheduler.add(SimRequest(str(index), ids, max_tokens))
    elapsed = np.zeros(len(COEFFICIENTS))
    marks: list[list[np.ndarray]] = [[] for _ in prompts]
    while scheduler.has_work():
        outcome = scheduler.step()
        if outcome.prefill_tokens or outcome.decode_seqs:  # the profile charges nothing for an empty step
            elapsed = elapsed + (1.0, outcome.prefill_tokens, outcome.decode_seqs, outcome.kv_tokens,
                                 outcome.new_requests, len(outcome.emitted), outcome.prefill_tokens**2,
                                 float(outcome.wakes))
        for request_id, _ in outcome.emitted:
            marks[int(request_id)].append(elapsed)
    return [np.array(m) for m in marks]


@dataclass
class Rows:
    """The fitting equations: features (n x len(COEFFICIENTS)) . coefficients ~ measured seconds."""

    ttft_x: list[np.ndarray] = field(default_factory=list)
    ttft_y: list[float] = field(default_factory=list)
    itl_x: list[np.ndarray] = field(default_factory=list)
    itl_y: list[float] = field(default_factory=list)
    # (prompt tokens, batch size) of each row, for the report.
    ttft_cell: list[tuple[int, int]] = field(default_factory=list)
    itl_cell: list[tuple[int, int]] = field(default_factory=list)


def fitting_rows(traces: list[RequestTrace], max_tokens: int, limits: EngineLimits) -> Rows:
    rows = Rows()
    # Replay each batch as it was sent: consecutive traces of one batch share its size.
    index = 0
    while index < len(traces):
        batch = traces[index : index + traces[index].batch]
        index += len(batch)
        features = token_features([t.prompt_token_ids for t in batch], max_tokens, limits)
        for trace, cumulative in zip(batch, features, strict=True):
            first = trace.chunks[0][1] - 1  # index of the last token of the first output
            cell = (trace.prompt_tokens, trace.batch)
            rows.ttft_x.append(cumulative[first])
            rows.ttft_y.append(trace.ttft_s)
            rows.ttft_cell.append(cell)
            # Each later output is one ITL equation per token it carries: the
            # steps since the previous output, shared out over its n tokens.
            seen, previous_s = first, trace.ttft_s
            for at_s, n in trace.chunks[1:]:
                rows.itl_x.append((cumulative[seen + n] - cumulative[seen]) / n)
                rows.itl_y.append((at_s - previous_s) / n)
                rows.itl_cell.append(cell)
                seen, previous_s = seen + n, at_s
    return rows


# --- fitting ----------------------------------------------------------------------------


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x.w - y|| subject to w >= 0, exactly, for a handful of columns.

    The optimum is the unconstrained fit on its own support, so trying every
    support and keeping the best non-negative solution finds it (2^8 - 1
    small solves; no scipy needed).
    """
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale  # columns differ by ~1e4 (1 vs kv_tokens): keep lstsq well conditioned
    best, best_residual = np.zeros(x.shape[1]), float(np.sum(y**2))
    for size in range(1, x.shape[1] + 1):
        for support in itertools.combinations(range(x.shape[1]), size):
            w, *_ = np.linalg.lstsq(xs[:, support], y, rcond=None)
            if np.any(w < 0):
                continue
            candidate = np.zeros(x.shape[1])
            candidate[list(support)] = w
            residual = float(np.sum((xs @ candidate - y) ** 2))
            if residual < best_residual:
                best, best_residual = candidate, residual
    return best / scale


def mape(x: list[np.ndarray], y: list[float], coefficients: np.ndarray) -> float:
    measured = np.array(y)
    return float(np.mean(np.abs(np.array(x) @ coefficients - measured) / measured)) if y else float("nan")


@dataclass
class Fit:
    coefficients: np.ndarray  # in COEFFICIENTS order
    ttft_mape: float
    itl_mape: float
    ttft_rows: int
    itl_rows: int

    def profile(self, name: str) -> StepTimeProfile:
        fitted = {key: float(value) for key, value in zip(COEFFICIENTS, self.coefficients, strict=True)}
        return StepTimeProfile(name=name, lone_first_step=LONE_FIRST_STEP, **fitted)


IRLS_ROUNDS = 40
# Residuals below this (relative) stop growing a row's weight: keeps IRLS finite.
IRLS_FLOOR = 1e-3


def cell_medians(values: list[float], cells: list[tuple[int, int]]) -> np.ndarray:
    """For each value, the median of the values of its cell."""
    by_cell: dict[tuple[int, int], list[float]] = {}
    for value, cell in zip(values, cells, strict=True):
        by_cell.setdefault(cell, []).append(value)
    medians = {cell: statistics.median(group) for cell, group in by_cell.items()}
    return np.array([medians[cell] for cell in cells])


def fit_rows(rows: Rows) -> Fit:
    """Coefficients minimising the relative absolute error of every measured TTFT and ITL, subject to >= 0.

    Each equation is divided by the median measurement of its cell (same
    metric, prompt length and batch size), so 5 ms ITLs count as much as
    500 ms TTFTs. Absolute rather than squared error (iteratively
    reweighted least squares, weights 1/|residual|): on a shared CPU,
    outputs arrive in bursts (gaps of 1/3 and 3x the step time) and the odd
    batch stalls for 100 ms; squared error chases those, absolute error
    fits the typical step, which is what p50s compare. The divisor is the
    cell's median, not the row's own measurement: that would make the best
    constant for a cell the median weighted by 1/measurement, below the
    median on skewed latencies (every cell's fitted ITL p50 came out 5-20%
    under the measured one). TTFT and ITL rows weigh the same in total
    (a request gives one TTFT and max_tokens - 1 ITLs), so the few TTFTs
    still pin down ``b``, ``b2``, ``per_request`` and ``wake_latency``.
    """
    x = np.array(rows.ttft_x + rows.itl_x)
    y = np.array(rows.ttft_y + rows.itl_y)
    scale = np.concatenate([cell_medians(rows.ttft_y, rows.ttft_cell), cell_medians(rows.itl_y, rows.itl_cell)])
    share = np.ones(len(y))
    if rows.ttft_y and rows.itl_y:
        share[: len(rows.ttft_y)] = len(rows.itl_y) / len(rows.ttft_y)
    relative, target = x / scale[:, None], y / scale
    weights = np.ones(len(y))
    for _ in range(IRLS_ROUNDS):
        root = np.sqrt(share * weights)
        coefficients = nonnegative_least_squares(relative * root[:, None], target * root)
        weights = 1.0 / np.maximum(np.abs(relative @ coefficients - target), IRLS_FLOOR)
    return Fit(coefficients, mape(rows.ttft_x, rows.ttft_y, coefficients), mape(rows.itl_x, rows.itl_y, coefficients),
               len(rows.ttft_y), len(rows.itl_y))


# --- the engine -------------------------------------------------------------------------


@dataclass
class Options:
    model: str | None
    batches: list[int]
    prompt_lengths: list[int]
    max_tokens: int
    repeats: int
    seed: int
    out: Path
    name: str | None
    max_model_len: int | None
    block_size: int | None
    kv_cache_gib: float
    enforce_eager: bool | None
    dtype: str


def engine_args(options: Options, model_dir: Path, tiny: bool) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    needed = max(options.prompt_lengths) + options.max_tokens
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": options.dtype if options.dtype != "auto" or not tiny else "float32",
        "max_model_len": options.max_model_len or needed,
        # Every request must compute its whole prompt; the fit has no cache-hit term.
        "enable_prefix_caching": False,
        # torch.compile costs ~40 s per start on the tiny model and buys nothing there;
        # on a GPU, calibrate as you serve (CUDA graphs on) unless told otherwise.
        "enforce_eager": tiny if options.enforce_eager is None else options.enforce_eager,
        "disable_log_stats": True,
    }
    if options.block_size or tiny:
        args["block_size"] = options.block_size or 32  # the CPU backend wants multiples of 32
    if options.kv_cache_gib:
        args["kv_cache_memory_bytes"] = int(options.kv_cache_gib * (1 << 30))
    return AsyncEngineArgs(**args)


@contextlib.asynccontextmanager
async def running_engine(args: Any) -> AsyncIterator[Any]:
    """A vLLM ``AsyncLLM`` for the block, shut down and garbage-collected at its end.

    The block gets a weak proxy: AsyncLLM sits in a reference cycle, and if a
    caller's variable kept it alive until interpreter exit its ``__del__``
    (which shuts down again) would run after vLLM's module globals are gone
    and print a TypeError traceback.
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(args)
    try:
        yield weakref.proxy(engine)
    finally:
        engine.shutdown()
        await asyncio.sleep(0)  # the cancelled output-handler task holds the engine until it has run
        del engine
        gc.collect()


def prepare_process() -> None:
    """Before any engine exists: AMX permission (inherited by engine subprocesses) and CPU thread placement."""
    from vllm.platforms import current_platform

    from services.worker.amx import request_amx_permission

    request_amx_permission()
    if current_platform.is_cpu():
        # Keep a core for this process's event loop, which timestamps every
        # output: otherwise it competes with the engine's OpenMP threads and
        # the measured latencies include that contention.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


async def run(options: Options, console: Console) -> dict[str, Any]:
    tiny = options.model is None
    if tiny:
        from launch.tiny_model import ensure_tiny_model

        model_dir = ensure_tiny_model(Path(tempfile.gettempdir()) / "kvlane-calibrate" / "tiny-llama")
    else:
        model_dir = Path(options.model).expanduser().resolve()
    console.print(f"starting vLLM on {model_dir} ...")
    async with running_engine(engine_args(options, model_dir, tiny)) as engine:
        limits = engine_limits(engine)
        cells = len(options.batches) * len(options.prompt_lengths) * options.repeats
        started = time.perf_counter()
        with console.status(f"measuring {cells} batches") as status:
            done = itertools.count(1)
            traces = await measure_grid(engine, options.batches, options.prompt_lengths, options.max_tokens,
                                        options.repeats, options.seed,
                                        on_batch=lambda: status.update(f"measured {next(done)}/{cells} batches"))
        measured_s = time.perf_counter() - started
    rows = fitting_rows(traces, options.max_tokens, limits)
    fit = fit_rows(rows)
    print_report(console, rows, fit)
    document = profile_document(options, model_dir, limits, fit, len(traces), measured_s)
    return document


def profile_document(options: Options, model_dir: Path, limits: EngineLimits, fit: Fit, requests: int,
                     measured_s: float) -> dict[str, Any]:
    from importlib import metadata

    import vllm
    from vllm.platforms import current_platform

    profile = fit.profile(options.name or f"calibrated-{model_dir.name}")
    return {
        "name": profile.name, **{key: getattr(profile, key) for key in COEFFICIENTS},
        "lone_first_step": profile.lone_first_step,
        "fitted_on": {
            "model": str(model_dir), "vllm": vllm.__version__, "device": current_platform.device_type,
            "cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
            "batch_sizes": options.batches, "prompt_tokens": options.prompt_lengths,
            "max_tokens": options.max_tokens, "repeats": options.repeats, "requests": requests,
            # Use these as the sim's max_num_seqs / max_batched_tokens / block_size for the fit to hold.
            "max_num_seqs": limits.max_num_seqs, "max_batched_tokens": limits.max_batched_tokens,
            "block_size": limits.block_size, "kv_blocks": limits.num_blocks,
            "measured_s": round(measured_s, 2), "kvlane": metadata.version("kvlane"),
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        },
        "fit_error": {"ttft_mape": round(fit.ttft_mape, 4), "itl_mape": round(fit.itl_mape, 4),
                      "ttft_rows": fit.ttft_rows, "itl_rows": fit.itl_rows},
    }


# --- report -------------------------------------------------------------------------------


def _median_ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):.2f}" if values else "-"


def print_report(console: Console, rows: Rows, fit: Fit) -> None:
    table = Table(title="measured vs fitted: p50 per cell (ms)")
    for column in ("prompt", "batch", "TTFT meas", "TTFT fit", "ITL meas", "ITL fit"):
        table.add_column(column, justify="right")
    fitted_ttft = list(np.array(rows.ttft_x) @ fit.coefficients)
    fitted_itl = list(np.array(rows.itl_x) @ fit.coefficients) if rows.itl_x else []

    def pick(cells: list[tuple[int, int]], values: list[float], cell: tuple[int, int]) -> list[float]:
        return [float(v) for c, v in zip(cells, values, strict=True) if c == cell]

    for cell in sorted(set(rows.ttft_cell)):
        table.add_row(str(cell[0]), str(cell[1]),
                      _median_ms(pick(rows.ttft_cell, rows.ttft_y, cell)),
                      _median_ms(pick(rows.ttft_cell, fitted_ttft, cell)),
                      _median_ms(pick(rows.itl_cell, rows.itl_y, cell)),
                      _median_ms(pick(rows.itl_cell, fitted_itl, cell)))
    console.print(table)
    a, b, c, d, per_request, per_output_token, b2, wake_latency = fit.coefficients
    console.print(f"a = {a * 1e3:.3f} ms   b = {b * 1e6:.3f} us/prefill token   c = {c * 1e6:.3f} us/decode seq   "
                  f"d = {d * 1e9:.3f} ns/KV token   per request {per_request * 1e6:.1f} us   "
                  f"per output token {per_output_token * 1e6:.1f} us   b2 = {b2 * 1e9:.3f} ns/prefill token^2   "
                  f"wake latency {wake_latency * 1e3:.2f} ms")
    console.print(f"fit error (MAPE): TTFT {fit.ttft_mape:.1%} over {fit.ttft_rows} requests, "
                  f"ITL {fit.itl_mape:.1%} over {fit.itl_rows} outputs")


# --- command line -----------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlane calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the tiny CPU test model, built if needed)")
    parser.add_argument("--batch-sizes", type=_int_list, default=list(DEFAULT_BATCHES),
                        help="concurrent requests, comma-separated (default: 1,2,4,8,16,32)")
    parser.add_argument("--prompt-tokens", type=_int_list, default=list(DEFAULT_PROMPTS),
                        help="prompt lengths, comma-separated (default: 32,128,512)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="output tokens per request (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="times each cell is measured (default: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="profile JSON to write (default: loadtest/results/calibrated-profile.json)")
    parser.add_argument("--name", help="profile name (default: calibrated-<model directory name>)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int, help="default: longest prompt + max tokens")
    engine.add_argument("--block-size", type=int, help="default: 32 for the tiny model, vLLM's otherwise")
    engine.add_argument("--kv-cache-gib", type=float, default=1.0,
                        help="KV cache size; 0: vLLM's own sizing (default: 1)")
    engine.add_argument("--dtype", default="auto", help="float32 for the tiny model when auto")
    engine.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction,
                        help="default: on for the tiny model, off (CUDA graphs) for --model")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_tokens < 2 or args.repeats < 1:
        build_parser().error("--max-tokens must be >= 2 (ITL needs two tokens) and --repeats >= 1")
    options = Options(model=args.model, batches=args.batch_sizes, prompt_lengths=args.prompt_tokens,
                      max_tokens=args.max_tokens, repeats=args.repeats, seed=args.seed, out=args.out, name=args.name,
                      max_model_len=args.max_model_len, block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
                      enforce_eager=args.enforce_eager, dtype=args.dtype)
    console = Console()
    prepare_process()
    document = asyncio.run(run(options, console))
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(document, indent=2) + "\n")
    console.print(f"profile written to {options.out}; use it with sim profile [bold]file:{options.out}[/]")
    return 0


if __name__ == "__main__":  # vLLM's engine starts subprocesses that may re-import this module
    raise SystemExit(main())
