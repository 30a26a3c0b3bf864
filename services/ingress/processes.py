"""Several ingress processes on one HTTP port (`ingress.processes`), as siblings.

`python -m services.ingress` with `ingress.processes = N > 1` runs a small
supervising process that serves no HTTP: it holds the port (bound with
SO_REUSEPORT, never listening, so port 0 becomes one port for all and no
other program takes it while a process restarts) and starts N ingress
processes that bind it too: the kernel spreads incoming connections over
those listening, so the HTTP and JSON work of the ingress uses more than
one core. Each has its own NATS connection and ingress id (`<id>-<k>`),
hence its own stream inbox and its own /ready.

No process's death takes another down: one that exits is started again
(shared/restarts.py's rules, as `kvlane up` restarts its services) while
the others keep the port served; only the streams open on the one that
died end. They end with the supervisor (PR_SET_PDEATHSIG), which does
nothing else that could crash; a SIGTERM to it drains them all.

A scrape of /metrics reaches whichever process the kernel picks, so the
request metrics live in prometheus_client's multiprocess mode: every process
writes its counters and histograms to files in PROMETHEUS_MULTIPROC_DIR and
any of them serves the sum of all (`IngressMetrics`). The mode is chosen
when prometheus_client is imported, so the directory is set up before that
(`python -m services.ingress` does it, with `prepare_metrics_dir`); a
process that died is marked dead there, so its live gauges stop counting.
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
import uuid
from pathlib import Path

import structlog

from contracts import subjects
from shared.config import ENV_PREFIX, KvlaneConfig, to_env
from shared.parent_death import ending_with
from shared.restarts import GiveUp, RestartBook, RestartPolicy
from shared.runner import mark_serving

log = structlog.get_logger("kvlane.ingress")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_PROCESSES_ENV = f"{ENV_PREFIX}INGRESS__PROCESSES"
# Set for the processes the supervisor starts: they bind its port with SO_REUSEPORT
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


class IngressProcesses:
    """The supervisor's children: `start` them on the port, each restarted when it exits; `stop` drains them."""

    def __init__(self, config: KvlaneConfig, ingress_ids: list[str], port: int,
                 policy: RestartPolicy = RestartPolicy()) -> None:
        self._ingress_ids = ingress_ids
        self._port = port
        # Everything as the supervisor has it (file and environment), as KVLANE__* variables.
        self._env = {**os.environ, **to_env(config), _PROCESSES_ENV: "1", SHARES_PORT_ENV: "1",
                     f"{ENV_PREFIX}INGRESS__PORT": str(port)}
        self._restarts = RestartBook(policy)
        self._running: dict[str, subprocess.Popen[bytes]] = {}
        self._keepers: list[asyncio.Task[None]] = []
        self._stopping = False

    def start(self) -> None:
        for ingress_id in self._ingress_ids:
            self._keepers.append(asyncio.get_running_loop().create_task(self._keep(ingress_id), name=f"ingress {ingress_id}"))

    async def given_up(self) -> None:
        """Returns once every process has been given up (each crash-looping): the port is served no more."""
        await asyncio.wait(self._keepers)  # cancelling this wait leaves the keepers running

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


def hold_port(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` with SO_REUSEPORT and never listening: the port stays this group's (port 0
    becomes a free one) while connections go only to the processes that listen on it."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    held = socket.socket(family, kind, proto)
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(address)
    except OSError:
        held.close()
        raise
    return held


async def supervise(config: KvlaneConfig, stop: asyncio.Event) -> None:
    """The supervising process's main: `ingress.processes` ingress processes on the port until `stop`."""
    settings = config.ingress
    if (refusal := platform_refusal(settings.processes)) is not None:
        raise SystemExit(refusal)
    if not os.environ.get(METRICS_DIR_ENV):
        raise SystemExit(f"ingress.processes > 1 needs {METRICS_DIR_ENV} set before prometheus_client is imported, "
                         "so that /metrics counts every process: start the ingress with `python -m services.ingress`")
    try:
        ingress_ids = process_ids(settings.ingress_id or f"i-{uuid.uuid4().hex[:8]}", settings.processes)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    try:
        held = hold_port(settings.host, settings.port)
    except OSError as exc:
        raise SystemExit(f"ingress port {settings.host}:{settings.port}: {exc}") from exc
    with held:
        processes = IngressProcesses(config, ingress_ids, held.getsockname()[1])
        processes.start()
        mark_serving()  # its processes say when they serve; a stop from here on drains them
        given_up = asyncio.ensure_future(processes.given_up())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([given_up, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            given_up.cancel()
            await processes.stop(settings.request_timeout_s + 5.0)
        if not stop.is_set():
            raise SystemExit("every ingress process was given up (each exited again and again soon after starting)")


def _forget_metrics_of(pid: int) -> None:
    """A process gone: its in-flight gauge no longer counts (its counters and histograms still do)."""
    if os.environ.get(METRICS_DIR_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
