"""Every service with nothing in flight exits within 2 s of SIGTERM.

Tracing goes to an OTLP collector that is not there, as on a laptop with
`--otlp-endpoint` set and no collector running: the exporters' last flush
must not hold up the exit. The ingress runs alone and as two sibling
processes under their supervisor.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import pytest

from launch.fleet import with_overrides
from launch.launcher import Process, free_port, wait_services_ready
from shared.config import to_env
from tests.integration.conftest import launch, stop_and_check

pytestmark = pytest.mark.integration

IDLE_STOP_S = 2.0


async def seconds_to_exit(process: Process) -> float:
    """SIGTERM `process` and wait for it to exit (0); the seconds from the signal to its exit."""
    signalled = time.monotonic()
    process.signal(signal.SIGTERM)
    code = await asyncio.to_thread(process.wait_exit, 30)
    assert code == 0, f"{process.name} exited {code}:\n{process.log_tail()}"
    return time.monotonic() - signalled


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ingress.processes > 1 is Linux only")
async def test_each_idle_service_exits_within_two_seconds_of_sigterm(tmp_path: Path) -> None:
    absent_collector = f"http://127.0.0.1:{free_port()}"
    fleet = launch(tmp_path, workers=1, tune=lambda c: with_overrides(
        c, tracing={"exporter": "otlp", "otlp_endpoint": absent_collector, "metrics_interval_s": 1.0}))
    try:
        autoscaler = fleet.add_autoscaler()
        siblings = fleet.launcher.start_service("ingress", to_env(fleet.config) | {
            "KVLANE__INGRESS__PROCESSES": "2", "KVLANE__INGRESS__PORT": str(free_port()),
            "KVLANE__INGRESS__INGRESS_ID": '"ix"'}, name="ingress-siblings")
        await asyncio.to_thread(wait_services_ready, [autoscaler, siblings])
        assert fleet.ingress is not None
        exits = {}
        for process in (fleet.ingress, siblings, autoscaler, *fleet.workers, *fleet.health_probers,
                        *fleet.cache_managers, *fleet.balancers):
            exits[process.name] = await seconds_to_exit(process)
        print("idle stop: " + ", ".join(f"{name} {seconds:.2f}s" for name, seconds in exits.items()))
        assert all(seconds < IDLE_STOP_S for seconds in exits.values()), exits
    finally:
        stop_and_check(fleet)
