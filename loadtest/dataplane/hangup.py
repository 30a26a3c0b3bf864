"""Clients that hang up mid-stream, under load: each such request must be aborted on its worker.

A client reads a few chunks of a long stream, then closes the connection.
The request counts as aborted when its worker announces it finished with
`finish_reason="abort"` and fewer tokens than it asked for: the engine
stopped generating for a client that left. Anything else (it ran to
`max_tokens`, or no `RequestFinished` came at all) is a leak.

Load while it runs: other streams that run to their end (`--background`),
and a process that keeps one core busy (`--busy-core`).

    python -m loadtest.dataplane.hangup --engine sim --runs 50
    python -m loadtest.dataplane.hangup --engine vllm --runs 50

Prints one line per hang-up and a summary; writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import nats

from contracts import subjects
from contracts.messages import RequestFinished
from launch.fleet import Fleet, start_fleet, with_overrides
from launch.launcher import Launcher, free_port
from loadtest.bench.machine import machine_info
from shared.config import KvlaneConfig

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "hangup.json"
HOST = "127.0.0.1"


class FinishedWatch:
    """Every `RequestFinished` on the bus, from the moment `open` returns."""

    def __init__(self, nc: nats.NATS) -> None:
        self._nc = nc
        self._decoder = msgspec.msgpack.Decoder(RequestFinished)
        self.events: list[RequestFinished] = []
        self._arrived = asyncio.Condition()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, nats_url: str) -> AsyncIterator[FinishedWatch]:
        nc = await nats.connect(nats_url)
        watch = cls(nc)
        try:
            await nc.subscribe(subjects.REQUEST_FINISHED, cb=watch._on_message)
            # Twice: nats-py can write a flush's PING ahead of the SUB still queued.
            await nc.flush()
            await nc.flush()
            yield watch
        finally:
            await nc.close()

    def keeps(self, finished: RequestFinished) -> bool:
        """Whether `events` takes this event (all of them here)."""
        return True

    async def _on_message(self, msg) -> None:
        finished = self._decoder.decode(msg.data)
        if not self.keeps(finished):
            return
        async with self._arrived:
            self.events.append(finished)
            self._arrived.notify_all()

    def of(self, request_id: str) -> list[RequestFinished]:
        return [event for event in self.events if event.request_id == request_id]

    def of_clients(self) -> list[RequestFinished]:
        """Events of client requests: not health probes, not pre-warm prefills."""
        return [event for event in self.events if not event.request_id.startswith(("probe-", "prewarm-"))]

    async def wait_until(self, condition: Callable[[], object], timeout_s: float) -> bool:
        """Whether `condition()` held within `timeout_s` (checked as each event arrives)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s), self._arrived:
                await self._arrived.wait_for(condition)
        return bool(condition())


class Refused(Exception):
    """The request was answered with an error status instead of a stream (an overloaded fleet may)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status


@dataclass
class HangUp:
    request_id: str
    chunks_read: int
    seconds_to_hang_up: float
    hung_up_at: float  # wall clock, to compare with the services' logs
    finish_reasons: list[str]  # "worker:reason", one per attempt
    completion_tokens: int | None  # of the aborted attempt
    ended_before_hang_up: bool
    seconds_to_finish: float | None
    # The worker's own time on the attempt reported (`RequestFinished.duration_s`).
    seconds_on_worker: float | None = None

    def verdict(self, max_tokens: int, stall_s: float = math.inf) -> str:
        """`aborted` (every attempt stopped early), `ended_first` (it ran to its end before the
        client left: nothing to abort), `stalled` (it ran on, but the fleet took longer than
        `stall_s` to deliver the client's first chunks: a machine too busy to tell anything)
        or `leaked` (an attempt ran on for nobody, or none reported)."""
        reasons = [entry.rpartition(":")[2] for entry in self.finish_reasons]
        ran_to_end = any(reason in ("length", "stop") for reason in reasons)
        if "abort" in reasons and not ran_to_end and (self.completion_tokens or 0) < max_tokens:
            return "aborted"
        # The worker took the request after the client sent it, so one it ran for no longer than the
        # client took to hang up may have ended before the hang-up, whenever its event came.
        ran_within = self.seconds_on_worker is not None and self.seconds_on_worker <= self.seconds_to_hang_up
        if (self.ended_before_hang_up or ran_within) and len(reasons) == 1 and ran_to_end:
            return "ended_first"
        if self.seconds_to_hang_up > stall_s:
            return "stalled"
        return "leaked"


async def hang_up(session: aiohttp.ClientSession, base_url: str, watch: FinishedWatch, body: dict,
                  after_chunks: int = 5, finish_timeout_s: float = 30.0) -> HangUp:
    """Stream `body` from `/v1/completions`, close the connection after `after_chunks` data lines,
    and wait for the workers' `RequestFinished` events: every attempt of the request (a resumed or
    re-routed request has several) must end."""
    sent_at = time.monotonic()
    response = await session.post(f"{base_url}/v1/completions", json=body)
    try:
        if response.status != 200:
            raise Refused(response.status, await response.text())
        request_id = response.headers["X-Request-Id"]
        chunks = 0
        async for line in response.content:
            chunks += line.startswith(b"data: ")
            if chunks == after_chunks:
                break
        ended_before = bool(watch.of(request_id))
    finally:
        response.close()
    hung_up_at, wall_hung_up_at = time.monotonic(), time.time()
    # Until the attempt that was streaming reports its abort; one that ran to its end before
    # the hang-up is all there is to wait for (not long).
    def aborted() -> bool:
        return any(f.finish_reason == "abort" for f in watch.of(request_id))

    await watch.wait_until(aborted, 3.0 if ended_before else finish_timeout_s)
    finished = watch.of(request_id)
    last = next((f for f in finished if f.finish_reason == "abort"), finished[0] if finished else None)
    return HangUp(
        request_id=request_id,
        chunks_read=chunks,
        seconds_to_hang_up=round(hung_up_at - sent_at, 3),
        hung_up_at=wall_hung_up_at,
        finish_reasons=[f"{f.worker_id}:{f.finish_reason}" for f in finished],
        completion_tokens=None if last is None else last.usage.completion_tokens,
        ended_before_hang_up=ended_before,
        seconds_to_finish=None if last is None else round(time.monotonic() - hung_up_at, 3),
        seconds_on_worker=None if last is None else round(last.duration_s, 3),
    )


async def streams_to_the_end(session: aiohttp.ClientSession, base_url: str, body: dict, stop: asyncio.Event) -> int:
    """Load beside the hang-ups: whole streams, one after another, until `stop`; how many completed."""
    completed = 0
    while not stop.is_set():
        async with session.post(f"{base_url}/v1/completions", json=body) as response:
            async for line in response.content:
                if line.startswith(b"data: [DONE]"):
                    completed += 1
    return completed


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """One process spinning on a core for as long as the block runs."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@dataclass
class Options:
    engine: str = "sim"
    runs: int = 50
    max_tokens: int = 1000
    after_chunks: int = 5
    background: int = 1
    busy_core: bool = True
    # A hang-up whose first chunks took longer than this is not counted (`HangUp.verdict`).
    # Two vLLM engines on two cores can starve the other processes for seconds; a fleet that
    # delivers a few chunks that late has let the engine run most of the request by then,
    # whatever the ingress does. Ordinary hang-ups here come within a fraction of a second.
    stall_s: float = math.inf


@dataclass
class Report:
    options: dict
    machine: dict
    hang_ups: list[dict] = field(default_factory=list)
    aborted: int = 0
    leaked: int = 0
    # Not hang-ups mid-request: the request had ended before the client read
    # `after_chunks` chunks, or was refused (an overloaded fleet may), or the fleet stalled.
    ended_first: int = 0
    refused: int = 0
    stalled: int = 0
    background_completed: int = 0


def request_body(model: str, max_tokens: int, stream: bool = True) -> dict:
    # ignore_eos: a model (the random tiny one included) must not end the story before the client hangs up.
    # Greedy: vLLM's first seeded request on the CPU spends seconds warming up its sampler.
    return {"model": model, "prompt": "Tell me a very long story", "max_tokens": max_tokens, "stream": stream,
            "temperature": 0.0, "ignore_eos": True}


async def soak(fleet: Fleet, options: Options, log: bool = True) -> Report:
    """`options.runs` hang-ups of running requests in a row against a running fleet, under the load the options ask for."""
    report = Report(options={k: str(v) for k, v in asdict(options).items()}, machine=machine_info())
    model = fleet.config.worker.model
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session, FinishedWatch.open(fleet.config.nats.url) as watch:
        # Long streams beside the hang-ups: decoding alongside, without the churn of many short requests.
        background_body = request_body(model, max(16, options.max_tokens // 4))
        background = [asyncio.create_task(streams_to_the_end(session, fleet.base_url, background_body, stop))
                      for _ in range(options.background)]
        try:
            with busy_core() if options.busy_core else contextlib.nullcontext():
                # `runs` hang-ups of running requests: one refused, ended before its client left
                # or stalled (an overloaded fleet may do each) does not count; 3 x `runs` tries at most.
                for run in range(1, 3 * options.runs + 1):
                    if report.aborted + report.leaked >= options.runs:
                        break
                    try:
                        result = await hang_up(session, fleet.base_url, watch, request_body(model, options.max_tokens),
                                               options.after_chunks)
                    except Refused as exc:
                        report.refused += 1
                        if log:
                            print(f"{run:3d} refused: {exc}", flush=True)
                        continue
                    report.hang_ups.append(asdict(result))
                    verdict = result.verdict(options.max_tokens, options.stall_s)
                    setattr(report, verdict, getattr(report, verdict) + 1)
                    if log:
                        print(f"{run:3d} {verdict:13s} {result.request_id} {result.finish_reasons} "
                              f"tokens={result.completion_tokens} "
                              f"hung up at {result.seconds_to_hang_up}s, finished {result.seconds_to_finish}s later",
                              flush=True)
        finally:
            stop.set()
            report.background_completed = sum(await asyncio.gather(*background))
    return report


def fleet_config(engine: str, model_dir: Path | None, log_level: str = "info") -> KvlaneConfig:
    config = with_overrides(
        KvlaneConfig(),
        nats={"url": f"nats://{HOST}:{free_port()}"},
        redis={"url": f"redis://{HOST}:{free_port()}/0"},
        ingress={"host": HOST, "port": free_port()},
        logging={"level": log_level},
        worker={"engine": engine},
    )
    if engine == "vllm":
        vllm = {"model": str(model_dir), "dtype": "float32", "max_model_len": 4096, "block_size": 32,
                "kv_cache_gib": 1.0, "extra_engine_args": {"enforce_eager": True}}
        config = with_overrides(config, worker={"model": "tiny-llama"}, **{"worker.vllm": vllm})
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.dataplane.hangup", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=Options.runs)
    parser.add_argument("--max-tokens", type=int, default=Options.max_tokens)
    parser.add_argument("--after-chunks", type=int, default=Options.after_chunks)
    parser.add_argument("--background", type=int, default=Options.background, help="streams running beside the hang-ups")
    parser.add_argument("--no-busy-core", action="store_true", help="do not keep a core busy")
    parser.add_argument("--log-level", default="info", help="the fleet's log level")
    parser.add_argument("--log-dir", type=Path, help="the fleet's logs (default: a new temporary directory)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    options = Options(engine=args.engine, runs=args.runs, max_tokens=args.max_tokens, after_chunks=args.after_chunks,
                      background=args.background, busy_core=not args.no_busy_core)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvlane-hangup-"))
    model_dir = None
    if options.engine == "vllm":
        from launch.tiny_model import default_cache_dir, ensure_tiny_model

        model_dir = ensure_tiny_model(default_cache_dir())
    launcher = Launcher(log_dir, base_env={**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
                                           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    print(f"starting {args.workers} {options.engine} workers; logs in {log_dir}", flush=True)
    fleet = start_fleet(launcher, fleet_config(options.engine, model_dir, args.log_level), args.workers, ready_timeout=600)
    try:
        report = asyncio.run(soak(fleet, options))
    finally:
        fleet.stop()
    summary = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **asdict(report)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"{options.engine}: {report.aborted} of {options.runs} hang-ups aborted, {report.leaked} leaked, "
          f"{report.ended_first} ended before the hang-up, {report.refused} refused, {report.stalled} stalled; "
          f"{report.background_completed} background streams completed; JSON in {args.out}")
    return 0 if report.leaked == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
