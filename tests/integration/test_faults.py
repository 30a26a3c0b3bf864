"""Faults under steady load: every request completes or fails explicitly, none is lost.

Each test prints a line per fault (sent / completed / failed / lost /
recovery time) that the closing notes quote; run with `-s` to see them.
The sim engine's tokens are a function of (seed, prompt, position), so the
text a client receives can be checked token for token against what an
uninterrupted run produces: a gap or a duplicate at a migration shows.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import openai
import pytest
import redis.asyncio as redis

from contracts import subjects
from kvlane.fleet import Fleet
from services.worker.sim.tokens import prompt_digest, stream_key, token_at
from shared.tokenizer import OUTPUT_FIRST, OUTPUT_WORDS, SimTokenizer
from kvlane.launcher import wait_services_ready
from tests.integration.conftest import FAST_HEARTBEATS, MODEL, launch
from tests.integration.finished_log import watch_finished

pytestmark = pytest.mark.integration
TOKENIZER = SimTokenizer()


def expected_text(prompt: str, seed: int, max_tokens: int) -> str:
    key = stream_key(seed, prompt_digest(TOKENIZER.encode(prompt)))
    return TOKENIZER.decode([token_at(key, k, OUTPUT_FIRST, OUTPUT_WORDS) for k in range(max_tokens)])


@dataclass
class LoadResult:
    sent: int = 0
    completed: int = 0
    failed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.sent - self.completed - len(self.failed)

    def report(self, fault: str, recovery_s: float | None) -> str:
        recovery = "n/a" if recovery_s is None else f"{recovery_s:.2f}s"
        return (f"FAULT {fault}: sent={self.sent} completed={self.completed} failed={len(self.failed)} "
                f"lost={self.lost} recovery={recovery}")


async def one_stream(client: openai.AsyncOpenAI, index: int, max_tokens: int, result: LoadResult) -> None:
    prompt = f"steady load request number {index}"
    seed = 1000 + index
    result.sent += 1
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=seed, stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
    except openai.APIError as exc:
        result.failed.append(f"{type(exc).__name__}: {exc}")
        return
    result.completed += 1
    if text != expected_text(prompt, seed, max_tokens):
        result.wrong.append(prompt)


async def steady_load(fleet: Fleet, stop: asyncio.Event, result: LoadResult, concurrency: int, max_tokens: int) -> None:
    client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    counter = iter(range(1_000_000))

    async def lane() -> None:
        while not stop.is_set():
            await one_stream(client, next(counter), max_tokens, result)

    await asyncio.gather(*(lane() for _ in range(concurrency)))


async def wait_until_async(read, wanted: set, timeout: float) -> float:
    started = time.monotonic()
    while await read() not in wanted:
        assert time.monotonic() - started < timeout, f"state not in {wanted} within {timeout}s"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def wait_until(predicate, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "condition not reached in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture
def fleet3(tmp_path: Path):
    fleet = launch(tmp_path, workers=3)
    yield fleet
    fleet.stop()


async def test_sigkill_mid_stream_migrates_without_gaps_or_duplicates(fleet3: Fleet) -> None:
    result, stop = LoadResult(), asyncio.Event()
    load = asyncio.create_task(steady_load(fleet3, stop, result, concurrency=8, max_tokens=300))
    await asyncio.sleep(1.5)
    victim = next(p for p in fleet3.workers if p.name == "worker-w0")
    victim.signal(signal.SIGKILL)
    killed = time.monotonic()
    completed_at_kill = result.completed
    # Recovery: requests keep completing after the kill.
    recovery = await wait_until(lambda: result.completed >= completed_at_kill + 8, 30)
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.wait_for(load, 60)
    print(result.report("worker SIGKILL mid-stream", recovery))
    assert result.lost == 0 and not result.failed, result.failed[:3]
    assert not result.wrong, f"streams with gaps or duplicates: {result.wrong[:3]}"
    assert time.monotonic() - killed < 60
    assert result.completed > completed_at_kill


async def test_nats_restart_under_load(fleet3: Fleet) -> None:
    result, stop = LoadResult(), asyncio.Event()
    load = asyncio.create_task(steady_load(fleet3, stop, result, concurrency=4, max_tokens=40))
    await asyncio.sleep(1.0)
    nats_server = next(p for p in fleet3.launcher.processes if p.name == "nats-server")
    nats_server.stop()
    port = int(fleet3.config.nats.url.rsplit(":", 1)[1])
    fleet3.launcher.start_nats(port)
    restarted = time.monotonic()
    completed = result.completed
    recovery = await wait_until(lambda: result.completed >= completed + 4, 30)
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.wait_for(load, 60)
    print(result.report("nats-server restart", recovery))
    assert result.lost == 0
    assert not result.wrong
    assert time.monotonic() - restarted < 60
    assert all(p.alive() for p in fleet3.services())


async def test_redis_restart_under_load(fleet3: Fleet) -> None:
    result, stop = LoadResult(), asyncio.Event()
    load = asyncio.create_task(steady_load(fleet3, stop, result, concurrency=4, max_tokens=40))
    await asyncio.sleep(1.0)
    redis_server = next(p for p in fleet3.launcher.processes if p.name == "redis-server")
    redis_server.stop()
    port = int(fleet3.config.redis.url.rsplit(":", 1)[1].split("/")[0])
    await asyncio.sleep(FAST_HEARTBEATS["heartbeat_ttl_s"])
    fleet3.launcher.start_redis(port)
    completed = result.completed
    recovery = await wait_until(lambda: result.completed >= completed + 4, 30)
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.wait_for(load, 60)
    print(result.report("redis-server restart", recovery))
    assert result.lost == 0 and not result.failed, result.failed[:3]
    assert not result.wrong
    assert all(p.alive() for p in fleet3.services())


def fast_probes(config):
    return msgspec.structs.replace(
        config,
        health=msgspec.structs.replace(
            config.health, probe_interval_s=0.4, probe_timeout_s=0.4, good_probes_to_recover=3, feedback_window_s=5.0,
            # A probe that waits out most of a 0.4 s pause counts as slow even on a loaded machine.
            slow_factor=3.0, slow_floor_s=0.1,
        ),
    )


async def health_state(fleet: Fleet, worker_id: str) -> str | None:
    client = redis.Redis.from_url(fleet.config.redis.url)
    try:
        raw = await client.get(subjects.health_key(worker_id))
    finally:
        await client.aclose()
    return None if raw is None else msgspec.json.decode(raw)["state"]


async def test_slow_node_is_marked_and_avoided_then_comes_back(tmp_path: Path) -> None:
    """A node that keeps heartbeating but crawls (stopped 80% of the time) loses its traffic, then regains it."""
    fleet = launch(tmp_path, workers=3, tune=fast_probes)
    try:
        async for _, finished in watch_finished(fleet):
            result, stop = LoadResult(), asyncio.Event()
            load = asyncio.create_task(steady_load(fleet, stop, result, concurrency=6, max_tokens=30))
            await asyncio.sleep(1.0)
            victim = next(p for p in fleet.workers if p.name == "worker-w0")
            crawling = asyncio.Event()

            async def crawl() -> None:
                while not crawling.is_set():
                    victim.signal(signal.SIGSTOP)
                    await asyncio.sleep(0.4)
                    victim.signal(signal.SIGCONT)
                    await asyncio.sleep(0.1)

            crawler = asyncio.create_task(crawl())
            slowed = time.monotonic()
            marked = await wait_until_async(lambda: health_state(fleet, "w0"), {"suspect", "unhealthy"}, 30)
            finished.events.clear()
            await asyncio.sleep(3.0)
            share_while_slow = finished.share("w0")
            crawling.set()
            await crawler
            victim.signal(signal.SIGCONT)
            back = await wait_until_async(lambda: health_state(fleet, "w0"), {"healthy"}, 20)
            finished.events.clear()
            # It may have been measured slow while it crawled; idle, that estimate drifts back to its
            # peers' heartbeat by heartbeat (SpeedTracker._relax_idle), and then it shares the load
            # again. So its return is waited for, within a bound, not sampled in a fixed window.
            try:
                regained = await wait_until(lambda: finished.workers()["w0"] >= 10, 20)
            except AssertionError:
                regained = None
            share_after = finished.share("w0")
            stop.set()
            await asyncio.wait_for(load, 60)
            print(result.report("worker SIGSTOP (crawling node)", marked) + f" marked_after={marked:.2f}s "
                  f"share_while_slow={share_while_slow:.2f} recovered_after={back:.2f}s "
                  f"regained_after={'never' if regained is None else f'{regained:.2f}s'} "
                  f"share_after={share_after:.2f}")
            assert result.lost == 0 and not result.failed, result.failed[:3]
            assert not result.wrong
            assert share_while_slow < 0.1, "traffic still flows to the crawling node"
            assert regained is not None, "the recovered node got no traffic back within 20 s"
            assert time.monotonic() - slowed < 90
    finally:
        fleet.stop()


async def test_sigterm_each_service_in_turn_loses_nothing(tmp_path: Path) -> None:
    fleet = launch(tmp_path, workers=3)
    try:
        wait_services_ready([fleet.add_balancer(), fleet.add_cache_manager()])
        result, stop = LoadResult(), asyncio.Event()
        load = asyncio.create_task(steady_load(fleet, stop, result, concurrency=4, max_tokens=60))
        await asyncio.sleep(1.0)
        exits = []
        for process in (fleet.balancers[0], fleet.cache_managers[0], fleet.health_probers[0],
                        next(p for p in fleet.workers if p.name == "worker-w0")):
            completed = result.completed
            process.signal(signal.SIGTERM)
            code = await asyncio.to_thread(process.wait_exit, 30)
            assert code == 0, process.log_tail()
            recovery = await wait_until(lambda c=completed: result.completed >= c + 4, 30)
            exits.append(f"{process.name}: exit {code}, +4 completions {recovery:.2f}s later")
        stop.set()
        await asyncio.wait_for(load, 60)
        print(result.report("SIGTERM balancer, cache-manager, health-prober, worker in turn", None) + "; " + "; ".join(exits))
        assert result.lost == 0 and not result.failed, result.failed[:3]
        assert not result.wrong
        # Last the ingress, with streams in flight: they finish, then it exits.
        client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        tail = LoadResult()
        streams = [asyncio.create_task(one_stream(client, 10_000 + i, 200, tail)) for i in range(4)]
        await asyncio.sleep(0.5)
        fleet.ingress.signal(signal.SIGTERM)
        await asyncio.gather(*streams)
        code = await asyncio.to_thread(fleet.ingress.wait_exit, 30)
        print(tail.report(f"SIGTERM ingress (exit {code})", None))
        assert code == 0, fleet.ingress.log_tail()
        assert tail.completed == 4 and not tail.wrong
    finally:
        fleet.stop()
