"""Prefill/decode disaggregation on the sim engine, through the whole system.

A fleet of prefill and decode workers behind real ingress, balancer,
cache-manager, NATS and Redis. The sim engine's tokens are a function of
(seed, prompt, position), so every response is checked token for token
against what one aggregated node produces for the same prompt.

Failures are injected with SIGKILL (and SIGSTOP to hold a node still) at
moments the test sees on the bus: a `PrefillRequest` reaching a prefill
node, a `GenerateRequest` carrying a `KvRef` reaching a decode node, the
`Handoff` frame. Each ends in a complete, correct response.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from contracts import subjects
from contracts.balancer import BalancerStatus, BalancerStatusRequest
from contracts.messages import (
    GenerateRequest,
    Handoff,
    PrefillRequest,
    StreamMessage,
    TokenChunk,
    WorkerRequest,
)
from launch.fleet import Fleet, with_overrides
from shared.kv.block_hash import chained_block_hashes
from shared.bus import addressed_frames
from shared.tokenizer import SimTokenizer
from tests.integration.conftest import MODEL, launch, until_status
from tests.integration.test_faults import expected_text
from tests.heartbeats import fresh_stats, heartbeat_of, stats_of

pytestmark = pytest.mark.integration

# 160 prompt tokens: remote with the threshold below; "short" prompts are 1-4 tokens.
LONG = "hello world " * 80
THRESHOLD = 64


def disaggregated(cluster: dict | None = None, **worker: object) -> Callable:
    def tune(config):
        config = with_overrides(config, **{"balancer.disaggregation": {"min_remote_prefill_tokens": THRESHOLD}})
        config = with_overrides(config, cluster=cluster) if cluster else config
        return with_overrides(config, worker=worker) if worker else config

    return tune


async def complete(fleet: Fleet, prompt: str, seed: int, max_tokens: int = 12) -> str:
    client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=seed, stream=True)
    return "".join([c.choices[0].text async for c in stream if c.choices])


class BusWatch:
    """Calls `on(message)` for worker requests and stream frames as they cross NATS."""

    def __init__(self, fleet: Fleet) -> None:
        self._url = fleet.config.nats.url
        self._nc: nats.NATS | None = None
        self.seen: list[object] = []
        self.on: Callable[[str, object], None] = lambda subject, message: None

    async def __aenter__(self) -> BusWatch:
        self._nc = await nats.connect(self._url)
        requests = msgspec.msgpack.Decoder(WorkerRequest)
        frames = msgspec.msgpack.Decoder(StreamMessage)

        async def on_request(msg) -> None:
            self._record(msg.subject, requests.decode(msg.data))

        async def on_frame(msg) -> None:
            for _, frame in addressed_frames(msg.subject, frames.decode(msg.data)):
                self._record(msg.subject, frame)

        await self._nc.subscribe(f"{subjects.PREFIX}.worker.*.generate", cb=on_request)
        await self._nc.subscribe(f"{subjects.PREFIX}.stream.>", cb=on_frame)
        await self._nc.flush()
        return self

    def _record(self, subject: str, message: object) -> None:
        self.seen.append(message)
        self.on(subject, message)

    async def __aexit__(self, *exc: object) -> None:
        assert self._nc is not None
        await self._nc.close()


def worker_of(subject: str) -> str:
    return subject.split(".")[3]


def process(fleet: Fleet, worker_id: str):
    return next(p for p in fleet.workers if p.name == f"worker-{worker_id}")


# --- the flow -------------------------------------------------------------------


@pytest.fixture(scope="module")
def pd_fleet(tmp_path_factory: pytest.TempPathFactory):
    fleet = launch(tmp_path_factory.mktemp("pd"), workers=0, prefill_workers=1, decode_workers=1, tune=disaggregated())
    yield fleet
    fleet.stop()


async def test_long_prompts_go_through_the_prefill_node_and_match_aggregated_output(pd_fleet: Fleet) -> None:
    before = await stats_of(pd_fleet, "d0")
    async with BusWatch(pd_fleet) as watch:
        texts = [await complete(pd_fleet, f"number {i} {LONG}", seed=i) for i in range(3)]
    assert texts == [expected_text(f"number {i} {LONG}", i, 12) for i in range(3)]
    prefills = [m for m in watch.seen if isinstance(m, PrefillRequest)]
    handoffs = [m for m in watch.seen if isinstance(m, Handoff)]
    assert len(prefills) == 3 and len(handoffs) == 3
    assert {(h.prefill_worker_id, h.decode_worker_id) for h in handoffs} == {("p0", "d0")}
    after = await fresh_stats(pd_fleet, "d0")
    assert after.kv_pulls - before.kv_pulls == 3
    # 161+ tokens of the tiny model's 1 KiB per token moved by reference.
    assert after.kv_pull_bytes - before.kv_pull_bytes >= 3 * 160 * 1024
    assert after.kv_pull_failures == 0
    # Unique prompts: nothing was a cache hit anywhere, however the KV travelled.
    client = openai.AsyncOpenAI(base_url=f"{pd_fleet.base_url}/v1", api_key="unused", max_retries=0)
    response = await client.completions.create(model=MODEL, prompt=f"number 9 {LONG}", max_tokens=4)
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    # The decode node released what it pulled: nothing stays held on the prefill node.
    assert (await fresh_stats(pd_fleet, "p0")).kv_held_blocks == 0


async def test_short_prompts_are_prefilled_on_the_decode_node(pd_fleet: Fleet) -> None:
    before = await stats_of(pd_fleet, "d0")
    async with BusWatch(pd_fleet) as watch:
        texts = [await complete(pd_fleet, f"short {i}", seed=i) for i in range(3)]
    assert texts == [expected_text(f"short {i}", i, 12) for i in range(3)]
    assert not [m for m in watch.seen if isinstance(m, PrefillRequest | Handoff)]
    # Health probes (one token, straight to each node) may pass meanwhile: only the clients' requests count.
    generates = [m for m in watch.seen if isinstance(m, GenerateRequest) and not m.request_id.startswith("probe-")]
    assert len(generates) == 3 and all(g.kv_ref is None for g in generates)
    assert (await fresh_stats(pd_fleet, "d0")).kv_pulls == before.kv_pulls


async def test_a_cached_long_prompt_stays_on_the_decode_node(pd_fleet: Fleet) -> None:
    """Conditional disaggregation counts the uncached part: a repeat of a prompt the decode node holds runs locally."""
    prompt = f"{LONG} repeated"
    await complete(pd_fleet, prompt, seed=7)  # remote: the decode node now holds the prompt's blocks
    block_size = (await heartbeat_of(pd_fleet.config.redis.url, "d0")).registration.block_size
    hashes = chained_block_hashes(SimTokenizer().encode(prompt), block_size)
    assert len(hashes) >= 2

    def d0_holds_the_prompt(status: BalancerStatus) -> bool:
        return any(c.worker_id == "d0" and c.cached_blocks == len(hashes) for c in status.chains)

    # Until the KV events reach the balancer's prefix index.
    await until_status(pd_fleet, d0_holds_the_prompt, query=BalancerStatusRequest(block_hashes=hashes))
    async with BusWatch(pd_fleet) as watch:
        assert await complete(pd_fleet, prompt, seed=7) == expected_text(prompt, 7, 12)
    assert not [m for m in watch.seen if isinstance(m, PrefillRequest)]


async def test_bad_requests_on_a_disaggregated_fleet_get_clear_errors(pd_fleet: Fleet) -> None:
    client = openai.AsyncOpenAI(base_url=f"{pd_fleet.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="context length"):
        await client.completions.create(model=MODEL, prompt=LONG, max_tokens=5000)
    # The fleet still serves.
    assert await complete(pd_fleet, LONG, seed=1) == expected_text(LONG, 1, 12)


# --- failures -------------------------------------------------------------------

# Slow enough to act in the middle: a 160-token prefill takes ~1.6 s at speed 0.01 (tiny-cpu).
SLOW = {"speed": 0.01}


async def test_prefill_node_killed_mid_prefill_retries_on_another_chain(tmp_path: Path) -> None:
    fleet = launch(tmp_path, workers=0, prefill_workers=2, decode_workers=1, tune=disaggregated(), **SLOW)
    try:
        async with BusWatch(fleet) as watch:
            killed: list[str] = []

            def on(subject: str, message: object) -> None:
                if isinstance(message, PrefillRequest) and not killed:
                    killed.append(worker_of(subject))
                    process(fleet, killed[0]).signal(signal.SIGKILL)

            watch.on = on
            started = time.monotonic()
            text = await complete(fleet, LONG, seed=3, max_tokens=4)
        assert text == expected_text(LONG, 3, 4)
        handoffs = [m for m in watch.seen if isinstance(m, Handoff)]
        assert killed and [h.prefill_worker_id for h in handoffs] == [next(p for p in ("p0", "p1") if p != killed[0])]
        print(f"FAULT prefill node SIGKILL mid-prefill: completed in {time.monotonic() - started:.2f}s")
    finally:
        fleet.stop()


async def test_decode_node_killed_mid_stream_resumes_on_another_decode_node(tmp_path: Path) -> None:
    fleet = launch(tmp_path, workers=0, prefill_workers=1, decode_workers=2, tune=disaggregated(), speed=0.2)
    try:
        async with BusWatch(fleet) as watch:
            killed: list[str] = []
            tokens_seen = [0]

            def on(subject: str, message: object) -> None:
                if isinstance(message, Handoff):
                    killed.append(message.decode_worker_id)
                elif isinstance(message, TokenChunk) and killed and tokens_seen[0] < 5:
                    # A frame heard late carries several steps' tokens: 200 leave room for the lag.
                    tokens_seen[0] += len(message.token_ids)
                    if tokens_seen[0] >= 5:
                        process(fleet, killed[0]).signal(signal.SIGKILL)

            watch.on = on
            text = await complete(fleet, LONG, seed=4, max_tokens=200)
        assert tokens_seen[0] >= 5, "the decode node was not killed mid-stream"
        assert text == expected_text(LONG, 4, 200), "the resumed stream has a gap or a duplicate"
        # The resumed run goes through the prefill node again, to the surviving decode node.
        assert [h.decode_worker_id for h in watch.seen if isinstance(h, Handoff)][1:] == [{"d0": "d1", "d1": "d0"}[killed[0]]]
        resumed = [m for m in watch.seen if isinstance(m, GenerateRequest | PrefillRequest) and m.resume_token_ids]
        assert resumed, "the request was not resumed"
    finally:
        fleet.stop()


async def test_failed_pull_is_retried_then_prefilled_locally(tmp_path: Path) -> None:
    """The prefill node dies after handing over and before the decode node pulls.

    Heartbeats live 5 s here, so that ingress does not notice the dead
    prefill node first and move the request itself (which would also end
    well, but not on the path under test).
    """
    fleet = launch(tmp_path, workers=0, prefill_workers=1, decode_workers=1,
                   tune=disaggregated(cluster={"heartbeat_ttl_s": 5.0}, handoff_timeout_s=10.0), speed=0.02)
    try:
        before = await stats_of(fleet, "d0")
        decode = process(fleet, "d0")
        async with BusWatch(fleet) as watch:

            def on(subject: str, message: object) -> None:
                if isinstance(message, PrefillRequest):
                    decode.signal(signal.SIGSTOP)  # the hand-off waits in its inbox
                elif isinstance(message, GenerateRequest) and message.kv_ref is not None:
                    process(fleet, "p0").signal(signal.SIGKILL)
                    # Woken once the prefill node's connection is surely gone.
                    asyncio.get_running_loop().call_later(0.3, decode.signal, signal.SIGCONT)

            watch.on = on
            text = await complete(fleet, LONG, seed=5, max_tokens=4)
        assert text == expected_text(LONG, 5, 4)
        after = await fresh_stats(fleet, "d0")
        assert after.kv_pull_failures - before.kv_pull_failures == 2, "one pull and one retry, both failed"
        assert after.kv_pulls == before.kv_pulls
    finally:
        fleet.stop()


async def test_kv_nobody_pulls_is_freed_by_the_hold_timeout(tmp_path: Path) -> None:
    """The decode node dies mid-transfer: the prefill node's blocks stay stranded until the hold timeout.

    The request itself resumes on an aggregated node started at the kill, so
    the prefill node sees nothing more of it.
    """
    fleet = launch(tmp_path, workers=0, prefill_workers=1, decode_workers=1,
                   tune=disaggregated(kv_hold_timeout_s=8.0), speed=0.2, kv_link="ethernet-25g",
                   profile="a100-80g-llama3-70b-tp4")
    try:
        async with BusWatch(fleet) as watch:

            def on(subject: str, message: object) -> None:
                # 160 tokens of 320 KiB over 25 GbE at speed 0.2: ~80 ms of transfer.
                if isinstance(message, Handoff) and len(fleet.workers) == 2:
                    process(fleet, message.decode_worker_id).signal(signal.SIGKILL)
                    fleet.add_worker("w9")

            watch.on = on
            text = await complete(fleet, LONG, seed=6, max_tokens=4)
            released_by = time.monotonic() + 8.0
        assert text == expected_text(LONG, 6, 4)
        held = (await fresh_stats(fleet, "p0")).kv_held_blocks
        assert held > 0, "the blocks were freed before the hold timeout"
        while (await fresh_stats(fleet, "p0")).kv_held_blocks:
            assert time.monotonic() < released_by + 3.0, "stranded blocks outlived the hold timeout"
        print(f"FAULT decode node SIGKILL before release: {held} blocks stranded, freed by the hold timeout")
    finally:
        fleet.stop()


async def test_status_lists_both_pools_and_only_decode_nodes_hold_slots(pd_fleet: Fleet) -> None:
    from kvlane.status import fetch_statuses

    [status] = await fetch_statuses(pd_fleet.config.nats.url, MODEL, 5.0)
    roles = {c.worker_id: (c.role, c.slots_total) for c in status.chains}
    assert roles["p0"] == ("prefill", 0)
    assert roles["d0"][0] == "decode" and roles["d0"][1] > 0
