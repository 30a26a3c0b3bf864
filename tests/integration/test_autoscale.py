"""`kvlane up --autoscale`: the autoscaler service decides from live signals, the actuator starts and drains workers;
each base model's pools apart."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest
import redis

from contracts import subjects
from contracts.autoscaler import PoolKey, ScalingDecision
from launch.launcher import Launcher, free_port, wait_services_ready
from shared.config import RedisSettings, load_config
from shared.credentials import redis_url_and_options
from tests.integration.conftest import MODEL, start_kvlane_up, stop_kvlane_up
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


class Output:
    """The lines a process prints, as they come."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._arrived = threading.Condition()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            with self._arrived:
                self.lines.append(line.rstrip())
                self._arrived.notify_all()

    def wait_for(self, text: str, timeout_s: float, after: int = 0) -> int:
        """Index of the first line from `after` on that contains `text`."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while True:
                found = next((i for i, line in enumerate(self.lines[after:], after) if text in line), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                assert left > 0, f"no line with {text!r} within {timeout_s:.0f}s:\n" + "\n".join(self.lines[-40:])
                self._arrived.wait(left)


async def burst(port: int, model: str, requests: int) -> list[int]:
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> int:
            body = {"model": model, "prompt": f"burst {i}", "max_tokens": 120, "ignore_eos": True}
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
                await response.read()
                return response.status
        return await asyncio.gather(*(one(i) for i in range(requests)))


@pytest.mark.parametrize("secure", [False, True], ids=["open", "secure"])
def test_autoscale_grows_under_load_and_drains_when_idle(tmp_path: Path, secure: bool) -> None:
    """Secured, each worker the actuator starts gets its own NATS and Redis user as it starts (a live reload)."""
    nats_port, redis_port, port = free_port(), free_port(), free_port()
    config = tmp_path / "kvlane.toml"
    config.write_text("\n".join([
        "[nats]", f'url = "nats://127.0.0.1:{nats_port}"', "[redis]", f'url = "redis://127.0.0.1:{redis_port}/0"',
        "[cluster]", "heartbeat_interval_s = 0.25", "heartbeat_ttl_s = 1.0", "resync_interval_s = 0.5",
        "[balancer.slots]", "max_per_chain = 2",  # the rest of a burst waits in the central queue
        "[worker.sim]", "speed = 0.25",
        "[autoscaler]", "interval_s = 0.5", "stable_window_s = 3.0", "panic_window_s = 1.0", "waiting_per_replica_max = 2.0",
        "up_cooldown_s = 2.0", "down_cooldown_s = 2.0",
        "[autoscaler.aggregated]", "min = 1", "max = 3", "",
    ]))
    up = start_kvlane_up(config, port, tmp_path / "logs", "--workers", "1", "--autoscale", *(["--secure"] if secure else []))
    output = Output(up)
    try:
        output.wait_for("base URL", 90)
        loading = threading.Thread(target=lambda: statuses.extend(asyncio.run(burst(port, MODEL, 16))))
        statuses: list[int] = []
        loading.start()
        grown = output.wait_for("autoscale: started aggregated worker w1", 30)
        loading.join(120)
        assert statuses == [200] * 16, statuses
        # Idle: one replica fewer stays under target, so the extra workers drain, down to the minimum.
        output.wait_for("autoscale: draining worker-w", 40, after=grown)
        settings = RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0")
        if secure:  # the operator's credentials, which `kvlane up --secure` wrote
            settings = load_config(tmp_path / "logs" / "secure" / "operator.toml").redis
        url, options = redis_url_and_options(settings)
        client = redis.Redis.from_url(url, **options)
        deadline = time.monotonic() + 40
        while True:
            decision = msgspec.json.decode(client.get(subjects.AUTOSCALER_DECISION_KEY), type=ScalingDecision)
            if decision.desired() == {PoolKey(MODEL, "aggregated"): 1}:
                break
            assert time.monotonic() < deadline, json.dumps(msgspec.to_builtins(decision))
            time.sleep(0.2)
        client.close()
        assert up.poll() is None, "kvlane up keeps serving while workers come and go"
        if secure:  # the workers started later had their permissions from their first message on
            nats_log = (tmp_path / "logs" / "nats-server.log").read_text()
            assert "Violation" not in nats_log and "authentication error" not in nats_log, nats_log[-3000:]
    finally:
        stop_kvlane_up(up)
    assert up.returncode == 0, "\n".join(output.lines[-40:])


def test_one_model_s_load_scales_its_own_pool_and_not_another_model_s(tmp_path: Path) -> None:
    """Two base models in one fleet, one of them loaded: only its pool grows. The other model's worker, which
    `kvlane up` did not start, is left to whatever started it."""
    other = "other-model"
    nats_port, redis_port, port = free_port(), free_port(), free_port()
    config = tmp_path / "kvlane.toml"
    config.write_text("\n".join([
        "[nats]", f'url = "nats://127.0.0.1:{nats_port}"', "[redis]", f'url = "redis://127.0.0.1:{redis_port}/0"',
        "[cluster]", "heartbeat_interval_s = 0.25", "heartbeat_ttl_s = 1.0", "resync_interval_s = 0.5",
        "[balancer.slots]", "max_per_chain = 2",
        "[worker.sim]", "speed = 0.25",
        "[autoscaler]", "interval_s = 0.5", "stable_window_s = 3.0", "panic_window_s = 1.0", "waiting_per_replica_max = 2.0",
        "up_cooldown_s = 2.0", "down_cooldown_s = 2.0",
        "[autoscaler.aggregated]", "min = 1", "max = 3", "",
    ]))
    up = start_kvlane_up(config, port, tmp_path / "logs", "--workers", "1", "--autoscale")
    output = Output(up)
    launcher = Launcher(tmp_path / "other-logs")
    client = redis.Redis.from_url(f"redis://127.0.0.1:{redis_port}/0")
    try:
        output.wait_for("base URL", 90)
        worker = launcher.start_service("worker", {"KVLANE_CONFIG": str(config), "KVLANE__WORKER__WORKER_ID": '"o0"',
                                                   "KVLANE__WORKER__MODEL": f'"{other}"'}, name="worker-o0")
        wait_services_ready([worker])
        seen: list[dict[PoolKey, int]] = []

        def decided() -> dict[PoolKey, int]:
            stored = client.get(subjects.AUTOSCALER_DECISION_KEY)
            desired = msgspec.json.decode(stored, type=ScalingDecision).desired() if stored else {}
            seen.append(desired)
            return desired

        loaded, idle = PoolKey(MODEL, "aggregated"), PoolKey(other, "aggregated")
        wait_for(lambda: decided().keys() == {loaded, idle}, 20, "a pool of each model")
        statuses: list[int] = []
        loading = threading.Thread(target=lambda: statuses.extend(asyncio.run(burst(port, MODEL, 16))))
        loading.start()
        grown = output.wait_for("autoscale: started aggregated worker w1", 30)
        wait_for(lambda: decided().get(loaded, 0) > 1, 10, "the loaded model's pool grown")
        loading.join(120)
        assert statuses == [200] * 16, statuses
        output.wait_for(f"model '{other}': its pools are not scaled here", 5)
        # Idle again: the loaded model's pool drains to its minimum.
        output.wait_for("autoscale: draining worker-w", 40, after=grown)
        wait_for(lambda: decided() == {loaded: 1, idle: 1}, 40, "both pools at their minimum")
        # The other model was idle all along: whatever the loaded one's latencies and queue, its pool never grew.
        assert all(desired.get(idle, 1) == 1 for desired in seen), seen
        assert "started aggregated worker o" not in "\n".join(output.lines)
        assert up.poll() is None
    finally:
        client.close()
        launcher.stop_all()
        stop_kvlane_up(up)
    assert up.returncode == 0, "\n".join(output.lines[-40:])


def test_the_ingress_reports_what_each_client_saw(shared_fleet) -> None:
    """One `RequestServed` per answered request, with the latencies its client saw: the autoscaler's TTFT and TPOT."""
    import nats

    from contracts.autoscaler import RequestServed

    async def scenario() -> tuple[list[RequestServed], list[dict]]:
        nc = await nats.connect(shared_fleet.config.nats.url)
        events: list[RequestServed] = []
        arrived = asyncio.Event()

        async def on_served(msg) -> None:
            events.append(msgspec.msgpack.decode(msg.data, type=RequestServed))
            if len(events) == 3:
                arrived.set()

        await nc.subscribe(subjects.REQUEST_SERVED, cb=on_served)
        await nc.flush()
        async with aiohttp.ClientSession() as session:
            replies = []
            for tokens in (1, 5, 9):
                body = {"model": MODEL, "prompt": "served", "max_tokens": tokens, "ignore_eos": True}
                async with session.post(f"{shared_fleet.base_url}/v1/completions", json=body) as response:
                    replies.append(await response.json())
            async with session.post(f"{shared_fleet.base_url}/v1/completions", json={"model": "nope", "prompt": "x"}) as bad:
                assert bad.status == 404  # refused before it ran: no event
        await asyncio.wait_for(arrived.wait(), 10)
        await nc.close()
        return events, replies

    events, replies = asyncio.run(scenario())
    assert sorted(e.output_tokens for e in events) == [1, 5, 9]
    assert {e.request_id for e in events} == {r["id"].removeprefix("cmpl-") for r in replies}
    for event in events:
        assert event.model == MODEL and event.ttft_s is not None and 0 < event.ttft_s <= event.e2e_s
        assert (event.tpot_s is None) == (event.output_tokens == 1)
