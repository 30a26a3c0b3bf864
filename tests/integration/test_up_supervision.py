"""Faults through `kvlane up` itself: it restarts what died and the rest of the fleet keeps serving.

Each fault test prints one line (streams sent / completed / failed
explicitly / refused / lost, migrations, restart time) that
docs/benchmarks.md quotes; run with `-s` to see them. Load runs as lanes of
streams, each lane starting its next stream when the last one ends.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
import pytest

from launch.launcher import free_port
from tests.heartbeats import heartbeat_of
from tests.integration.conftest import MODEL
from tests.waiting import until
from tests.integration.test_faults import expected_text, health_state
from tests.integration.test_kvlane_up import alive, children_of

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads children from /proc"),
]

# Longer than a restart takes: the restarted worker heartbeats before the killed one's last heartbeat expires.
HEARTBEAT_TTL_S = 6.0
STREAMS = 200
MAX_TOKENS = 200


class KvlaneUp:
    """`kvlane up` as a user starts it, on free ports; its output is collected line by line as it comes."""

    def __init__(self, tmp_path: Path, workers: int, supervision: str = "", extra_args: tuple[str, ...] = ()) -> None:
        nats_port, redis_port, self.port = free_port(), free_port(), free_port()
        self.nats_url = f"nats://127.0.0.1:{nats_port}"
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = tmp_path / "kvlane.toml"
        config.write_text(
            f'[nats]\nurl = "{self.nats_url}"\n\n[redis]\nurl = "{self.redis_url}"\n\n'
            f'[cluster]\nheartbeat_interval_s = 0.25\nheartbeat_ttl_s = {HEARTBEAT_TTL_S}\nresync_interval_s = 0.5\n\n'
            '[worker]\ndrain_timeout_s = 20.0\n\n'
            f'[supervision]\n{supervision}\n'
        )
        self.popen = subprocess.Popen(
            [str(Path(sys.executable).parent / "kvlane"), "up", "--engine", "sim", "--config", str(config), "--port", str(self.port),
             "--workers", str(workers), "--log-dir", str(tmp_path / "logs"), *extra_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "400"},
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._output_ended = False
        threading.Thread(target=self._collect, daemon=True).start()
        self.children: list[int] = []

    def _collect(self) -> None:
        for line in self.popen.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._output_ended = True
            self._changed.notify_all()

    def wait_line(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """The first output line matching `pattern`, once it has been printed."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if found := re.search(pattern, line):
                        return found
                left = deadline - time.monotonic()
                assert left > 0 and not self._output_ended, (
                    f"no line matching {pattern!r} (exit {self.popen.poll()}):\n" + "\n".join(self.lines))
                self._changed.wait(min(left, 1.0))

    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_ready(self) -> None:
        self.wait_line(r"ready .*base URL", timeout=120)
        self.children = children_of(self.popen.pid)

    def service_pid(self, module: str, worker_id: str | None = None) -> int:
        """The pid of the running `python -m services.<module>` child (with `worker_id`, that worker's)."""
        for pid in children_of(self.popen.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"services.{module}".encode() not in argv or not alive(pid):
                continue
            if worker_id is None or f'KVLANE__WORKER__WORKER_ID="{worker_id}"'.encode() in environ:
                return pid
        raise AssertionError(f"no running services.{module} {worker_id or ''} under kvlane up:\n{self.output()}")

    def stop(self) -> int:
        """Ctrl-C, as a user stops it; its exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
        return self.popen.wait(90)

    def kill_leftovers(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        for pid in [*self.children, *children_of(self.popen.pid)]:
            if alive(pid):  # what a failure left behind must not outlive the test
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def start_up(tmp_path: Path):
    started: list[KvlaneUp] = []

    def start(workers: int, supervision: str = "", extra_args: tuple[str, ...] = ()) -> KvlaneUp:
        up = KvlaneUp(tmp_path, workers, supervision, extra_args)
        started.append(up)
        up.wait_ready()
        return up

    yield start
    for up in started:
        try:
            up.stop()
        finally:
            up.kill_leftovers()


@dataclass
class StreamLoad:
    sent: int = 0
    completed: int = 0
    failed: list[str] = field(default_factory=list)  # ended with an explicit error (an HTTP error or an SSE error event)
    broken: list[str] = field(default_factory=list)  # the connection broke under it (its ingress process died)
    refused: list[str] = field(default_factory=list)  # the ingress could not be reached
    lost: list[str] = field(default_factory=list)  # hung, or ended without [DONE]
    wrong: list[int] = field(default_factory=list)  # completed with a gap or a duplicate in the text
    streaming: int = 0  # streams that have received their first token and not yet ended

    def report(self, fault: str, migrations: float, restart_s: float) -> str:
        return (f"FAULT {fault}: sent={self.sent} completed={self.completed} failed={len(self.failed)} "
                f"broken={len(self.broken)} refused={len(self.refused)} lost={len(self.lost)} migrations={migrations:g} "
                f"restart={restart_s:.2f}s"
                + (f" (failures: {sorted(set(self.failed))[:3]})" if self.failed else ""))


async def one_stream(session: aiohttp.ClientSession, base_url: str, index: int, load: StreamLoad) -> None:
    prompt, seed = f"supervised load request number {index}", 5000 + index
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "seed": seed, "stream": True}
    load.sent += 1
    pieces: list[str] = []
    streaming = failed = False
    request_id = "not yet known"  # the ingress's, for its logs (it sends headers with the first token)
    try:
        async with session.post(f"{base_url}/v1/completions", json=body) as response:
            request_id = response.headers.get("X-Request-Id", "none")
            if response.status != 200:
                load.failed.append(f"HTTP {response.status}: {(await response.text())[:200]}")
                return
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    if failed:
                        return
                    load.completed += 1
                    if "".join(pieces) != expected_text(prompt, seed, MAX_TOKENS):
                        load.wrong.append(index)
                    return
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    load.failed.append(f"stream error: {event['error']}")
                    failed = True  # the [DONE] that follows closes a failed stream
                elif event["choices"]:
                    pieces.append(event["choices"][0]["text"])
                    if not streaming:
                        streaming = True
                        load.streaming += 1
            if not failed:
                load.lost.append(f"stream {index} (request {request_id}, {len(pieces)} pieces) ended without [DONE]")
    except aiohttp.ClientConnectorError as exc:
        load.refused.append(str(exc))
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as exc:
        load.broken.append(f"stream {index} (request {request_id}, {len(pieces)} pieces): {type(exc).__name__}: {exc}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        load.lost.append(f"stream {index} (request {request_id}, {len(pieces)} pieces): {type(exc).__name__}: {exc}")
    finally:
        if streaming:
            load.streaming -= 1


async def steady_streams(base_url: str, lanes: int, stop: asyncio.Event, load: StreamLoad) -> None:
    # A stream that stops moving for this long is lost, not slow: as long as the ingress's own stall timeout, so a
    # stream that had to wait it out (its node restarted unnoticed) is lost too.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=30)
    connector = aiohttp.TCPConnector(limit=lanes)
    counter = iter(range(1_000_000))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def lane() -> None:
            while not stop.is_set():
                await one_stream(session, base_url, next(counter), load)

        await asyncio.gather(*(lane() for _ in range(lanes)))


async def metric_values(base_url: str, name: str) -> dict[str, float]:
    """Every sample of one metric on the ingress's /metrics, by its label text."""
    async with aiohttp.ClientSession() as session, session.get(f"{base_url}/metrics") as response:
        text = await response.text()
    return {line[len(name):].rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(name + "{")}


async def metric_total(base_url: str, name: str) -> float:
    """The sum of one metric's samples on the ingress's /metrics, labelled or not (0 when it has none)."""
    async with aiohttp.ClientSession() as session, session.get(f"{base_url}/metrics") as response:
        text = await response.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def test_a_worker_killed_under_streaming_load_is_restarted_and_no_stream_is_lost(start_up) -> None:
    up = start_up(workers=3)
    ingress_pid = up.service_pid("ingress")
    bystanders = {worker_id: up.service_pid("worker", worker_id) for worker_id in ("w1", "w2")}
    victim = up.service_pid("worker", "w0")
    killed_start = (await heartbeat_of(up.redis_url, "w0")).registration.started_at
    load, stop = StreamLoad(), asyncio.Event()
    streams = asyncio.create_task(steady_streams(up.base_url, STREAMS, stop, load))

    async def many_streaming() -> bool:
        return load.streaming >= STREAMS // 4

    await until(many_streaming, 120, lambda: f"{STREAMS // 4} streams in flight ({load})")
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    await asyncio.to_thread(up.wait_line, r"worker-w0 was killed by SIGKILL; restart 1 in ")
    restarted = int((await asyncio.to_thread(up.wait_line, r"worker-w0 restarted \(pid (\d+), restarts: 1\)")).group(1))
    await asyncio.to_thread(up.wait_line, r"worker-w0 serves again, [\d.]+s after it went down")
    restart_s = time.monotonic() - killed
    assert up.service_pid("worker", "w0") == restarted != victim

    async def w0_serves_again() -> bool:
        heartbeat = await heartbeat_of(up.redis_url, "w0")
        return heartbeat.registration.started_at != killed_start and heartbeat.stats.running > 0

    await until(w0_serves_again, 60, "the restarted w0 running requests")

    async def w0_judged_afresh() -> bool:
        # Every stream the kill broke complained about w0; those complaints were about the killed process and
        # must not keep the new one suspect for the feedback window (30 s), about twice this wait.
        return await health_state(up.redis_url, "w0") == "healthy"

    await until(w0_judged_afresh, 15, "the restarted w0's health verdict healthy")
    stop.set()
    await asyncio.wait_for(streams, 120)
    migrations = sum((await metric_values(up.base_url, "kvlane_ingress_migrations_total")).values())
    print(load.report(f"worker SIGKILL under kvlane up ({STREAMS} streams, 3 sim workers)", migrations, restart_s))
    assert not load.refused, load.refused[:3]
    assert not load.lost and not load.broken, (load.lost + load.broken)[:3]
    assert load.sent == load.completed + len(load.failed)
    assert not load.wrong, f"streams with gaps or duplicates: {load.wrong[:3]}"
    assert migrations >= 1, "no stream was migrated off the killed worker"
    # Only w0 was restarted: the ingress and the other workers kept serving throughout.
    assert up.service_pid("ingress") == ingress_pid
    assert {worker_id: up.service_pid("worker", worker_id) for worker_id in bystanders} == bystanders
    assert [line for line in up.lines if " restarted (" in line] == [f"worker-w0 restarted (pid {restarted}, restarts: 1)"]
    assert up.stop() == 0
    assert "restarts: worker-w0 1\nstopped." in up.output()


async def test_a_killed_ingress_is_restarted_on_its_port(start_up) -> None:
    up = start_up(workers=1)
    worker = up.service_pid("worker", "w0")
    ingress = up.service_pid("ingress")
    os.kill(ingress, signal.SIGKILL)
    killed = time.monotonic()
    await asyncio.to_thread(up.wait_line, r"ingress was killed by SIGKILL; restart 1 in ")

    async def ready() -> bool:
        try:
            async with aiohttp.ClientSession() as session, session.get(f"{up.base_url}/ready") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    await until(ready, 60, "the restarted ingress ready")
    restart_s = time.monotonic() - killed
    load = StreamLoad()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one_stream(session, up.base_url, index, load) for index in range(4)))
    print(f"FAULT ingress SIGKILL under kvlane up: ready again after {restart_s:.2f}s; then {load.completed}/{load.sent} streams completed")
    assert load.completed == load.sent == 4 and not load.wrong
    await asyncio.to_thread(up.wait_line, r"ingress serves again")
    assert up.service_pid("ingress") != ingress
    assert up.service_pid("worker", "w0") == worker


def test_a_crash_loop_stops_the_fleet_with_the_reason(start_up) -> None:
    up = start_up(workers=1, supervision="restart_limit = 1\nstable_after_s = 600.0\n")
    os.kill(up.service_pid("worker", "w0"), signal.SIGKILL)
    up.wait_line(r"worker-w0 serves again")
    os.kill(up.service_pid("worker", "w0"), signal.SIGKILL)
    assert up.popen.wait(90) == 1
    up.wait_line(r"worker-w0 was killed by SIGKILL, 2 times in a row within 600s of starting: given up .*; stopping the fleet")
    assert "restarts: worker-w0 1\nstopped." in up.output()
    deadline = time.monotonic() + 30
    while left := [pid for pid in up.children if alive(pid)]:
        assert time.monotonic() < deadline, f"still running after kvlane up gave up: {left}"
        time.sleep(0.1)


async def _load_through(up: KvlaneUp, fault: Callable[[StreamLoad], Awaitable[float]]) -> tuple[StreamLoad, float]:
    """STREAMS lanes of streams; `fault` runs once a quarter of them stream, and returns when the fleet has recovered
    (its restart time); then STREAMS more streams start before the load winds down."""
    load, stop = StreamLoad(), asyncio.Event()
    streams = asyncio.create_task(steady_streams(up.base_url, STREAMS, stop, load))

    async def many_streaming() -> bool:
        return load.streaming >= STREAMS // 4

    await until(many_streaming, 120, lambda: f"{STREAMS // 4} streams in flight ({load})")
    restart_s = await fault(load)
    sent_after = load.sent + STREAMS
    await until(lambda: load.sent >= sent_after, 120, lambda: f"{STREAMS} streams started after the restart ({load})")
    stop.set()
    await asyncio.wait_for(streams, 120)
    return load, restart_s


def _client_ports_held_by(pid: int, port: int) -> set[int]:
    """The client ends (their ports) of the connections process `pid` has open on `port`."""
    return {conn.raddr.port for conn in psutil.Process(pid).net_connections(kind="tcp")
            if conn.laddr and conn.laddr.port == port and conn.raddr and conn.status == psutil.CONN_ESTABLISHED}


async def test_a_killed_balancer_or_ingress_process_under_streaming_load_loses_no_stream(start_up) -> None:
    """The control plane restarting is not the clients' error: with the only balancer SIGKILLed mid-run, route
    requests wait for its restart (`ingress.balancer_wait_s`) and at least 99% of the streams complete, none lost;
    with one of two ingress processes SIGKILLed, the other serves on and the only streams not completed are those
    whose connections the killed process held, each broken off (no hang)."""
    up = start_up(workers=3, extra_args=("--ingress-processes", "2"))
    workers = {worker_id: up.service_pid("worker", worker_id) for worker_id in ("w0", "w1", "w2")}
    supervisor = up.service_pid("ingress")

    async def kill_the_balancer(load: StreamLoad) -> float:
        os.kill(up.service_pid("balancer"), signal.SIGKILL)
        killed = time.monotonic()
        await asyncio.to_thread(up.wait_line, r"balancer was killed by SIGKILL; restart 1 in ")
        await asyncio.to_thread(up.wait_line, r"balancer serves again")
        return time.monotonic() - killed

    load, restart_s = await _load_through(up, kill_the_balancer)
    waits = await metric_total(up.base_url, "kvlane_ingress_balancer_waits_total")
    given_up = await metric_total(up.base_url, "kvlane_ingress_routes_given_up_total")
    print(load.report(f"balancer SIGKILL under kvlane up ({STREAMS} streams, 3 sim workers)", 0, restart_s)
          + f" routes_held_for_a_balancer={waits:g} routes_given_up={given_up:g}")
    assert not load.refused and not load.lost and not load.broken, (load.refused + load.lost + load.broken)[:3]
    assert not load.wrong, f"streams with gaps or duplicates: {load.wrong[:3]}"
    assert load.sent == load.completed + len(load.failed)
    assert load.completed >= 0.99 * load.sent, load.failed[:3]

    siblings = children_of(supervisor)
    assert len(siblings) == 2, siblings
    held_by_victim: set[int] = set()

    async def kill_an_ingress_process(load: StreamLoad) -> float:
        victim, survivor = siblings
        held_by_victim.update(_client_ports_held_by(victim, up.port))
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()

        def restarted() -> bool:
            now = [pid for pid in children_of(supervisor) if alive(pid)]
            return len(now) == 2 and survivor in now and victim not in now

        await until(restarted, 60, "the killed ingress process restarted beside the other")
        return time.monotonic() - killed

    load, restart_s = await _load_through(up, kill_an_ingress_process)
    print(load.report(f"SIGKILL of one of 2 ingress processes under kvlane up ({STREAMS} streams, 3 sim workers)", 0,
                      restart_s) + f" connections_on_killed_process={len(held_by_victim)}")
    assert not load.refused and not load.lost, (load.refused + load.lost)[:3]
    assert not load.wrong, f"streams with gaps or duplicates: {load.wrong[:3]}"
    assert not load.failed, load.failed[:3]
    assert load.sent == load.completed + len(load.broken)
    assert len(load.broken) <= len(held_by_victim), load.broken[:3]
    # Nothing else was restarted: the workers, the ingress's supervisor and its other process served throughout.
    assert {worker_id: up.service_pid("worker", worker_id) for worker_id in workers} == workers
    assert up.service_pid("ingress") == supervisor
    assert up.stop() == 0
