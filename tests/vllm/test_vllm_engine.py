"""Real vLLM (the CPU build) behind kvlane: openai client -> ingress -> balancer -> vllm worker.

One module-scoped fleet of two workers serves the tiny random-weight model.
Tests run in file order; the first one sends very short prompts first, which
is what killed a worker that had not asked Linux for AMX state.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from contracts import subjects
from contracts.messages import HeartbeatMessage, KvEvents
from contracts.openai_api import ChatMessage
from launch.fleet import Fleet
from loadtest.dataplane.hangup import Options, Report, soak
from shared.kv.block_hash import chained_block_hashes
from shared.hf_tokenizer import HfTokenizer
from tests.vllm.conftest import BLOCK_SIZE, MAX_MODEL_LEN, MODEL, reference_engine_args

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]


MAX_TOKENS = 24


def correctness_prompts(tokenizer: HfTokenizer) -> list[list[int]]:
    return [
        tokenizer.encode("The quick brown fox jumps over the lazy dog near the river bank."),
        tokenizer.encode(tokenizer.apply_chat_template([ChatMessage(role="user", content="Tell me about tea and 42 cats.")])),
        [11 + (i * 37) % 900 for i in range(70)],
    ]


class OfflineReference:
    """vLLM's own offline engine on the correctness prompts, run in a subprocess.

    Started first (autouse) so that it runs while the fleet's engines start;
    its output goes to files, which a full pipe could never block.
    """

    def __init__(self, tiny_model: Path, directory: Path) -> None:
        request = directory / "request.json"
        request.write_text(json.dumps({"engine_args": reference_engine_args(tiny_model),
                                       "prompts": correctness_prompts(HfTokenizer(str(tiny_model))), "max_tokens": MAX_TOKENS}))
        self.stdout, self.stderr = directory / "stdout.txt", directory / "stderr.txt"
        with request.open() as stdin, self.stdout.open("w") as stdout, self.stderr.open("w") as stderr:
            self.process = subprocess.Popen([sys.executable, "-m", "tests.vllm.offline_reference"], stdin=stdin,
                                            stdout=stdout, stderr=stderr, cwd=REPO)

    def outputs(self, timeout_s: float) -> list[dict]:
        returncode = self.process.wait(timeout_s)
        lines = [line for line in self.stdout.read_text().splitlines() if line.startswith("REFERENCE ")]
        assert returncode == 0 and lines, self.stderr.read_text()[-3000:]
        return json.loads(lines[0].removeprefix("REFERENCE "))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module", autouse=True)
def offline_reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OfflineReference]:
    reference = OfflineReference(tiny_model, tmp_path_factory.mktemp("offline-reference"))
    yield reference
    reference.stop()


@pytest.fixture(scope="module")
def client(vllm_fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vllm_fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> HfTokenizer:
    return HfTokenizer(str(tiny_model))


def test_short_first_prompts_do_not_kill_workers(client: openai.OpenAI, vllm_fleet: Fleet) -> None:
    async def burst() -> list:
        async with openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0, timeout=120) as aclient:
            calls = [aclient.completions.create(model=MODEL, prompt=[1, 7 + i, 9], max_tokens=4, temperature=0) for i in range(4)]
            return await asyncio.gather(*calls)

    replies = asyncio.run(burst())
    assert all(r.usage.prompt_tokens == 3 and r.choices[0].finish_reason in ("stop", "length") for r in replies)
    assert all(p.alive() for p in vllm_fleet.workers)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_ingress_tokenizes_without_loading_torch(client: openai.OpenAI, vllm_fleet: Fleet) -> None:
    """Its tokenizer was loaded before /ready (no first-request stall), and without torch."""
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert vllm_fleet.ingress is not None
    libraries = Path(f"/proc/{vllm_fleet.ingress.pid}/maps").read_text()
    assert "libtorch" not in libraries


def test_chat_completion(client: openai.OpenAI, tokenizer: HfTokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    expected_prompt = tokenizer.encode(tokenizer.apply_chat_template([ChatMessage(**m) for m in messages]))
    assert reply.usage.prompt_tokens == len(expected_prompt)
    assert 1 <= reply.usage.completion_tokens <= 12


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten"}], max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].choices == [] and 1 <= chunks[-1].usage.completion_tokens <= 16


def test_completion_streamed_and_whole_agree(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, stream=True)
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert whole.object == "text_completion"
    assert "".join(pieces) == whole.choices[0].text


def test_prompt_too_long_is_a_clear_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {MAX_MODEL_LEN}"):
        client.completions.create(model=MODEL, prompt=[5] * (MAX_MODEL_LEN - 24), max_tokens=100)


def test_greedy_output_equals_vllm_offline(client: openai.OpenAI, tokenizer: HfTokenizer,
                                          offline_reference: OfflineReference) -> None:
    prompts = correctness_prompts(tokenizer)
    served = [client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0) for ids in prompts]
    reference = offline_reference.outputs(timeout_s=240)
    for reply, expected in zip(served, reference, strict=True):
        assert reply.choices[0].text == expected["text"]
        assert reply.usage.completion_tokens == len(expected["token_ids"])
        assert reply.choices[0].finish_reason == expected["finish_reason"]


async def _collect(nats_url: str, subject: str, decoder: msgspec.msgpack.Decoder, sink: list,
                   stamp: bool = False) -> nats.NATS:
    """Append each message on `subject` to `sink` (as `(arrival, message)` with `stamp`)."""
    nc = await nats.connect(nats_url)

    async def on_message(msg) -> None:
        message = decoder.decode(msg.data)
        sink.append((time.monotonic(), message) if stamp else message)

    await nc.subscribe(subject, cb=on_message)
    # Twice: nats-py can write a flush's PING ahead of the SUB still queued.
    await nc.flush()
    await nc.flush()
    return nc


def test_shared_prefix_is_cached_and_its_blocks_announced(vllm_fleet: Fleet) -> None:
    prefix = [100 + (i * 7) % 800 for i in range(6 * BLOCK_SIZE)]
    prefix_hashes = chained_block_hashes(prefix, BLOCK_SIZE)

    async def scenario() -> tuple[list, list[KvEvents]]:
        events: list[KvEvents] = []
        nc = await _collect(vllm_fleet.config.nats.url, subjects.KV_EVENTS_ALL, msgspec.msgpack.Decoder(KvEvents), events)
        aclient = openai.AsyncOpenAI(base_url=f"{vllm_fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        replies = []
        try:
            # Each worker caches the prefix the first time it runs it; with two
            # workers the third request at the latest lands on one that has it.
            for tail in range(3):
                reply = await aclient.completions.create(model=MODEL, prompt=prefix + [900 + tail] * 5, max_tokens=4, temperature=0)
                replies.append(reply)
                if reply.usage.prompt_tokens_details.cached_tokens:
                    break
            await asyncio.sleep(0.5)  # kv events go out every 50 ms
        finally:
            await aclient.close()
            await nc.close()
        return replies, events

    replies, events = asyncio.run(scenario())
    cached = replies[-1].usage.prompt_tokens_details.cached_tokens
    assert cached >= 4 * BLOCK_SIZE and cached % BLOCK_SIZE == 0
    stored = {h for batch in events for h in batch.stored}
    assert set(prefix_hashes) <= stored
    assert all(batch.block_size == BLOCK_SIZE for batch in events)


def test_clients_that_hang_up_get_their_engine_requests_aborted(vllm_fleet: Fleet) -> None:
    """Each client leaves a long stream after a few chunks, with another stream running beside it:
    vLLM must stop generating for it (`python -m loadtest.dataplane.hangup --engine vllm` runs this many times)."""
    runs = 5
    # stall_s: on two cores, two vLLM engines can starve the ingress for seconds; a hang-up
    # whose first chunks took that long says nothing about hang-up handling and is tried again.
    # Hang-ups come within a fraction of a second otherwise, where a leak still fails the test.
    options = Options(runs=runs, max_tokens=MAX_MODEL_LEN - 64, after_chunks=5, background=1, busy_core=False,
                      stall_s=1.5)

    async def scenario() -> tuple[Report, set[str]]:
        heartbeats: list[tuple[float, HeartbeatMessage]] = []  # (arrival, full heartbeat or load report)
        nc = await _collect(vllm_fleet.config.nats.url, subjects.HEARTBEAT_ALL, msgspec.msgpack.Decoder(HeartbeatMessage),
                            heartbeats, stamp=True)
        report = await soak(vllm_fleet, options, log=False)
        ended_at = time.monotonic()

        def idle_since_end() -> set[str]:
            # Not necessarily each worker's first heartbeat after: a health probe
            # (one token, every 2 s) may be running then.
            return {beat.worker_id for at, beat in heartbeats if at > ended_at and not beat.stats.running}

        while idle_since_end() != workers and time.monotonic() < ended_at + 5:
            await asyncio.sleep(0.05)
        await nc.close()
        return report, idle_since_end()

    workers = {process.name.removeprefix("worker-") for process in vllm_fleet.workers}
    report, idle = asyncio.run(scenario())
    # Hang-ups of requests still running; one refused or ended first (a worker judged gone on a
    # busy machine, say) is tried again and reported, not counted.
    # Each hang-up on a line of its own: pytest cuts a long report short, and a leak is read from its hang-up.
    assert (report.aborted, report.leaked) == (runs, 0), "\n".join(map(str, [vars(report) | {"hang_ups": len(report.hang_ups)}, *report.hang_ups]))
    assert report.background_completed >= 1
    assert idle == workers, f"only {idle} of {workers} report nothing running after their clients left"
