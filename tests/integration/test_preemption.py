"""Preemption end to end: a high-priority request takes a full node's KV blocks from a
low-value running one, which is resumed later and still completes token for token."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import nats
import openai
import pytest
import redis.asyncio as redis

from contracts import subjects
from contracts.cache import AllocateRequest, Allocation, CacheReply, CacheStatus, CacheStatusRequest
from contracts.messages import AbortRequest
from launch.launcher import Launcher, free_port
from services.cache_manager.metrics import CacheMetrics
from services.cache_manager.service import CacheManagerService
from shared.kv.block_ledger import BlockLedger
from shared.cluster import ClusterView
from shared.config import CacheManagerSettings
from tests.integration.conftest import MODEL, launch
from tests.unit.balancer_fixtures import heartbeat
from tests.integration.test_faults import expected_text

pytestmark = pytest.mark.integration
LOW_TOKENS = 350


def tight_kv(config):
    # 48 blocks of 16 tokens: two long requests fill the node. Slots are
    # sized for tiny requests so that KV memory, not slots, is what runs out.
    return msgspec.structs.replace(
        config,
        cache_manager=msgspec.structs.replace(config.cache_manager, short_pool_share=0.0, prewarm=False),
        balancer=msgspec.structs.replace(
            config.balancer,
            slots=msgspec.structs.replace(config.balancer.slots, typical_prompt_tokens=16, typical_output_tokens=16),
        ),
    )


async def stream_text(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, seed: int, priority: int,
                      started: asyncio.Event | None = None) -> str:
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=seed, stream=True, extra_body={"priority": priority}
    )
    pieces = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            pieces.append(chunk.choices[0].text)
            if started is not None:
                started.set()
    return "".join(pieces)


async def test_high_priority_preempts_and_the_victim_still_completes_exactly(tmp_path: Path) -> None:
    fleet = launch(tmp_path, workers=1, tune=tight_kv, num_blocks=48, speed=0.5)
    try:
        client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        low_prompts = [f"a long low priority job number {i} with a prompt of some length" for i in range(2)]
        started = [asyncio.Event(), asyncio.Event()]
        # Each low request reserves ceil((13 + 350) / 16) = 23 of the 48 blocks.
        lows = [asyncio.create_task(stream_text(client, p, LOW_TOKENS, 7 + i, 0, started[i])) for i, p in enumerate(low_prompts)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        high_prompt = "an urgent high priority request"
        high = await asyncio.wait_for(stream_text(client, high_prompt, 50, 3, 5), 60)
        assert high == expected_text(high_prompt, 3, 50)
        low_texts = await asyncio.wait_for(asyncio.gather(*lows), 120)
        for i, text in enumerate(low_texts):
            assert text == expected_text(low_prompts[i], 7 + i, LOW_TOKENS), f"low request {i} lost or repeated tokens"
        nc = await nats.connect(fleet.config.nats.url)
        reply = msgspec.msgpack.decode(
            (await nc.request(subjects.CACHE_REQUEST, msgspec.msgpack.encode(CacheStatusRequest()), timeout=5)).data,
            type=CacheReply,
        )
        await nc.close()
        assert isinstance(reply, CacheStatus) and reply.preemptions >= 1
    finally:
        fleet.stop()


class RecordingBus:
    def __init__(self) -> None:
        self.published: list[tuple[str, object]] = []

    async def publish(self, subject: str, message: object, **_: object) -> None:
        self.published.append((subject, message))


class RacedLedger(BlockLedger):
    """A ledger where another replica acts right after this one first frees blocks (once armed)."""

    def __init__(self, client: redis.Redis, competitor: Callable[[], Awaitable[None]]) -> None:
        super().__init__(client, lease_ttl_s=60)
        self._competitor = competitor
        self._armed = False

    def arm(self) -> None:
        self._armed = True

    async def _after_freeing(self) -> None:
        if self._armed:
            self._armed = False
            await self._competitor()

    async def release(self, *args, **kwargs):
        freed = await super().release(*args, **kwargs)
        await self._after_freeing()
        return freed

    async def preempt(self, *args, **kwargs):
        preemption = await super().preempt(*args, **kwargs)
        await self._after_freeing()
        return preemption


@pytest.fixture
async def redis_client(tmp_path: Path):
    launcher = Launcher(tmp_path)
    port = free_port()
    launcher.start_redis(port)
    client = redis.Redis(port=port)
    try:
        yield client
    finally:
        await client.aclose()
        launcher.stop_all()


async def test_another_replica_cannot_take_the_room_a_preemption_makes(redis_client: redis.Redis) -> None:
    """The victims' release and the newcomer's reservation are one step: a competitor between them finds no room,
    so no victim is aborted without the newcomer getting its blocks."""
    competitor = BlockLedger(redis_client, lease_ttl_s=60)
    competitor_got: list[bool] = []

    async def compete() -> None:
        taken = await competitor.reserve("other-replica", "w0", 24, "general", 48, 0, 1.0, 10)
        competitor_got.append(taken.granted)

    ledger = RacedLedger(redis_client, compete)
    for low in ("low-1", "low-2"):  # 24 + 24 of the node's 48 blocks
        assert (await ledger.reserve(low, "w0", 24, "general", 48, 0, 1.0, 350)).granted
    ledger.arm()
    view = ClusterView(ttl_s=10)
    view.observe(heartbeat("w0", model=MODEL, blocks=48), 100.0)
    bus = RecordingBus()
    settings = CacheManagerSettings(short_pool_share=0.0, prewarm=False)
    service = CacheManagerService(settings, bus, view, ledger, CacheMetrics(), "cm-test", clock=lambda: 100.0)  # type: ignore[arg-type]

    # 20 prompt blocks and 4 of output: 24 blocks, the room of one victim.
    allocation = await service.allocate(AllocateRequest("urgent", MODEL, 320, 64, priority=3.0, worker_id="w0"))

    assert isinstance(allocation, Allocation) and allocation.blocks == 24 and len(allocation.preempted) == 1
    aborted = [m.request_id for _, m in bus.published if isinstance(m, AbortRequest)]
    assert aborted == allocation.preempted
    assert competitor_got == [False]
    assert (await ledger.usage(["w0"]))["w0"] == (48, 0, 2)
