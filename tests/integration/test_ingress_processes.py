"""Two ingress processes on one port (`ingress.processes = 2`) in front of a sim worker.

Requests on fresh connections reach both processes (each streams its
replies to its own ingress id's inbox, which a NATS watcher sees); any
process's /metrics counts every request; a SIGKILLed process is restarted
while the other serves on; SIGKILLing the supervising process ends both.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import nats
import psutil
import pytest

from contracts import subjects
from launch.fleet import Fleet, with_overrides
from services.ingress.processes import METRICS_DIR_ENV
from tests.integration.conftest import MODEL, launch, stop_and_check
from tests.waiting import until, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ingress.processes > 1 is Linux only"),
]

INGRESS_ID = "ix"
COMPLETED = re.compile(r'^kvlane_ingress_requests_total\{endpoint="/v1/completions",status="200"\} (\S+)$', re.MULTILINE)


@pytest.fixture
def fleet(tmp_path) -> Iterator[Fleet]:
    fleet = launch(tmp_path, workers=1, tune=lambda c: with_overrides(c, ingress={"processes": 2, "ingress_id": INGRESS_ID}))
    yield fleet
    stop_and_check(fleet)


def _serving(fleet: Fleet) -> list[psutil.Process]:
    """The ingress processes under the supervising one, once there are two."""
    assert fleet.ingress is not None
    children = [child for child in psutil.Process(fleet.ingress.pid).children() if not _ended(child)]
    return children if len(children) == 2 else []


def _ingress_id(process: psutil.Process) -> str:
    return process.environ()["KVLANE__INGRESS__INGRESS_ID"].strip('"')


def _ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def _complete_on_a_new_connection(base_url: str) -> None:
    # force_close: one connection per request, so the kernel picks a process for each.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as response:
            assert response.status == 200, await response.text()


async def _completed_count(base_url: str) -> float:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.get(f"{base_url}/metrics") as response:
            text = await response.text()
    found = COMPLETED.search(text)
    return float(found.group(1)) if found else 0.0


async def test_two_sibling_processes_share_the_port_the_metrics_and_outlive_each_other(fleet: Fleet) -> None:
    processes = wait_for(lambda: _serving(fleet), 10, "two ingress processes")

    # Each process has workers stream to its own inbox: kvlane.stream.<ingress id>.<stream>.
    owners: set[str] = set()
    nc = await nats.connect(fleet.config.nats.url)
    try:
        async def watch(msg: nats.aio.msg.Msg) -> None:
            owner = msg.subject.split(".")[-2]
            if owner.startswith(INGRESS_ID):  # not the health prober's probes
                owners.add(owner)

        await nc.subscribe(subjects.stream_inbox("*"), cb=watch)
        await nc.flush()
        sent = 0

        async def both_served() -> bool:
            nonlocal sent
            await _complete_on_a_new_connection(fleet.base_url)
            sent += 1
            return len(owners) == 2

        await until(both_served, 30, lambda: f"requests on fresh connections reached only {owners}")
    finally:
        await nc.close()
    assert owners == {f"{INGRESS_ID}-0", f"{INGRESS_ID}-1"}

    # Whichever process a scrape reaches, it counts the requests of both.
    for _ in range(6):
        assert await _completed_count(fleet.base_url) == sent

    # The files the counts came from (the supervisor removes them at exit; killed, it leaves them).
    metrics_dir = Path(processes[0].environ()[METRICS_DIR_ENV])
    assert list(metrics_dir.glob("*.db"))

    # One process dies: the other serves on, and the dead one is started again under its id.
    victim, survivor = processes
    victim_id = _ingress_id(victim)
    victim.kill()
    # Until its listening socket is closed with it: a connection the kernel queued on the dying socket is reset.
    # A zombie is not yet closed: the group leader turns zombie while its other threads still exit, holding the
    # socket; the supervisor reaps it once they all have.
    wait_for(lambda: not psutil.pid_exists(victim.pid), 10, "the killed ingress process reaped")
    await _complete_on_a_new_connection(fleet.base_url)
    restarted = wait_for(lambda: [p for p in _serving(fleet) if p.pid != survivor.pid and p.pid != victim.pid], 30,
                         "the killed ingress process restarted")
    assert _ingress_id(restarted[0]) == victim_id and not _ended(survivor)
    for _ in range(4):
        await _complete_on_a_new_connection(fleet.base_url)

    # The supervisor dies without a chance to stop them: they end all the same.
    assert fleet.ingress is not None
    processes = _serving(fleet)
    fleet.ingress.popen.kill()
    wait_for(lambda: all(_ended(process) for process in processes), 30, "the ingress processes to end")
    shutil.rmtree(metrics_dir)
