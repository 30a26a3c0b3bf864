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


_SERVICE = (
    "import asyncio, sys\n"
    "from shared.runner import announce_ready, run_service\n"
    "async def main(config, stop):\n"
    "    if sys.argv[1] == 'serving':\n"
    "        announce_ready(service='probe')\n"
    "        await stop.wait()\n"
    "        print('drained', file=sys.stderr, flush=True)\n"
    "        return\n"
    "    print('starting', file=sys.stderr, flush=True)\n"
    "    try:\n"
    "        await asyncio.Event().wait()  # a start waiting on a server that went down with the fleet\n"
    "    finally:\n"
    "        print('start undone', file=sys.stderr, flush=True)\n"
    "run_service('probe', main, [])\n"
)


def _stop_when_it_says(phase: str, line: str) -> tuple[int, str]:
    """Run a service in `phase`, SIGTERM it once it wrote `line`; its exit status and output."""
    service = subprocess.Popen([sys.executable, "-c", _SERVICE, phase], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
    assert service.stderr is not None
    output = []
    for said in service.stderr:  # waits for each line as it comes
        output.append(said)
        if line in said:
            break
    service.terminate()
    _, rest = service.communicate(timeout=10)
    return service.returncode, "".join(output) + (rest or "")


def test_a_stop_before_the_service_serves_cancels_its_start() -> None:
    code, output = _stop_when_it_says("starting", "starting")
    assert code == 0, output
    assert "stopped_while_starting" in output and "start undone" in output and "service_stopped" in output


def test_a_stop_once_the_service_serves_lets_it_drain() -> None:
    code, output = _stop_when_it_says("serving", READY_EVENT)
    assert code == 0, output
    assert "drained" in output and "stopped_while_starting" not in output
