"""A worker that leaves with requests still running hands them back, and ingress resumes them elsewhere.

Two ways to leave: a drain whose timeout expires, and an engine that dies
(the sim engine's `fail_after_tokens`). Either way each client's stream goes
on through the other worker with the tokens already sent: the sim engine's
tokens are a function of (seed, prompt, position), so the text a client
receives is checked token for token against an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from contracts import subjects
from contracts.messages import RequestFinished, WorkerLeft
from launch.fleet import Fleet, with_overrides
from launch.launcher import wait_services_ready
from tests.integration.conftest import MODEL, client_of, launch, until_status
from tests.integration.test_faults import expected_text

pytestmark = pytest.mark.integration

STREAMS = 6
MAX_TOKENS = 300


class BusLog:
    """The `RequestFinished` and `WorkerLeft` events of one fleet, as they arrive."""

    def __init__(self) -> None:
        self.finished: list[RequestFinished] = []
        self.left: list[WorkerLeft] = []
        self._left_by: dict[str, asyncio.Event] = {}

    def handed_back_by(self, worker_id: str) -> int:
        return sum(1 for e in self.finished if e.worker_id == worker_id and e.finish_reason == "abort"
                   and not e.request_id.startswith(("probe-", "prewarm-")))

    def _left_event(self, worker_id: str) -> asyncio.Event:
        return self._left_by.setdefault(worker_id, asyncio.Event())

    async def until_left(self, worker_id: str, timeout_s: float) -> WorkerLeft:
        await asyncio.wait_for(self._left_event(worker_id).wait(), timeout_s)
        return next(e for e in self.left if e.worker_id == worker_id)

    async def watch(self, fleet: Fleet) -> nats.NATS:
        nc = await nats.connect(fleet.config.nats.url)
        finished, left = msgspec.msgpack.Decoder(RequestFinished), msgspec.msgpack.Decoder(WorkerLeft)

        async def on_finished(msg) -> None:
            self.finished.append(finished.decode(msg.data))

        async def on_left(msg) -> None:
            event = left.decode(msg.data)
            self.left.append(event)
            self._left_event(event.worker_id).set()

        await nc.subscribe(subjects.REQUEST_FINISHED, cb=on_finished)
        await nc.subscribe(subjects.WORKER_LEFT, cb=on_left)
        await nc.flush()
        return nc


async def checked_stream(client: openai.AsyncOpenAI, index: int, started: asyncio.Event) -> str:
    """One stream's outcome: "ok", or what was wrong with it (an error, a gap or a duplicate)."""
    prompt, seed = f"a long answer that outlives its worker, number {index}", 500 + index
    pieces: list[str] = []
    finish = ""
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, seed=seed, stream=True)
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                started.set()
                finish = chunk.choices[0].finish_reason or finish
    except openai.APIError as exc:
        return f"stream {index} failed: {type(exc).__name__}: {exc}"
    if "".join(pieces) != expected_text(prompt, seed, MAX_TOKENS):
        return f"stream {index} has a gap or a duplicate"
    return "ok" if finish == "length" else f"stream {index} finished with {finish!r}"


async def start_streams(fleet: Fleet) -> list[asyncio.Task[str]]:
    """`STREAMS` long streams, once every one of them has its first token."""
    client = client_of(fleet)
    started = [asyncio.Event() for _ in range(STREAMS)]
    streams = [asyncio.create_task(checked_stream(client, i, started[i])) for i in range(STREAMS)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    assert not any(s.done() for s in streams), "streams too short to outlive their worker"
    return streams


@pytest.fixture
def slow_fleet(tmp_path: Path):
    # A drain timeout far shorter than the streams; heartbeats that never expire within the test, so a
    # worker that leaves the balancer's view has said so rather than gone quiet.
    def tune(config):
        return with_overrides(config, worker={"drain_timeout_s": 0.5}, cluster={"heartbeat_ttl_s": 60.0})

    fleet = launch(tmp_path, workers=2, tune=tune, speed=0.25)
    yield fleet
    fleet.stop()


async def test_a_drain_timeout_hands_running_requests_back_to_be_resumed_elsewhere(slow_fleet: Fleet) -> None:
    bus = BusLog()
    nc = await bus.watch(slow_fleet)
    try:
        streams = await start_streams(slow_fleet)
        draining = next(p for p in slow_fleet.workers if p.name == "worker-w0")
        slow_fleet.drain_worker(draining)
        outcomes = await asyncio.wait_for(asyncio.gather(*streams), 60)
        assert outcomes == ["ok"] * STREAMS, [o for o in outcomes if o != "ok"]
        assert await asyncio.to_thread(draining.wait_exit, 20) == 0, draining.log_tail()
        # The drain did cut streams short: each such stream was resumed, not restarted or failed.
        assert bus.handed_back_by("w0") >= 1, "no stream was running on w0 at its drain timeout"
        assert [e.reason for e in bus.left] == ["drained"]
    finally:
        await nc.close()


async def test_a_dead_engine_takes_its_worker_out_of_the_cluster_at_once(slow_fleet: Fleet) -> None:
    # A third worker whose engine dies part-way through the streams (a third of them run there).
    doomed_id = "w9"
    env = slow_fleet.service_env("worker", doomed_id) | {
        "KVLANE__WORKER__WORKER_ID": f'"{doomed_id}"', "KVLANE__WORKER__SIM__FAIL_AFTER_TOKENS": str(MAX_TOKENS // 2),
    }
    doomed = slow_fleet.launcher.start_service("worker", env, name=f"worker-{doomed_id}")
    await asyncio.to_thread(wait_services_ready, [doomed])
    await until_status(slow_fleet, lambda s: doomed_id in {c.worker_id for c in s.chains})
    bus = BusLog()
    nc = await bus.watch(slow_fleet)
    try:
        streams = await start_streams(slow_fleet)
        left = await bus.until_left(doomed_id, 30)
        left_at = time.monotonic()
        assert left.reason == "engine_dead"
        # Out of the balancer's view now, though its last heartbeat is good for another minute.
        await until_status(slow_fleet, lambda s: doomed_id not in {c.worker_id for c in s.chains}, timeout_s=5)
        assert time.monotonic() - left_at < 5
        outcomes = await asyncio.wait_for(asyncio.gather(*streams), 60)
        assert outcomes == ["ok"] * STREAMS, [o for o in outcomes if o != "ok"]
        assert bus.handed_back_by(doomed_id) >= 1, "no stream was running on the worker whose engine died"
        # It exits with a failure, for a supervisor to restart it.
        assert await asyncio.to_thread(doomed.wait_exit, 20) == 1, doomed.log_tail()
    finally:
        await nc.close()
