"""What the bus costs one hand-over: a request, its reply and two streamed frames, in one process.

The pattern of the ingress handing a request to a worker: a `GenerateRequest`
to a subscribed handler, which answers `GenerateAccepted` and puts a
`TokenChunk` and a `StreamEnd` in its `StreamOutbox`; the requester reads
both frames from its `StreamReceiver`. Both ends are `Bus` connections in
this one process, against a nats-server of its own, so the figures are the
bus's and nats-py's work per hand-over, not the machine's other processes:
the latency of sequential hand-overs and this process's CPU time per
hand-over (both ends together), over `--iterations` of them.

Run it from two trees alternately to compare them (it uses only the bus's
public API):

    python -m loadtest.dataplane.bus_hops [--iterations N] [--warmup N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import uvloop
from nats.aio.msg import Msg

from contracts.messages import GenerateAccepted, GenerateRequest, SamplingParams, StreamEnd, Timings, TokenChunk, Usage, WorkerReply
from launch.launcher import Launcher, free_port
from loadtest.bench.metrics import percentile
from shared.bus import Bus, StreamReceiver, is_final
from shared.config import NatsSettings, TracingSettings
from shared.stream_outbox import StreamOutbox
from shared.telemetry import Telemetry

INBOX = "bench.worker.inbox"


async def measure(port: int, iterations: int, warmup: int) -> dict[str, float]:
    telemetry = Telemetry(TracingSettings(), "bus-hops")
    settings = NatsSettings(url=f"nats://127.0.0.1:{port}")
    worker = await Bus.connect(settings, "bench-worker", telemetry)
    ingress = await Bus.connect(settings, "bench-ingress", telemetry)
    outbox = StreamOutbox(worker)

    async def accept(request: GenerateRequest, msg: Msg) -> GenerateAccepted:
        outbox.put(request.stream_to, TokenChunk(request.request_id, 0, [7], "x"))
        outbox.put(request.stream_to, StreamEnd(request.request_id, 1, "length", Usage(4, 1), Timings(), "w0"))
        return GenerateAccepted(request.request_id, "w0")

    await worker.subscribe(INBOX, GenerateRequest, accept)
    streams = StreamReceiver(ingress, "bench-ingress")
    await streams.start()
    sampling = SamplingParams(max_tokens=1)

    async def hand_over(number: int) -> None:
        request_id = f"r{number}"
        with streams.open(request_id) as stream:
            request = GenerateRequest(request_id=request_id, model="m", prompt_token_ids=[1, 2, 3, 4], sampling=sampling,
                                      stream_to=stream.subject, timeout_s=10.0)
            reply = await ingress.request(INBOX, request, WorkerReply, 5.0)
            assert isinstance(reply, GenerateAccepted), reply
            while not is_final(await stream.next(5.0)):
                pass

    try:
        for number in range(warmup):
            await hand_over(number)
        latencies: list[float] = []
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        for number in range(warmup, warmup + iterations):
            started = time.perf_counter()
            await hand_over(number)
            latencies.append(time.perf_counter() - started)
        cpu_s, wall_s = time.process_time() - cpu_started, time.perf_counter() - wall_started
    finally:
        await outbox.close()
        await ingress.close()
        await worker.close()
    latencies.sort()
    return {
        "iterations": iterations,
        "p50_us": percentile(latencies, 50) * 1e6,
        "p99_us": percentile(latencies, 99) * 1e6,
        "cpu_us_per_hand_over": cpu_s / iterations * 1e6,
        "wall_us_per_hand_over": wall_s / iterations * 1e6,
    }


def run(iterations: int, warmup: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="kvlane-bus-hops-") as log_dir:
        launcher = Launcher(Path(log_dir))
        port = free_port()
        try:
            launcher.start_nats(port)
            return uvloop.run(measure(port, iterations, warmup))
        finally:
            launcher.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.iterations, args.warmup)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
