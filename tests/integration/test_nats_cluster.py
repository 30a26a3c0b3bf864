"""A fleet on a three-node NATS cluster: one server dies under streaming load.

Every service connects with all three URLs. The test SIGKILLs the server the
ingress is connected to while 60 streams run: each stream must complete with
exactly the text an uninterrupted run produces, or fail with an explicit
error, within a bound; none may be left hanging. Run with `-s` for the counts.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import openai
import pytest

from launch.fleet import Fleet, start_fleet
from launch.launcher import Launcher, free_port
from launch.nats_cluster import NatsNode, connected_node
from services.worker.sim.tokens import prompt_digest, stream_key, token_at
from shared.tokenizer import OUTPUT_FIRST, OUTPUT_WORDS, SimTokenizer
from tests.integration.conftest import MODEL, fleet_config

pytestmark = pytest.mark.integration
TOKENIZER = SimTokenizer()
STREAMS = 60
MAX_TOKENS = 200
# Each stream's outcome must be known within this long of its start, or it counts as lost.
OUTCOME_BOUND_S = 120.0
INGRESS_CONNECTION = "kvlane-ingress-"


def expected_text(prompt: str, seed: int) -> str:
    key = stream_key(seed, prompt_digest(TOKENIZER.encode(prompt)))
    return TOKENIZER.decode([token_at(key, k, OUTPUT_FIRST, OUTPUT_WORDS) for k in range(MAX_TOKENS)])


@dataclass
class Outcomes:
    started: set[int] = field(default_factory=set)
    completed: int = 0
    failed: list[str] = field(default_factory=list)
    wrong: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    # When each stream got its outcome (monotonic seconds).
    ended: list[float] = field(default_factory=list)

    def line(self, fault: str, sent: int) -> str:
        return (f"FAULT {fault}: sent={sent} completed={self.completed} failed={len(self.failed)} "
                f"lost={len(self.lost)} wrong={len(self.wrong)}")


async def one_stream(client: openai.AsyncOpenAI, index: int, outcomes: Outcomes, first_frames: asyncio.Event) -> None:
    prompt, seed = f"cluster fault stream number {index}", 5000 + index
    try:
        await _one_stream(client, index, prompt, seed, outcomes, first_frames)
    finally:
        outcomes.ended.append(time.monotonic())
        outcomes.started.add(index)  # one that ended before its first tokens is not waited for
        if len(outcomes.started) == STREAMS:
            first_frames.set()


async def _one_stream(
    client: openai.AsyncOpenAI, index: int, prompt: str, seed: int, outcomes: Outcomes, first_frames: asyncio.Event
) -> None:

    async def run() -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, seed=seed, stream=True)
        parts = []
        async for chunk in stream:
            if chunk.choices:
                outcomes.started.add(index)
                if len(outcomes.started) == STREAMS:
                    first_frames.set()
                parts.append(chunk.choices[0].text)
        return "".join(parts)

    try:
        async with asyncio.timeout(OUTCOME_BOUND_S):
            text = await run()
    except TimeoutError:
        outcomes.lost.append(index)
        return
    except openai.APIError as exc:  # an explicit failure: a status, or an error event in the stream
        outcomes.failed.append(f"{type(exc).__name__}: {exc}")
        return
    outcomes.completed += 1
    if text != expected_text(prompt, seed):
        outcomes.wrong.append(index)


@pytest.fixture
def cluster_fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Three sim workers and the services on a three-node NATS cluster, as `kvlane up --nats-cluster 3` starts them."""
    launcher = Launcher(tmp_path)
    redis_port = free_port()
    launcher.start_redis(redis_port)
    fleet = start_fleet(launcher, fleet_config(free_port(), redis_port), workers=3, nats_cluster=3)
    yield fleet
    fleet.stop()


async def first_success_after(client: openai.AsyncOpenAI, since: float) -> tuple[float, int]:
    """Seconds from `since` until a new request completes, and how many failed before it."""
    failed = 0
    while True:
        try:
            await client.completions.create(model=MODEL, prompt="recovery probe", max_tokens=4, timeout=30)
            return time.monotonic() - since, failed
        except openai.APIError:
            failed += 1
            assert time.monotonic() - since < OUTCOME_BOUND_S, "no new request completed after the fault"


async def migrations(fleet: Fleet) -> dict[str, float]:
    """Streams the ingress resumed on a node, by cause (its /metrics)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> str:
        with urllib.request.urlopen(f"{fleet.base_url}/metrics", timeout=5) as response:
            return response.read().decode()

    resumed: dict[str, float] = {}
    for family in text_string_to_metric_families(await asyncio.to_thread(scrape)):
        if family.name == "kvlane_ingress_migrations":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    resumed[sample.labels["cause"]] = resumed.get(sample.labels["cause"], 0) + sample.value
    return resumed


def reconnected_after(fleet: Fleet, since_wall: float) -> float:
    """Seconds from `since_wall` (epoch) to the ingress's first NATS reconnect after it (its log)."""
    assert fleet.ingress is not None
    for line in fleet.ingress.log_path.read_text().splitlines():
        if '"nats_reconnected"' in line:
            at = datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp()
            if at >= since_wall:
                return at - since_wall
    raise AssertionError("the ingress logged no reconnect after the fault")


def ingress_server(fleet: Fleet) -> NatsNode:
    node = connected_node(fleet.nats_nodes, INGRESS_CONNECTION)
    assert node is not None, "the ingress is connected to none of the cluster's servers"
    return node


async def test_a_nats_server_killed_under_streaming_load_loses_no_request(cluster_fleet: Fleet) -> None:
    fleet = cluster_fleet
    assert len(fleet.nats_nodes) == 3 and len(fleet.config.nats.servers()) == 3
    client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=OUTCOME_BOUND_S)
    outcomes, streaming = Outcomes(), asyncio.Event()
    streams = [asyncio.create_task(one_stream(client, index, outcomes, streaming)) for index in range(STREAMS)]
    async with asyncio.timeout(60):
        await streaming.wait()  # every stream has had its first tokens (the first may have ended already)
    mid_stream = STREAMS - len(outcomes.ended)
    assert mid_stream >= STREAMS // 2, f"only {mid_stream} streams still ran: the load is too short for the test"

    victim = ingress_server(fleet)
    assert victim.process is not None
    victim.process.signal(signal.SIGKILL)
    killed, killed_wall = time.monotonic(), time.time()
    # A new request sent at the fault (it queues behind the running streams as it would without one).
    probe = asyncio.create_task(first_success_after(client, killed))
    await asyncio.gather(*streams)
    settled_s = time.monotonic() - killed
    probe_s, probes_failed = await probe

    # The ingress moved to a surviving server, and new requests are served through it.
    async with asyncio.timeout(30):
        while (survivor := connected_node(fleet.nats_nodes, INGRESS_CONNECTION)) is None:
            await asyncio.sleep(0.1)
    assert survivor is not victim
    after = await client.completions.create(model=MODEL, prompt="after the fault", max_tokens=8)
    assert after.choices[0].text

    print(outcomes.line("NATS cluster node SIGKILL (the ingress's server), 3 nodes", STREAMS),
          f"mid_stream_at_kill={mid_stream} ingress_reconnected_after={reconnected_after(fleet, killed_wall):.2f}s "
          f"all_settled_after={settled_s:.2f}s new_request_done_after={probe_s:.2f}s probes_failed={probes_failed} "
          f"resumed={await migrations(fleet)}",
          outcomes.failed[:3])
    assert not outcomes.lost, f"streams without an outcome within {OUTCOME_BOUND_S}s: {outcomes.lost}"
    assert outcomes.completed + len(outcomes.failed) == STREAMS
    assert not outcomes.wrong, f"streams with gaps or duplicates: {outcomes.wrong[:5]}"
    assert all(p.alive() for p in fleet.services()), [p.name for p in fleet.services() if not p.alive()]
