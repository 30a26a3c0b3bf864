"""What a service says while its shutdown drags on."""

from __future__ import annotations

import asyncio

import structlog
from structlog.testing import LogCapture

from shared.runner import await_chain, report_slow_shutdown


async def stuck_inner(gate: asyncio.Event) -> None:
    await gate.wait()


async def stuck_outer(gate: asyncio.Event) -> None:
    await stuck_inner(gate)


async def test_await_chain_names_every_level_of_a_suspended_task() -> None:
    gate = asyncio.Event()
    task = asyncio.create_task(stuck_outer(gate))
    await asyncio.sleep(0)
    chain = await_chain(task.get_coro())
    assert chain.startswith("stuck_outer (unit/test_runner.py:")
    assert "<- stuck_inner (unit/test_runner.py:" in chain and "<- wait (" in chain
    gate.set()
    await task
    assert await_chain(task.get_coro()) == "?"  # finished: suspended nowhere


def capturing_logger() -> tuple[structlog.typing.FilteringBoundLogger, LogCapture]:
    """A logger of its own: the process-wide configuration may filter warnings out (a benchmark run in-process sets "error")."""
    capture = LogCapture()
    return structlog.wrap_logger(structlog.PrintLogger(), processors=[capture], wrapper_class=structlog.BoundLogger), capture


async def test_slow_shutdown_is_reported_with_what_it_waits_on_and_never_before_stop() -> None:
    stop, gate = asyncio.Event(), asyncio.Event()
    stuck = asyncio.create_task(stuck_outer(gate), name="stuck-drain")
    logger, capture = capturing_logger()
    reporter = asyncio.create_task(report_slow_shutdown(stop, logger, every_s=0.05))
    await asyncio.sleep(0.2)
    assert capture.entries == []  # still serving: nothing to report
    stop.set()

    async def two_reports() -> None:
        while len(capture.entries) < 2:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(two_reports(), 5.0)
    reporter.cancel()
    assert {entry["event"] for entry in capture.entries} == {"shutdown_slow"}
    assert any(line.startswith("stuck-drain: stuck_outer") and "stuck_inner" in line for line in capture.entries[0]["waiting_on"])
    gate.set()
    await stuck
