"""Waiting for balancer processes to serve, for the balancer's integration tests."""

from __future__ import annotations

import time

from kvlane.launcher import LaunchError, Process


def wait_balancers_ready(processes: list[Process], timeout: float = 30.0) -> None:
    """Until every balancer has logged `balancer_ready` (its subscriptions are in place)."""
    deadline = time.monotonic() + timeout
    pending = list(processes)
    while pending:
        for process in list(pending):
            if not process.alive():
                raise LaunchError(f"{process.name} exited with {process.popen.returncode}:\n{process.log_tail()}")
            try:
                if '"balancer_ready"' in process.log_path.read_text(errors="replace"):
                    pending.remove(process)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise LaunchError(f"{[p.name for p in pending]} not ready within {timeout:.0f}s")
        time.sleep(0.05)
