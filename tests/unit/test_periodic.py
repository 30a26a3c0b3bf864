"""Periodic housekeeping: its pace, its failures, and that it always stops."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from shared.periodic import Periodic
from tests.waiting import until


async def test_steps_repeat_at_the_interval_and_stop_at_once() -> None:
    calls: list[float] = []
    loop = asyncio.get_running_loop()

    async def step() -> None:
        calls.append(loop.time())

    periodic = Periodic("count", 0.02, step)
    started = loop.time()
    periodic.start()
    await until(lambda: len(calls) >= 3, 5.0, every_s=0.005)
    stopping = loop.time()
    await periodic.stop()
    assert loop.time() - stopping < 0.05
    assert calls[0] - started >= 0.02  # the first step waits one interval
    count = len(calls)
    await asyncio.sleep(0.05)
    assert len(calls) == count  # nothing after stop


async def test_immediately_runs_the_first_step_without_waiting() -> None:
    ran = asyncio.Event()

    async def step() -> None:
        ran.set()

    periodic = Periodic("eager", 60.0, step, immediately=True)
    periodic.start()
    await asyncio.wait_for(ran.wait(), 1.0)
    await periodic.stop()


async def test_a_failing_step_is_logged_and_the_next_one_still_runs() -> None:
    calls = 0

    async def step() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("bad step")

    with capture_logs() as logs:
        periodic = Periodic("flaky", 0.01, step)
        periodic.start()
        await until(lambda: calls >= 3, 5.0, every_s=0.005)
        await periodic.stop()
    assert [entry["event"] for entry in logs] == ["periodic_step_failed"]
    assert logs[0]["task"] == "flaky"


async def test_stop_ends_a_loop_whose_step_swallows_the_cancellation() -> None:
    """The way redis-py can lose a CancelledError: the step returns as if nothing happened."""
    in_step = asyncio.Event()

    async def swallowing_step() -> None:
        in_step.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()

    periodic = Periodic("swallower", 0.001, swallowing_step)
    periodic.start()
    await in_step.wait()
    await asyncio.wait_for(periodic.stop(), 1.0)
