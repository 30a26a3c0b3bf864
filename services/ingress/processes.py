"""Several ingress processes on one HTTP port (`ingress.processes`).

The process started first binds the port with SO_REUSEPORT, then starts the
others, which bind it too: the kernel spreads incoming connections over all
of them, so the HTTP and JSON work of the ingress uses more than one core.
Each process has its own NATS connection and ingress id (`<id>-<k>`, the
first being `<id>-0`), hence its own stream inbox and its own /ready.

The others must not outlive the first: each gets SIGTERM when it dies,
however it dies (PR_SET_PDEATHSIG), and is stopped with it otherwise. One
that exits on its own is started again, as `kvlane up` restarts its services
(`shared/restarts.py`).

A scrape of /metrics reaches whichever process the kernel picks, so the
request metrics live in prometheus_client's multiprocess mode: every process
writes its counters and histograms to files in PROMETHEUS_MULTIPROC_DIR and
any of them serves the sum of all (`IngressMetrics`). The mode is chosen
when prometheus_client is imported, so the directory is set up before that
(`python -m services.ingress` does it, with `prepare_metrics_dir`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

from contracts import subjects
from shared.config import ENV_PREFIX, KvlaneConfig, to_env
from shared.parent_death import ending_with
from shared.restarts import GiveUp, RestartBook, RestartPolicy

log = structlog.get_logger("kvlane.ingress")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_PROCESSES_ENV = f"{ENV_PREFIX}INGRESS__PROCESSES"
# Set for the processes the first one starts: they bind its port with SO_REUSEPORT too
# (an ingress started alone on a port in use fails, as it should).
SHARES_PORT_ENV = "KVLANE_INGRESS_SHARES_PORT"


def platform_refusal(processes: int) -> str | None:
    """Why this platform cannot run `processes` ingress processes on one port, or None."""
    if processes <= 1:
        return None
    if not sys.platform.startswith("linux") or not hasattr(socket, "SO_REUSEPORT"):
        return (f"ingress.processes = {processes} needs Linux: the processes share the port with SO_REUSEPORT, "
                f"which spreads connections over them only there; this platform is {sys.platform}")
    return None


def process_ids(base_id: str, processes: int) -> list[str]:
    """The ingress id of each process: `base_id` alone, or `<base_id>-<k>` for k in 0..processes-1."""
    ids = [base_id] if processes == 1 else [f"{base_id}-{k}" for k in range(processes)]
    for ingress_id in ids:
        if not subjects.is_valid_token(ingress_id):
            raise ValueError(f"ingress_id {ingress_id!r} must be 1-64 characters of A-Z a-z 0-9 _ -")
    return ids


def prepare_metrics_dir(processes: int, environ: dict[str, str] | os._Environ[str] = os.environ) -> Path | None:
    """For several processes, a PROMETHEUS_MULTIPROC_DIR in `environ`; returns it when made here (remove it at exit).

    One given already is this ingress's own: its files from an earlier run are
    removed, or the counters would start from that run's totals.
    """
    if processes <= 1:
        return None
    given = environ.get(METRICS_DIR_ENV)
    if given:
        folder = Path(given)
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.db"):
            stale.unlink(missing_ok=True)
        return None
    made = Path(tempfile.mkdtemp(prefix="kvlane-ingress-metrics-"))
    environ[METRICS_DIR_ENV] = str(made)
    return made


class SiblingProcesses:
    """The ingress processes after the first, started by it on its port; `stop` ends them."""

    def __init__(self, config: KvlaneConfig, ingress_ids: list[str], port: int, restart_delay_s: float = 1.0) -> None:
        self._ingress_ids = ingress_ids
        self._port = port
        # Everything as the first process has it (file and environment), as KVLANE__* variables.
        self._env = {**os.environ, **to_env(config), _PROCESSES_ENV: "1", SHARES_PORT_ENV: "1",
                     f"{ENV_PREFIX}INGRESS__PORT": str(port)}
        self._restarts = RestartBook(RestartPolicy(first_delay_s=restart_delay_s))
        self._running: dict[str, subprocess.Popen[bytes]] = {}
        self._keepers: list[asyncio.Task[None]] = []
        self._stopping = False

    @property
    def pids(self) -> list[int]:
        return [popen.pid for popen in self._running.values()]

    def start(self) -> None:
        for ingress_id in self._ingress_ids:
            self._keepers.append(asyncio.get_running_loop().create_task(self._keep(ingress_id), name=f"ingress {ingress_id}"))

    def _spawn(self, ingress_id: str) -> subprocess.Popen[bytes]:
        # From the event loop's thread: PR_SET_PDEATHSIG fires when the starting thread ends.
        popen = subprocess.Popen(
            [sys.executable, "-m", "services.ingress"],
            env={**self._env, f"{ENV_PREFIX}INGRESS__INGRESS_ID": json.dumps(ingress_id)},
            preexec_fn=ending_with(os.getpid()),
        )
        log.info("ingress_process_started", ingress_id=ingress_id, pid=popen.pid, port=self._port)
        return popen

    async def _keep(self, ingress_id: str) -> None:
        while not self._stopping:
            self._restarts.started(ingress_id, time.monotonic())
            popen = self._running[ingress_id] = self._spawn(ingress_id)
            returncode = await asyncio.shield(asyncio.to_thread(popen.wait))
            _forget_metrics_of(popen.pid)
            if self._stopping:
                return
            outcome = self._restarts.exited(ingress_id, time.monotonic())
            if isinstance(outcome, GiveUp):  # crash-looping: the others serve on without it
                log.error("ingress_process_given_up", ingress_id=ingress_id, pid=popen.pid, returncode=returncode,
                          failures=outcome.failures)
                return
            log.error("ingress_process_exited", ingress_id=ingress_id, pid=popen.pid, returncode=returncode,
                      restart_in_s=outcome.delay_s)
            await asyncio.sleep(outcome.delay_s)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM to each (they drain like any ingress), SIGKILL to those still running after `timeout_s`."""
        self._stopping = True
        running = [popen for popen in self._running.values() if popen.poll() is None]
        for popen in running:
            popen.terminate()
        try:
            await asyncio.wait_for(asyncio.gather(*(asyncio.to_thread(popen.wait) for popen in running)), timeout_s)
        except TimeoutError:
            for popen in running:
                if popen.poll() is None:
                    log.warning("ingress_process_killed", pid=popen.pid, timeout_s=timeout_s)
                    popen.kill()
            await asyncio.gather(*(asyncio.to_thread(popen.wait) for popen in running))
        for keeper in self._keepers:
            keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._keepers, return_exceptions=True)


def _forget_metrics_of(pid: int) -> None:
    """A process gone: its in-flight gauge no longer counts (its counters and histograms still do)."""
    if os.environ.get(METRICS_DIR_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
