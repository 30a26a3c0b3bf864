"""Preemption end to end: a high-priority request takes a full node's KV blocks from a
low-value running one, which is resumed later and still completes token for token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from contracts import subjects
from contracts.cache import CacheReply, CacheStatus, CacheStatusRequest
from tests.integration.conftest import MODEL, launch
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
