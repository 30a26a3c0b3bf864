"""A client that hangs up gets its request aborted on the worker, whatever the request was doing.

The sim fleet here; `tests/vllm/test_vllm_engine.py` does the same against vLLM.
`python -m loadtest.hangup` runs the streaming scenario many times in a row.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvlane.fleet import Fleet
from loadtest.hangup import FinishedWatch, Options, request_body, soak
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration

# Far more than a sim worker generates while a client reads a few chunks (seconds per hundred tokens).
LONG = 2000


def test_streams_hung_up_under_load_are_all_aborted(shared_fleet: Fleet) -> None:
    runs = 20
    options = Options(runs=runs, max_tokens=LONG, after_chunks=5, background=1, busy_core=True)
    report = asyncio.run(soak(shared_fleet, options, log=False))
    assert (report.refused, report.ended_first, report.leaked) == (0, 0, 0), report.hang_ups
    assert report.aborted == runs
    assert report.background_completed >= 1, "the streams beside the hang-ups must complete"


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
