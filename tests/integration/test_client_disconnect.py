"""A request nobody waits for any more is aborted on its worker, whatever it was doing: its
client hung up, or ingress gave up handing it over and routed it elsewhere.

The sim fleet here; `tests/vllm/test_vllm_engine.py` does the same against vLLM.
`python -m loadtest.dataplane.hangup` runs the streaming scenario many times in a row.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import pytest

from launch.fleet import Fleet
from loadtest.dataplane import hangup
from loadtest.dataplane.hangup import FinishedWatch, Options, request_body, soak
from tests.integration.conftest import MODEL, launch, stop_and_check

pytestmark = pytest.mark.integration

# Far more than a sim worker generates while a client reads a few chunks (seconds per hundred tokens).
LONG = 2000


def test_streams_hung_up_under_load_are_all_aborted(shared_fleet: Fleet) -> None:
    runs = 20
    options = Options(runs=runs, max_tokens=LONG, after_chunks=5, background=1, busy_core=True)
    report = asyncio.run(soak(shared_fleet, options, log=False))
    assert (report.aborted, report.leaked) == (runs, 0), report
    assert report.background_completed >= 1, "the streams beside the hang-ups must complete"


def test_the_hang_up_command_starts_its_fleet_and_writes_its_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "hangup.json"
    code = hangup.main(["--workers", "1", "--runs", "3", "--max-tokens", str(LONG), "--background", "0", "--no-busy-core",
                        "--log-dir", str(tmp_path / "logs"), "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and (report["aborted"], report["leaked"]) == (3, 0), report
    assert len(report["hang_ups"]) >= 3 and report["options"]["engine"] == "sim"
    assert "3 of 3 hang-ups aborted, 0 leaked" in capsys.readouterr().out


def test_a_client_that_gives_up_waiting_for_a_whole_reply_aborts_it(shared_fleet: Fleet) -> None:
    """Nothing is written to a non-streaming client before the end: only the hang-up itself can tell."""

    async def scenario() -> list:
        async with FinishedWatch.open(shared_fleet.config.nats.url) as watch, aiohttp.ClientSession() as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(f"{shared_fleet.base_url}/v1/completions", json=request_body(MODEL, LONG, stream=False),
                                   timeout=aiohttp.ClientTimeout(total=1.0))
            await watch.wait_until(watch.of_clients, timeout_s=10)
            return watch.of_clients()

    finished = asyncio.run(scenario())
    assert [f.finish_reason for f in finished] == ["abort"]
    assert finished[0].usage.completion_tokens < LONG


def test_a_hand_over_that_timed_out_is_aborted_on_the_slow_worker(tmp_path: Path) -> None:
    """Ingress gives up on a worker slow to accept and routes the request elsewhere; when that
    worker wakes it finds the request and then its abort, so it never runs it for nobody."""
    fleet = launch(tmp_path, workers=1)
    try:
        [worker] = fleet.workers

        async def scenario() -> tuple[int, list]:
            async with FinishedWatch.open(fleet.config.nats.url) as watch, aiohttp.ClientSession() as session:
                worker.signal(signal.SIGSTOP)  # its heartbeat stays fresh for up to the 1 s TTL
                try:
                    response = await session.post(f"{fleet.base_url}/v1/completions",
                                                  json=request_body(MODEL, LONG, stream=False))
                    status = response.status  # no other live worker to try
                finally:
                    worker.signal(signal.SIGCONT)
                await watch.wait_until(watch.of_clients, timeout_s=15)
                return status, watch.of_clients()

        status, finished = asyncio.run(scenario())
        assert status in (404, 503)  # by then the stopped worker's heartbeat had expired, or not yet
        assert [(f.worker_id, f.finish_reason) for f in finished] == [("w0", "abort")]
    finally:
        stop_and_check(fleet)
