"""Scale from zero through `kvlane up --autoscale`: an idle pool goes to zero, a request for its model waits in the
balancer while the actuator starts a worker, and is served by it; one that waits past its deadline gets a 503."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from launch.launcher import free_port
from tests.integration.conftest import MODEL, start_kvlane_up, stop_kvlane_up
from tests.waiting import until

pytestmark = pytest.mark.integration


class TimedOutput:
    """The lines a process prints, with when each came."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self._arrived = threading.Condition()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            with self._arrived:
                self.lines.append((time.monotonic(), line.rstrip()))
                self._arrived.notify_all()

    def wait_for(self, text: str, timeout_s: float, after: int = 0) -> int:
        """Index of the first line from `after` on that contains `text`."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while True:
                found = next((i for i, (_, line) in enumerate(self.lines[after:], after) if text in line), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                assert left > 0, f"no line with {text!r} within {timeout_s:.0f}s:\n" + self.tail()
                self._arrived.wait(left)

    def tail(self) -> str:
        return "\n".join(line for _, line in self.lines[-40:])


@contextlib.contextmanager
def fleet_at_zero(tmp_path: Path, *settings: str, secure: bool = False) -> Iterator[tuple[str, TimedOutput]]:
    """`kvlane up --autoscale` with one sim worker in a pool whose min is 0, once that worker is gone; yields the
    base URL and the output. `settings`: more lines of kvlane.toml."""
    nats_port, redis_port, port = free_port(), free_port(), free_port()
    config = tmp_path / "kvlane.toml"
    config.write_text("\n".join([
        "[nats]", f'url = "nats://127.0.0.1:{nats_port}"', "[redis]", f'url = "redis://127.0.0.1:{redis_port}/0"',
        "[cluster]", "heartbeat_interval_s = 0.25", "heartbeat_ttl_s = 1.0", "resync_interval_s = 0.5",
        *settings, "",
    ]))
    up = start_kvlane_up(config, port, tmp_path / "logs", "--workers", "1", "--autoscale", *(["--secure"] if secure else []))
    output = TimedOutput(up)
    base_url = f"http://127.0.0.1:{port}"
    try:
        output.wait_for("base URL", 90)
        output.wait_for("autoscale: draining worker-w0", 30)
        asyncio.run(until_no_worker_serves(base_url, output))
        yield base_url, output
        assert up.poll() is None, "kvlane up keeps serving while its pool goes to zero and back\n" + output.tail()
        if secure:  # ingress and balancer read the decisions, the balancer wakes the autoscaler: all allowed
            nats_log = (tmp_path / "logs" / "nats-server.log").read_text()
            assert "Violation" not in nats_log and "authentication error" not in nats_log, nats_log[-3000:]
    finally:
        stop_kvlane_up(up)
    assert up.returncode == 0, output.tail()


async def until_no_worker_serves(base_url: str, output: TimedOutput, timeout_s: float = 20.0) -> None:
    """The ingress sees no worker and is still ready: the model is served from zero."""
    status: dict = {}
    async with aiohttp.ClientSession() as session:
        async def ready_with_no_worker() -> bool:
            nonlocal status
            async with session.get(f"{base_url}/ready") as response:
                status = json.loads(await response.read())
                return response.status == 200 and status["workers"] == 0

        await until(ready_with_no_worker, timeout_s, lambda: f"ready with no worker; still {status}\n" + output.tail(),
                    every_s=0.1)


async def stream_one(base_url: str, model: str = MODEL) -> tuple[int, float | None, str, dict[str, str]]:
    """Status, seconds to the first token (None: none came), the body and the headers of one streamed completion."""
    body = {"model": model, "prompt": "wake up", "max_tokens": 8, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        sent = time.monotonic()
        async with session.post(f"{base_url}/v1/completions", json=body) as response:
            first_token, text = None, ""
            async for line in response.content:
                if first_token is None and response.status == 200 and line.startswith(b"data: {"):
                    first_token = time.monotonic() - sent
                text += line.decode()
            return response.status, first_token, text, dict(response.headers)


@pytest.mark.parametrize("secure", [False, True], ids=["open", "secure"])
def test_a_request_to_a_pool_at_zero_is_served_once_its_worker_registers(tmp_path: Path, secure: bool) -> None:
    with fleet_at_zero(
        tmp_path,
        "[autoscaler]", "interval_s = 0.5", "stable_window_s = 2.0", "panic_window_s = 1.0", "up_cooldown_s = 20.0",
        "down_cooldown_s = 1.0", "idle_to_zero_s = 2.0",
        "[autoscaler.aggregated]", "min = 0", "max = 1",
        secure=secure,
    ) as (base_url, output):
        asked_at = time.monotonic()
        status, ttft, text, _ = asyncio.run(stream_one(base_url))
        assert status == 200 and ttft is not None, text
        assert text.rstrip().endswith("data: [DONE]"), text
        started = output.wait_for("autoscale: started aggregated worker w1", 5)
        worker_asked_s = output.lines[started][0] - asked_at
        print(f"scale-from-zero TTFT {ttft:.2f}s (worker asked for after {worker_asked_s:.2f}s; "
              f"the rest is the worker's start, registration and routing)")
        assert worker_asked_s < ttft
        # Neither served nor scaled from zero: still not found.
        status, _, text, _ = asyncio.run(stream_one(base_url, "no-such-model"))
        assert status == 404 and "model_not_found" in text, text


def test_a_request_whose_deadline_passes_while_held_gets_503_with_retry_after(tmp_path: Path) -> None:
    # max = 0: the pool goes to zero at once and no worker ever comes.
    with fleet_at_zero(
        tmp_path,
        "[balancer.queue]", "max_wait_s = 2.0", "retry_after_s = 3.0",
        "[autoscaler]", "interval_s = 0.5", "idle_to_zero_s = 1.0", "down_cooldown_s = 0.0",
        "[autoscaler.aggregated]", "min = 0", "max = 0",
    ) as (base_url, output):
        status, ttft, text, headers = asyncio.run(stream_one(base_url))
        assert status == 503 and ttft is None, text
        error = json.loads(text)["error"]
        assert error["code"] == "scaling_from_zero", error
        assert f"no worker of model '{MODEL}' started within 2.0s" in error["message"], error
        assert headers.get("Retry-After") == "3", headers
        # The balancer asked for a worker all the same: only the bound kept the pool at zero.
        autoscaler_log = (tmp_path / "logs" / "autoscaler-0.log").read_text()
        assert '"woken"' in autoscaler_log or "woken" in autoscaler_log, autoscaler_log[-2000:]
