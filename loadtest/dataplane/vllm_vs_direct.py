"""What kvlane costs in front of real vLLM: the same workload through kvlane and straight to vLLM.

One run builds the tiny model, then starts, on free ports of 127.0.0.1:
A. kvlane: nats-server, redis-server, balancer, ONE vllm worker, ingress;
B. vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`)
   with the same model and engine settings.
Both serve `POST /v1/completions` with streaming. Each round sends the same
fresh prompts (token ids, so both engines see identical input and neither
has them cached) through A, then B, then the next round's through B, then
A, so that drift hits both alike. Temperature 0: both generate the same
tokens. A closed loop of C clients measures throughput (completion tokens
per second of wall time), TTFT and inter-token latency (ITL) per path, and
the CPU seconds each process tree used (where kvlane's cost goes).

For each concurrency level both servers are started anew: the first round
("fresh") runs right after both report ready, as a new user would see
them; the following rounds ("warm") run after it. While one path is
measured the other's processes are stopped (SIGSTOP): an idle vLLM engine
keeps polling, and on 2 cores that noise would swamp the difference.

One run of a path moves by up to 1.5x from the next on a shared machine
(the engine's own CPU per token moves with it), and a start gives only one
fresh round per path. `--starts S` starts both servers S times per level;
the summary is the median over starts of each start's fresh ratio, and
the median over all warm rounds of each round's ratio.

    python -m loadtest.dataplane.vllm_vs_direct [--concurrency 8,32,64] [--requests N] [--rounds R] [--starts S] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from launch.fleet import start_fleet, with_overrides
from launch.launcher import Launcher, Process, free_port
from loadtest.bench.machine import machine_info
from loadtest.bench.metrics import latency_summary
from shared.config import KvlaneConfig

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "vllm_vs_direct.json"
HOST = "127.0.0.1"
MODEL = "tiny-llama"
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Options:
    concurrency: int = 16  # the level being measured (one of `levels`)
    levels: tuple[int, ...] = (8, 32, 64)
    requests: int = 64  # per round and path, at least 4 per client
    rounds: int = 3  # the first fresh, the others warm
    starts: int = 1  # both servers started anew this many times per level
    prompt_tokens: int = 128
    max_tokens: int = 64
    max_model_len: int = 1024
    kv_cache_gib: int = 1
    seed: int = 0
    cooldown_s: float = 3.0
    out: Path = DEFAULT_OUT
    model_dir: Path | None = None


@dataclass
class RequestResult:
    ttft_s: float | None
    itl_s: list[float]
    completion_tokens: int


@dataclass
class PathRun:
    wall_s: float = 0.0
    completion_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    # CPU the other (idle) server used meanwhile: interference, not this path's cost.
    other_cpu_s: dict[str, float] = field(default_factory=dict)
    errors: int = 0


# --- the client ------------------------------------------------------------------------


async def stream_completion(session: aiohttp.ClientSession, base_url: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    token_times: list[float] = []
    completion_tokens = 0
    async with session.post(f"{base_url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                token_times.append(time.perf_counter())
    # A greedy answer may be only tokens that decode to nothing (or EOS at once): no TTFT then.
    ttft = token_times[0] - started if token_times else None
    return RequestResult(ttft, [b - a for a, b in itertools.pairwise(token_times)], completion_tokens)


async def closed_loop(base_url: str, prompts: list[list[int]], options: Options) -> PathRun:
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    run = PathRun()
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=options.concurrency)) as session:

        async def client() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                try:
                    result = await stream_completion(session, base_url, prompt, options.max_tokens)
                except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError):
                    run.errors += 1
                    continue
                if result.ttft_s is not None:
                    run.ttft_s.append(result.ttft_s)
                run.itl_s.extend(result.itl_s)
                run.completion_tokens += result.completion_tokens

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(options.concurrency)))
        run.wall_s = time.perf_counter() - started
    return run


# --- CPU accounting ----------------------------------------------------------------------


def tree_cpu_seconds(name: str, pid: int) -> dict[str, float]:
    """User + system CPU of a process and of each descendant, by process title.

    vLLM names its engine-core and model-worker processes ("VLLM::EngineCore",
    "VLLM::Worker"), so the front end's share (kvlane's worker or vLLM's API
    server) shows apart from the engine's.
    """
    seconds: dict[str, float] = {}
    for proc in process_tree(pid):
        try:
            times = proc.cpu_times()
            label = name if proc.pid == pid else f"{name}/{proc.name()}"
            seconds[label] = seconds.get(label, 0.0) + times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return seconds


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and its descendants; empty once it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def cpu_sample(processes: list[Process]) -> dict[str, float]:
    sample: dict[str, float] = {}
    for process in processes:
        sample |= tree_cpu_seconds(process.name, process.pid)
    times = os.times()
    sample["loadtest-client"] = times.user + times.system
    return sample


def signal_tree(tree: list[psutil.Process], stop: bool) -> None:
    for proc in tree:
        try:
            proc.suspend() if stop else proc.resume()
        except psutil.NoSuchProcess:
            continue


async def measured(base_url: str, prompts: list[list[int]], options: Options, processes: list[Process],
                   others: list[Process]) -> PathRun:
    # The other server is stopped meanwhile: an idle vLLM engine still polls (a core's worth of
    # CPU here), which would slow whichever path is measured by chance, not by its own cost.
    paused = [proc for process in others for proc in process_tree(process.pid)]
    signal_tree(paused, stop=True)
    try:
        # Let the previous phase's engine settle (and this path's heartbeats refresh after its own pause).
        await asyncio.sleep(options.cooldown_s)
        before, others_before = cpu_sample(processes), cpu_sample(others)
        run = await closed_loop(base_url, prompts, options)
        after, others_after = cpu_sample(processes), cpu_sample(others)
    finally:
        signal_tree(paused, stop=False)
    run.cpu_s = {name: round(after.get(name, 0.0) - before[name], 3) for name in before}
    run.other_cpu_s = {name: round(others_after.get(name, 0.0) - others_before[name], 3) for name in others_before
                       if name != "loadtest-client"}
    return run


# --- the two servers ---------------------------------------------------------------------


def kvlane_config(model_dir: Path, options: Options) -> KvlaneConfig:
    vllm = {"model": str(model_dir), "dtype": "float32", "max_model_len": options.max_model_len, "block_size": 32,
            "kv_cache_gib": float(options.kv_cache_gib), "extra_engine_args": {"enforce_eager": True}}
    return with_overrides(
        KvlaneConfig(),
        nats={"url": f"nats://{HOST}:{free_port()}"},
        redis={"url": f"redis://{HOST}:{free_port()}/0"},
        ingress={"host": HOST, "port": free_port()},
        logging={"level": "warning"},
        worker={"engine": "vllm", "model": MODEL},
        **{"worker.vllm": vllm},
    )


def start_direct_vllm(launcher: Launcher, model_dir: Path, options: Options, port: int) -> Process:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", HOST, "--port", str(port),
            "--model", str(model_dir), "--served-model-name", MODEL, "--dtype", "float32",
            "--max-model-len", str(options.max_model_len), "--block-size", "32", "--enforce-eager",
            "--enable-prefix-caching", "--kv-cache-memory-bytes", str(options.kv_cache_gib << 30)]
    return launcher.spawn("vllm-direct", argv, ENGINE_ENV)


async def wait_http_ok(url: str, process: Process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if not process.alive():
                raise RuntimeError(f"{process.name} exited {process.popen.returncode}:\n{process.log_tail()}")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} not healthy within {timeout_s:.0f}s")


# --- the run -----------------------------------------------------------------------------


def make_prompts(options: Options, round_index: int) -> list[list[int]]:
    rng = random.Random(options.seed * 1000 + round_index)
    # Ids 10..999: ordinary tokens of the tiny model (its special tokens are 0..6).
    return [[rng.randrange(10, 1000) for _ in range(options.prompt_tokens)] for _ in range(options.requests)]


def front_end_cpu(cpu_s: dict[str, float]) -> float:
    """CPU seconds of everything but the engine cores (named VLLM::EngineCore) and the load generator."""
    return sum(seconds for name, seconds in cpu_s.items() if "::" not in name and name != "loadtest-client")


def merge(runs: list[PathRun]) -> PathRun:
    total = PathRun()
    for run in runs:
        total.wall_s += run.wall_s
        total.completion_tokens += run.completion_tokens
        total.ttft_s += run.ttft_s
        total.itl_s += run.itl_s
        total.errors += run.errors
        for name, seconds in run.cpu_s.items():
            total.cpu_s[name] = round(total.cpu_s.get(name, 0.0) + seconds, 3)
        for name, seconds in run.other_cpu_s.items():
            total.other_cpu_s[name] = round(total.other_cpu_s.get(name, 0.0) + seconds, 3)
    return total


def cpu_ms_per_token(cpu_s: dict[str, float], completion_tokens: int) -> dict[str, float | None]:
    """CPU milliseconds per output token, per process and for the front end as a whole.

    A cost per token, unlike tokens/s, barely moves when other jobs take the
    machine's cores for a while: the figure to compare the two paths by.
    """
    if not completion_tokens:
        return {name: None for name in [*cpu_s, "front_end"]}
    per_token = {name: 1000.0 * seconds / completion_tokens for name, seconds in cpu_s.items()}
    per_token["front_end"] = 1000.0 * front_end_cpu(cpu_s) / completion_tokens
    return per_token


def report(kvlane: PathRun, direct: PathRun) -> dict[str, Any]:
    def path(run: PathRun) -> dict[str, Any]:
        return {"throughput_tok_s": run.completion_tokens / run.wall_s if run.wall_s else None,
                "completion_tokens": run.completion_tokens, "wall_s": run.wall_s, "errors": run.errors,
                "ttft": latency_summary(run.ttft_s), "itl": latency_summary(run.itl_s), "cpu_s": run.cpu_s,
                "cpu_ms_per_token": cpu_ms_per_token(run.cpu_s, run.completion_tokens),
                "other_server_cpu_s": run.other_cpu_s}

    a, b = path(kvlane), path(direct)
    return {
        "kvlane": a,
        "direct": b,
        "throughput_ratio": a["throughput_tok_s"] / b["throughput_tok_s"] if b["throughput_tok_s"] else None,
        "ttft_diff_ms": {q: a["ttft"][q] - b["ttft"][q] for q in ("p50_ms", "p99_ms")},
        "itl_diff_ms": {q: a["itl"][q] - b["itl"][q] for q in ("p50_ms", "p99_ms")},
        "front_end_cpu_ratio": _ratio(a["cpu_ms_per_token"]["front_end"], b["cpu_ms_per_token"]["front_end"]),
    }


def summarise(starts: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase, the medians over starts (fresh) or over warm rounds of the paired figures.

    A median of paired ratios, not a ratio of totals: one slow spell of the
    shared machine moves one pair, not the summary. A figure no pair has
    (no tokens came back) is None.
    """
    summary: dict[str, Any] = {}
    for phase in ("fresh", "warm"):
        reports = [start[phase] for start in starts if phase in start]
        if not reports:
            continue
        ratios = [ratio for r in reports for ratio in r.get("round_ratios", [r["throughput_ratio"]]) if ratio is not None]
        summary[phase] = {
            "throughput_ratio": _median(ratios),
            "throughput_ratios": ratios,
            "ttft_diff_ms": {q: _median(r["ttft_diff_ms"][q] for r in reports) for q in ("p50_ms", "p99_ms")},
            "itl_diff_ms": {q: _median(r["itl_diff_ms"][q] for r in reports) for q in ("p50_ms", "p99_ms")},
            "front_end_cpu_ratio": _median(r["front_end_cpu_ratio"] for r in reports),
            "front_end_cpu_ms_per_token": {
                path: _median(r[path]["cpu_ms_per_token"]["front_end"] for r in reports) for path in ("kvlane", "direct")},
            "engine_cpu_ms_per_token": {
                path: _median(engine_cpu_ms_per_token(r[path]) for r in reports) for path in ("kvlane", "direct")},
        }
    return summary


def engine_cpu_ms_per_token(path: dict[str, Any]) -> float | None:
    """The engine processes' CPU (named VLLM::...) per output token."""
    if not path["completion_tokens"]:
        return None
    return sum(ms for name, ms in path["cpu_ms_per_token"].items() if "::" in name)


def _median(values: Iterable[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


async def run_level(options: Options, model_dir: Path, start: int = 0) -> dict[str, Any]:
    """Both servers started anew, one fresh round, then warm rounds, at `options.concurrency` streams."""
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="kvlane-vllm-bench-")), base_env={**os.environ, **ENGINE_ENV})
    direct_port = free_port()
    try:
        config = kvlane_config(model_dir, options)
        # Both engines start at once (they are measured one at a time).
        direct = start_direct_vllm(launcher, model_dir, options, direct_port)
        fleet = start_fleet(launcher, config, workers=1, ready_timeout=600)
        direct_url = f"http://{HOST}:{direct_port}"
        await wait_http_ok(f"{direct_url}/health", direct, 600)
        kvlane_processes = [*fleet.services(), *fleet.servers]
        runs: dict[str, list[PathRun]] = {"kvlane": [], "direct": []}
        phases: dict[str, dict[str, Any]] = {}
        for index in range(options.rounds):
            prompts = make_prompts(options, index)
            order = [("kvlane", fleet.base_url), ("direct", direct_url)]
            # Which path goes first alternates by round and by level, so that each is first to
            # meet a fresh engine as often as the other.
            first = index + start + options.levels.index(options.concurrency)
            for name, url in order if first % 2 == 0 else reversed(order):
                processes, others = (kvlane_processes, [direct]) if name == "kvlane" else ([direct], kvlane_processes)
                result = await measured(url, prompts, options, processes, others)
                runs[name].append(result)
                per_token = cpu_ms_per_token(result.cpu_s, result.completion_tokens)
                print(f"c={options.concurrency} start {start} round {index} {name}: {result.completion_tokens / result.wall_s:.0f} tok/s, "
                      f"{result.errors} errors, CPU ms/token {_rounded(per_token)}, other server {result.other_cpu_s}",
                      flush=True)
            if index == 0:
                phases["fresh"] = report(runs["kvlane"][0], runs["direct"][0])
        if options.rounds > 1:
            phases["warm"] = report(merge(runs["kvlane"][1:]), merge(runs["direct"][1:]))
            # Each round measures both paths back to back: the median of the rounds' own ratios
            # is less swayed by a slow spell of the machine than the ratio of the totals.
            ratios = [k.completion_tokens / k.wall_s / (d.completion_tokens / d.wall_s)
                      for k, d in zip(runs["kvlane"][1:], runs["direct"][1:], strict=True)]
            phases["warm"]["round_ratios"] = ratios
        return phases
    finally:
        launcher.stop_all()


async def run(options: Options) -> dict[str, Any]:
    from launch.tiny_model import default_cache_dir, ensure_tiny_model

    model_dir = ensure_tiny_model(options.model_dir or default_cache_dir())
    levels = {}
    for concurrency in options.levels:
        level = replace(options, concurrency=concurrency, requests=max(options.requests, 4 * concurrency))
        starts = [await run_level(level, model_dir, start) for start in range(options.starts)]
        levels[str(concurrency)] = summarise(starts) | {"starts": starts}
    results: dict[str, Any] = {"concurrency": levels}
    results["options"] = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items() if k != "concurrency"}
    results["machine"] = machine_info() | {"vllm": metadata.version("vllm-cpu") if _has("vllm-cpu") else metadata.version("vllm")}
    results["finished_at"] = dt.datetime.now(dt.UTC).isoformat()
    return results


def print_summary(results: dict[str, Any]) -> None:
    print(f"{'streams':>7} {'phase':<6} {'tok/s ratio':>11} {'min':>6} {'max':>6} {'TTFT p50 +ms':>12}"
          f" {'ITL p50 +ms':>11} {'front-end CPU ms/tok kvlane':>27} {'direct':>7} {'engine CPU ms/tok kvlane':>24} {'direct':>7}")
    for concurrency, level in results["concurrency"].items():
        for phase in ("fresh", "warm"):
            if phase not in level:
                continue
            r = level[phase]
            ratios, front, engine = r["throughput_ratios"], r["front_end_cpu_ms_per_token"], r["engine_cpu_ms_per_token"]
            cells = [r["throughput_ratio"], min(ratios, default=None), max(ratios, default=None), r["ttft_diff_ms"]["p50_ms"],
                     r["itl_diff_ms"]["p50_ms"], front["kvlane"], front["direct"], engine["kvlane"], engine["direct"]]
            widths = [11, 6, 6, 12, 11, 27, 7, 24, 7]
            print(f"{concurrency:>7} {phase:<6} " + " ".join(
                f"{'-' if value is None else f'{value:.3f}':>{width}}" for value, width in zip(cells, widths, strict=True)))


def _rounded(figures: dict[str, float | None]) -> dict[str, float | None]:
    return {name: None if value is None else round(value, 3) for name, value in figures.items()}


def _has(distribution: str) -> bool:
    try:
        metadata.version(distribution)
        return True
    except metadata.PackageNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.dataplane.vllm_vs_direct", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default=",".join(map(str, Options.levels)),
                        help="concurrent streams, comma-separated levels (default %(default)s)")
    for name in ("requests", "rounds", "starts", "prompt_tokens", "max_tokens", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(Options, name))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--model-dir", type=Path, help="the tiny model's directory (default: kvlane's cache)")
    args = parser.parse_args(argv)
    levels = tuple(int(level) for level in args.concurrency.split(","))
    options = Options(levels=levels, **{k: v for k, v in vars(args).items() if k != "concurrency"})
    results = asyncio.run(run(options))
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(results, indent=2))
    print_summary(results)
    print(f"written to {options.out}")
    return 0


if __name__ == "__main__":  # vLLM engines start subprocesses
    sys.exit(main())
