"""jffc_per_request waits for the busy node that caches a prompt (`Router.holds_for_cache`), on a real fleet.

Two sim workers of one slot each, 22 ms per generated token. A long
stream holds the node that has the system prompt cached; a request with
the same system prompt comes meanwhile. The other node is free but caches
nothing of it, so the request waits in the central queue and is served
on the caching node, from its cache, once the stream ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import msgspec
import nats
import pytest

from contracts import subjects
from contracts.messages import KvEvents
from launch.fleet import Fleet, with_overrides
from launch.launcher import wait_services_ready
from shared.kv.block_hash import chained_block_hashes
from shared.tokenizer import SimTokenizer
from tests.integration.conftest import MODEL, client_of, launch, stop_and_check
from tests.waiting import until

pytestmark = pytest.mark.integration

SYSTEM = "a long shared system prompt that fills several kv blocks " * 6


@pytest.fixture(scope="module")
def two_one_slot_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    def tune(config):
        return with_overrides(config, **{"balancer": {"policy": "jffc_per_request"}, "balancer.slots": {"max_per_chain": 1}})

    fleet = launch(tmp_path_factory.mktemp("cache-hold"), workers=2, tune=tune, speed=0.1)
    wait_services_ready(fleet.balancers)
    yield fleet
    stop_and_check(fleet)


async def test_a_request_waits_for_the_busy_node_caching_its_prompt_instead_of_prefilling_it_on_a_free_one(
    two_one_slot_nodes: Fleet,
) -> None:
    fleet = two_one_slot_nodes
    client = client_of(fleet)
    system_blocks = chained_block_hashes(SimTokenizer().encode(SYSTEM), fleet.config.worker.sim.block_size)
    assert len(system_blocks) >= 3
    stored: dict[str, set[int]] = {}
    decoder = msgspec.msgpack.Decoder(KvEvents)

    async def on_events(msg) -> None:
        events = decoder.decode(msg.data)
        stored.setdefault(events.worker_id, set()).update(events.stored)

    nc = await nats.connect(fleet.config.nats.url)
    await nc.subscribe(subjects.KV_EVENTS_ALL, cb=on_events)
    await nc.flush()
    try:
        # About 1.3 s of tokens: the node stays busy for less than the 2 s a request may wait for it.
        stream = await client.completions.create(model=MODEL, prompt=SYSTEM + "first question", max_tokens=60, stream=True)
        chunks = aiter(stream)
        await anext(chunks)
        # The balancer hears the same KV events, before the request below (one NATS connection delivers in order).
        await until(lambda: any(set(system_blocks) <= hashes for hashes in stored.values()), 10.0,
                    "the system prompt's blocks stored on a node")

        async def drain() -> float:
            async for _ in chunks:
                pass
            return time.monotonic()

        streamed = asyncio.create_task(drain())
        reply = await client.completions.create(model=MODEL, prompt=SYSTEM + "second question", max_tokens=2)
        answered_at = time.monotonic()
        stream_ended_at = await streamed
    finally:
        await nc.close()
    cached = reply.usage.prompt_tokens_details.cached_tokens if reply.usage.prompt_tokens_details else 0
    # Served from the cache of the node the stream held, so only after the stream ended.
    assert cached >= len(system_blocks) * fleet.config.worker.sim.block_size, reply.usage
    assert answered_at >= stream_ended_at, (answered_at, stream_ended_at)
