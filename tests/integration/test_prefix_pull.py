"""Prefix pulls between kv_share workers on the sim engine, through the whole system.

Two aggregated kv_share workers of one slot each behind real ingress, balancer,
cache-manager, NATS and Redis. A prompt cached on one worker (the source)
that is busy runs on the other (the runner) with its prefix pulled: the
source runs a prefill-only request over the prefix (`PrefillRequest.prefix_tokens`),
hands the request to the runner with a `KvRef`, and the runner pulls it and
computes the rest. The sim engine's tokens are a function of (seed, prompt,
position), so every response is checked token for token; a SIGKILL of the
source in the middle of the pull must still end in complete, identical
responses for every request, the one the source was running included.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from contracts.balancer import BalancerStatus, BalancerStatusRequest
from contracts import subjects
from contracts.messages import (
    ErrorReply,
    GenerateAccepted,
    GenerateRequest,
    Handoff,
    PrefillRequest,
    SamplingParams,
    TokenChunk,
    WorkerReply,
)
from launch.fleet import Fleet, with_overrides
from shared.kv.block_hash import chained_block_hashes
from shared.tokenizer import SimTokenizer
from tests.heartbeats import fresh_stats, stats_of
from tests.integration.conftest import MODEL, client_of, launch, until_status
from tests.integration.test_disaggregated import BusWatch, complete, process, worker_of
from tests.integration.test_faults import expected_text

pytestmark = pytest.mark.integration

# About 1,000 tokens: computing them again costs the runner more than a pull over the link.
PREFIX = "hello world " * 500
BLOCK_SIZE = 16
# Long enough to be still running on the source when the pulled request is routed (and when the source dies).
BUSY_TOKENS = 300
# A client's wait for an answer: vLLM CPU engines sharing two cores take their time.
CLIENT_TIMEOUT_S = 120.0


def sharing(config):
    config = with_overrides(config, worker={"kv_share": True})
    # One slot each: a worker running one request is busy.
    return with_overrides(config, **{"balancer.slots": {"max_per_chain": 1}})


def token_ids(prompt: str | list[int]) -> list[int]:
    return SimTokenizer().encode(prompt) if isinstance(prompt, str) else prompt


async def cache_on_one_worker(fleet: Fleet, prompt: str | list[int], block_size: int = BLOCK_SIZE, timeout_s: float = 10.0,
                              model: str = MODEL, **create: object) -> str:
    """Run `prompt` once; the worker that ran it, once the balancer's index shows it cached there."""
    async with RoutedWatch(fleet) as watch:
        await client_of(fleet, CLIENT_TIMEOUT_S).completions.create(model=model, prompt=prompt, max_tokens=2, **create)
    source = next(worker_of(s) for s, m in clients_requests(watch) if isinstance(m, GenerateRequest))
    hashes = chained_block_hashes(token_ids(prompt), block_size)

    def cached(status: BalancerStatus) -> bool:
        return any(c.worker_id == source and c.cached_blocks == len(hashes) for c in status.chains)

    # Until the worker's KV events reach the balancer's prefix index.
    await until_status(fleet, cached, timeout_s=timeout_s, query=BalancerStatusRequest(block_hashes=hashes))
    return source


def clients_requests(watch: RoutedWatch) -> list[tuple[str, object]]:
    # Health probes (one token, straight to each node) may pass meanwhile.
    return [(s, m) for s, m in watch.routed if not getattr(m, "request_id", "").startswith("probe-")]


class RoutedWatch(BusWatch):
    """A `BusWatch` that also keeps the subject each message came on."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet)
        self.routed: list[tuple[str, object]] = []

    def _record(self, subject: str, message: object) -> None:
        self.routed.append((subject, message))
        super()._record(subject, message)


async def busy_source(fleet: Fleet, prompt: str | list[int], max_tokens: int, model: str = MODEL,
                      **create: object) -> asyncio.Task[str]:
    """A long streamed request on the source (`prompt` extends the prefix cached there), running once its first
    token came; the task ends with its text."""
    started = asyncio.Event()

    async def run() -> str:
        stream = await client_of(fleet, CLIENT_TIMEOUT_S).completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                                             stream=True, **create)
        text = []
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                started.set()
        return "".join(text)

    task = asyncio.create_task(run())
    started_or_failed = asyncio.create_task(started.wait())
    await asyncio.wait([task, started_or_failed], timeout=60, return_when=asyncio.FIRST_COMPLETED)
    started_or_failed.cancel()
    if task.done():
        task.result()  # its error, if it failed before its first token
    assert started.is_set(), "the busy request produced no token"
    return task


@pytest.fixture(scope="module")
def sharing_fleet(tmp_path_factory: pytest.TempPathFactory):
    fleet = launch(tmp_path_factory.mktemp("pull"), workers=2, tune=sharing, speed=0.3)
    yield fleet
    fleet.stop()


async def test_a_busy_sources_prefix_is_pulled_by_the_free_worker_and_the_output_is_identical(sharing_fleet: Fleet) -> None:
    fleet = sharing_fleet
    source = await cache_on_one_worker(fleet, PREFIX, seed=1)
    runner = next(w for w in ("w0", "w1") if w != source)
    before = await stats_of(fleet, runner)
    busy = await busy_source(fleet, f"{PREFIX} busy", BUSY_TOKENS, seed=2)
    prompt = f"{PREFIX} question"
    async with RoutedWatch(fleet) as watch:
        assert await complete(fleet, prompt, seed=3) == expected_text(prompt, 3, 12)
    assert await busy == expected_text(f"{PREFIX} busy", 2, BUSY_TOKENS)
    pulls = [(worker_of(s), m) for s, m in clients_requests(watch) if isinstance(m, PrefillRequest)]
    assert len(pulls) == 1, pulls
    on, exposure = pulls[0]
    # The source runs only the prefix it caches (whole blocks, less than the prompt); the runner the rest.
    assert on == source and exposure.decode_worker_id == runner
    assert 0 < exposure.prefix_tokens < len(SimTokenizer().encode(prompt)) and exposure.prefix_tokens % BLOCK_SIZE == 0
    assert [(h.prefill_worker_id, h.decode_worker_id) for h in watch.seen if isinstance(h, Handoff)] == [(source, runner)]
    after = await fresh_stats(fleet, runner)
    assert after.kv_pulls - before.kv_pulls == 1 and after.kv_pull_failures == before.kv_pull_failures
    # Only the prefix crossed (the tiny model's 1 KiB per token), not the whole prompt.
    assert after.kv_pull_bytes - before.kv_pull_bytes == exposure.prefix_tokens * 1024
    # The runner reports the pulled prefix as external hits, and hit those blocks: it computed only the rest.
    assert after.prefix_external_hit_tokens - before.prefix_external_hit_tokens == exposure.prefix_tokens
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= exposure.prefix_tokens - BLOCK_SIZE
    # And the source holds nothing once the runner has pulled.
    assert (await fresh_stats(fleet, source)).kv_held_blocks == 0


async def test_a_bad_prefix_request_on_the_bus_gets_an_error_reply_and_the_worker_keeps_serving(sharing_fleet: Fleet) -> None:
    """A `PrefillRequest` whose `prefix_tokens` is negative is refused (400) by the worker's decoder; one whose prefix
    is the whole prompt or longer runs the whole prompt, as a prefill node does."""
    request = PrefillRequest("bad-prefix", MODEL, [1, 2, 3], SamplingParams(max_tokens=2), "kvlane.v1.stream.nobody", 30.0,
                             decode_worker_id="w1", decode_inbox=subjects.worker_inbox("w1"), prefix_tokens=5)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(request))
    assert raw[-1] == 5  # a compact message: its fields in order, `prefix_tokens` last
    raw[-1] = -1
    nc = await nats.connect(sharing_fleet.config.nats.url)
    try:
        msg = await nc.request(subjects.worker_inbox("w0"), msgspec.msgpack.encode(raw), timeout=5)
        reply = msgspec.msgpack.decode(msg.data, type=WorkerReply)
        assert isinstance(reply, ErrorReply) and (reply.code, reply.status) == ("bad_request", 400) and ">= 0" in reply.message
        msg = await nc.request(subjects.worker_inbox("w0"), msgspec.msgpack.encode(request), timeout=5)
        assert isinstance(msgspec.msgpack.decode(msg.data, type=WorkerReply), GenerateAccepted)
    finally:
        await nc.close()
    assert await complete(sharing_fleet, "still serving", seed=8, max_tokens=4) == expected_text("still serving", 8, 4)


async def test_bad_requests_still_get_clear_errors_on_a_sharing_fleet(sharing_fleet: Fleet) -> None:
    client = openai.AsyncOpenAI(base_url=f"{sharing_fleet.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="context length"):
        await client.completions.create(model=MODEL, prompt=PREFIX, max_tokens=5000)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt=PREFIX, max_tokens=5)


async def test_the_source_killed_mid_pull_leaves_every_output_identical(tmp_path: Path) -> None:
    """SIGKILL of the source as its prefill-only request arrives: the pulled request is computed on another worker,
    the request the source was running resumes elsewhere, and both end complete and identical."""
    fleet = launch(tmp_path, workers=2, tune=sharing, speed=0.3)
    try:
        source = await cache_on_one_worker(fleet, PREFIX, seed=1)
        busy = await busy_source(fleet, f"{PREFIX} busy", BUSY_TOKENS, seed=4)
        prompt = f"{PREFIX} killed"
        async with RoutedWatch(fleet) as watch:
            killed: list[str] = []

            def on(subject: str, message: object) -> None:
                if isinstance(message, PrefillRequest) and message.prefix_tokens and not killed:
                    killed.append(worker_of(subject))
                    process(fleet, killed[0]).signal(signal.SIGKILL)

            watch.on = on
            text = await complete(fleet, prompt, seed=5, max_tokens=12)
            busy_text = await busy
        assert killed == [source], "the source was not killed mid-pull"
        assert text == expected_text(prompt, 5, 12)
        assert busy_text == expected_text(f"{PREFIX} busy", 4, BUSY_TOKENS), "the source's own request was lost or changed"
        # Nothing of the pulled request ran on the dead source after the kill: it ran whole on the runner.
        runner = next(w for w in ("w0", "w1") if w != source)
        assert any(worker_of(s) == runner and isinstance(m, GenerateRequest) and m.prompt_token_ids
                   for s, m in clients_requests(watch))
        assert any(isinstance(m, TokenChunk) for m in watch.seen)
    finally:
        fleet.stop()
