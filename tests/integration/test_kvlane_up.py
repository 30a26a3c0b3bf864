"""`kvlane up` as a user runs it: what it starts ends with it, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.launcher import free_port, port_open
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # The command name may hold spaces and parentheses: the fields start after the last ')'.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")
def test_a_killed_kvlane_up_leaves_no_process_behind(tmp_path: Path) -> None:
    nats_port, redis_port, port = free_port(), free_port(), free_port()
    config = tmp_path / "kvlane.toml"
    config.write_text(
        f'[nats]\nurl = "nats://127.0.0.1:{nats_port}"\n\n[redis]\nurl = "redis://127.0.0.1:{redis_port}/0"\n\n'
        '[cluster]\nheartbeat_interval_s = 0.25\nheartbeat_ttl_s = 1.0\nresync_interval_s = 0.5\n'
    )
    up = subprocess.Popen(
        [str(Path(sys.executable).parent / "kvlane"), "up", "--config", str(config), "--port", str(port), "--workers", "1",
         "--ingress-processes", "2", "--otlp-endpoint", f"http://127.0.0.1:{free_port()}", "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"},
    )
    started: list[int] = []
    try:
        seen = []
        for line in up.stdout:  # ends if kvlane up exits
            seen.append(line)
            if "ready" in line and "base URL" in line:
                break
        assert up.poll() is None, "".join(seen)
        # Local use: no API keys, and it says so.
        assert any("API keys off" in line for line in seen), "".join(seen)
        started = children_of(up.pid)
        # NATS, Redis, balancer, cache-manager, health-prober, one worker, ingress (supervising two processes).
        assert len(started) == 7, "".join(seen)
        started += [pid for child in started for pid in children_of(child)]
        assert len(started) == 9, "".join(seen)
        names = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[-60:] for pid in started}
        up.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        up.wait(10)
        # Each gets SIGTERM as its parent dies; idle, each is gone within 2 s (a bounded poll: not our children).
        exited: dict[int, float] = {}

        def all_exited() -> bool:
            for pid in started:
                if pid not in exited and not alive(pid):
                    exited[pid] = time.monotonic() - killed
            return len(exited) == len(started)

        wait_for(all_exited, 30, lambda: "every process kvlane up started to exit after it was killed; still running: "
                 f"{[names[pid] for pid in started if pid not in exited]}")
        print("after SIGKILL of kvlane up: " + ", ".join(f"{names[pid]} {seconds:.2f}s" for pid, seconds in exited.items()))
        assert all(seconds < 2.0 for seconds in exited.values()), {names[pid]: s for pid, s in exited.items()}
        for listened in (nats_port, redis_port, port):
            assert not port_open("127.0.0.1", listened)
    finally:
        if up.poll() is None:
            up.kill()
        for pid in [*started, *children_of(up.pid)]:
            if alive(pid):  # what a failure left behind must not outlive the test
                os.kill(pid, signal.SIGKILL)
