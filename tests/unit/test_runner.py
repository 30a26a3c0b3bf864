"""What a service says while its shutdown drags on."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import structlog
from structlog.testing import LogCapture

from shared.runner import READY_EVENT, await_chain, report_slow_shutdown

REPO_ROOT = Path(__file__).resolve().parents[2]


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


def test_announcing_ready_freezes_what_start_up_built_out_of_the_collector() -> None:
    # In a process of its own: freezing this test process's heap would outlast the test.
    probe = (
        "import gc, json\n"
        "from shared.runner import announce_ready\n"
        "built = [{'n': n} for n in range(5000)]\n"
        "before = gc.get_freeze_count()\n"
        "announce_ready(service='probe')\n"
        "print(json.dumps({'before': before, 'after': gc.get_freeze_count()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True)
    counts = json.loads(done.stdout)
    assert counts["before"] == 0
    assert counts["after"] >= 5000  # the start-up objects, and everything imported, are frozen
    assert json.loads(done.stderr.strip().splitlines()[-1]) == {"event": READY_EVENT, "service": "probe"}
