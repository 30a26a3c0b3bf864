"""LoRA adapters end to end on a sim fleet: real nats-server with JetStream, Redis, balancer, workers, ingress.

`kvlane adapters add | list | remove` publishes to the bus's object store; `/v1/models` lists each adapter with
its base as `parent`; a request names an adapter as its `model` over HTTP and NATS, and its answer differs from
the base model's and is the same every time. Two base models share the fleet, each with its own workers and
adapters. Bad input and faults, each with its answer:

* an adapter nobody published: 404 `model_not_found`;
* an adapter whose base model no worker serves: 503 `model_unavailable` with Retry-After;
* a corrupt adapter object (its files do not match their revision): 422 `adapter_unavailable` from the worker,
  which keeps serving everything else;
* an adapter removed after it was published: 404 again;
* an API key whose `--models` lists one adapter: that adapter is served, the other gets 403;
* bad `adapters add` input (no adapter files, a bad name): the CLI exits 1 naming the problem;
* a worker SIGKILLed mid-stream on adapter requests: they resume on another worker, which loads the adapter,
  with output identical to an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import openai
import pytest
from nats.js.api import ObjectMeta

from contracts import subjects
from contracts.model_files import MODEL_FILES_BUCKET
from launch.fleet import Fleet, with_overrides
from launch.launcher import free_port
from launch.tiny_adapter import make_tiny_adapter
from launch.tiny_model import MODEL_SHAPE
from shared.adapter_store import pack_adapter, read_adapter_files
from shared.api_keys import make_record, write_keys_file
from tests.integration.conftest import MODEL, launch, stop_and_check
from tests.integration.test_faults import counter_total, kill_when_streaming
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

OTHER_MODEL = "kvlane-sim-b"


class AdapterFleet:
    def __init__(self, fleet: Fleet, keys: dict[str, str], adapters: dict[str, Path]) -> None:
        self.fleet, self.keys, self.adapters = fleet, keys, adapters

    def cli(self, *argv: str) -> subprocess.CompletedProcess:
        """`kvlane adapters ARGV...` against the fleet's NATS; its output with the console's line wrapping undone."""
        return subprocess.run([sys.executable, "-c", "import sys; from kvlane.cli import main; main(sys.argv[1:])", "adapters",
                               *argv, "--nats-url", self.fleet.config.nats.url], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "COLUMNS": "1000"})

    def http(self, path: str, body: dict | None = None, key: str = "all") -> tuple[int, dict, dict]:
        request = urllib.request.Request(
            f"{self.fleet.base_url}{path}", data=None if body is None else json.dumps(body).encode(),
            method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.keys[key]}"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read()), dict(response.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read()), dict(exc.headers)

    def complete(self, model: str, prompt: str = "tell me about adapters", key: str = "all") -> tuple[int, dict]:
        status, body, _ = self.http("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}, key)
        return status, body


@pytest.fixture(scope="module")
def lora_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AdapterFleet]:
    directory = tmp_path_factory.mktemp("adapters")
    base = directory / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(MODEL_SHAPE))
    adapters = {name: make_tiny_adapter(directory / name, base, seed=seed) for seed, name in enumerate(("a0", "a1", "b0"))}
    every, key = make_record("every-model")
    narrow, narrow_key = make_record("one-adapter", models=["a0"])
    keys_file = directory / "keys.json"
    write_keys_file(keys_file, [every, narrow])
    auth = {"required": True, "keys_file": str(keys_file)}
    metrics_port = free_port()

    def tune(config):
        config = with_overrides(config, ingress={"auth": auth}, worker={"metrics_port": metrics_port})
        return with_overrides(config, **{"worker.lora": {"max_loras": 2}})

    # Slow enough that a stream is still running when its worker is killed.
    fleet = launch(directory, workers=3, speed=0.25, jetstream=True, tune=tune)
    # A second base model: one more worker, under its own name.
    env = fleet.service_env("worker", "b0") | {"KVLANE__WORKER__WORKER_ID": '"b0"', "KVLANE__WORKER__MODEL": f'"{OTHER_MODEL}"',
                                               "KVLANE__WORKER__METRICS_PORT": str(metrics_port + 3)}
    fleet.workers.append(fleet.launcher.start_service("worker", env, name="worker-b0"))
    served = AdapterFleet(fleet, {"all": key, "narrow": narrow_key}, adapters)
    try:
        wait_for(lambda: OTHER_MODEL in {m["id"] for m in served.http("/v1/models")[1]["data"]}, 60, f"{OTHER_MODEL} served")
        for name, base_model in (("a0", MODEL), ("a1", MODEL), ("b0", OTHER_MODEL)):
            published = served.cli("add", name, str(adapters[name]), "--base", base_model)
            assert published.returncode == 0, published.stdout + published.stderr
        # The ingress reads the listing again at most once a second.
        wait_for(lambda: {"a0", "a1", "b0"} <= {m["id"] for m in served.http("/v1/models")[1]["data"]}, 10, "adapters listed")
        yield served
    finally:
        stop_and_check(fleet)


def test_published_adapters_are_listed_with_their_base(lora_fleet: AdapterFleet) -> None:
    listing = lora_fleet.cli("list", "--json")
    assert listing.returncode == 0
    rows = {row["name"]: row for row in map(json.loads, listing.stdout.splitlines())}
    assert {name: row["base"] for name, row in rows.items()} == {"a0": MODEL, "a1": MODEL, "b0": OTHER_MODEL}
    assert all(row["rank"] == 8 and row["tensor_bytes"] > 0 for row in rows.values())
    status, body, _ = lora_fleet.http("/v1/models")
    assert status == 200
    parents = {model["id"]: model["parent"] for model in body["data"]}
    assert parents == {MODEL: None, OTHER_MODEL: None, "a0": MODEL, "a1": MODEL, "b0": OTHER_MODEL}
    # A key sees the adapters it may use, and nothing else.
    assert [model["id"] for model in lora_fleet.http("/v1/models", key="narrow")[1]["data"]] == ["a0"]


def test_each_adapter_answers_as_itself_every_time(lora_fleet: AdapterFleet) -> None:
    answers = {}
    for model in (MODEL, "a0", "a1", OTHER_MODEL, "b0"):
        status, body = lora_fleet.complete(model)
        assert status == 200, body
        assert body["model"] == model
        answers[model] = body["choices"][0]["text"]
        assert lora_fleet.complete(model)[1]["choices"][0]["text"] == answers[model]
    # The sim's two base models answer alike (its words depend on the prompt and seed alone); adapters do not.
    assert len({answers[MODEL], answers["a0"], answers["a1"]}) == 3 and answers["b0"] != answers[OTHER_MODEL]


def test_each_base_model_has_its_own_pool(lora_fleet: AdapterFleet) -> None:
    metrics = httpx.get(f"{lora_fleet.fleet.base_url}/metrics", timeout=5).text
    pools = {line.split('model_name="')[1].split('"')[0] + "/" + line.split('worker="')[1].split('"')[0]
             for line in metrics.splitlines() if line.startswith("vllm:num_requests_running{")}
    assert pools == {f"{MODEL}/w0", f"{MODEL}/w1", f"{MODEL}/w2", f"{OTHER_MODEL}/b0"}


def test_workers_report_their_adapters_as_vllm_does(lora_fleet: AdapterFleet) -> None:
    lora_fleet.complete("a0")
    lora_fleet.complete("a1")
    port = lora_fleet.fleet.config.worker.metrics_port

    def adapters_reported() -> set[str]:
        reported = set()
        for offset in range(3):
            text = httpx.get(f"http://127.0.0.1:{port + offset}/metrics", timeout=5).text
            for line in text.splitlines():
                if line.startswith("vllm:lora_requests_info{"):
                    assert 'max_lora="2"' in line
                    running = line.split('running_lora_adapters="')[1].split('"')[0]
                    reported |= set(filter(None, running.split(",")))
        return reported

    wait_for(lambda: {"a0", "a1"} <= adapters_reported(), 15, "adapters in vllm:lora_requests_info")


def test_the_nats_api_serves_adapters_too(lora_fleet: AdapterFleet) -> None:
    async def ask() -> dict:
        nc = await nats.connect(lora_fleet.fleet.config.nats.url)
        try:
            body = json.dumps({"model": "a1", "prompt": "tell me about adapters", "max_tokens": 12, "temperature": 0}).encode()
            reply = await nc.request(subjects.API_COMPLETIONS, body, timeout=60,
                                     headers={"authorization": f"Bearer {lora_fleet.keys['all']}"})
            return json.loads(reply.data)
        finally:
            await nc.close()

    assert asyncio.run(ask())["choices"][0]["text"] == lora_fleet.complete("a1")[1]["choices"][0]["text"]


def test_a_key_may_be_limited_to_an_adapter(lora_fleet: AdapterFleet) -> None:
    assert lora_fleet.complete("a0", key="narrow")[0] == 200
    status, body = lora_fleet.complete("a1", key="narrow")
    assert status == 403 and body["error"]["param"] == "model"


def test_unknown_and_unservable_adapters_are_refused_clearly(lora_fleet: AdapterFleet) -> None:
    status, body = lora_fleet.complete("never-published")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    published = lora_fleet.cli("add", "orphan", str(lora_fleet.adapters["a0"]), "--base", "no-such-model")
    assert published.returncode == 0
    # The ingress reads the listing again at most once a second.
    status, body, headers = wait_for(
        lambda: (r := lora_fleet.http("/v1/completions", {"model": "orphan", "prompt": "hi", "max_tokens": 4}))[0] != 404 and r,
        10, "orphan listed")
    assert status == 503 and body["error"]["code"] == "model_unavailable" and "no-such-model" in body["error"]["message"]
    assert "Retry-After" in headers


def test_bad_input_to_adapters_add_is_refused_by_the_cli(lora_fleet: AdapterFleet, tmp_path: Path) -> None:
    result = lora_fleet.cli("add", "empty", str(tmp_path), "--base", MODEL)
    assert result.returncode == 1 and "no adapter_config.json" in result.stdout
    result = lora_fleet.cli("add", "bad/name", str(lora_fleet.adapters["a0"]), "--base", MODEL)
    assert result.returncode == 1 and "not allowed" in result.stdout
    result = lora_fleet.cli("remove", "never-published")
    assert result.returncode == 1 and "no adapter named" in result.stdout


def test_a_corrupt_adapter_fails_its_requests_alone(lora_fleet: AdapterFleet) -> None:
    files = read_adapter_files(lora_fleet.adapters["a1"])
    name, data, facts = pack_adapter("corrupt", MODEL, files)
    broken = bytearray(data)
    broken[data.index(files["adapter_model.safetensors"][-64:]) + 8] ^= 0xFF

    async def publish() -> None:
        nc = await nats.connect(lora_fleet.fleet.config.nats.url)
        try:
            store = await nc.jetstream().object_store(MODEL_FILES_BUCKET)
            description = json.dumps({"base": MODEL, "rank": facts.rank, "tensor_bytes": facts.tensor_bytes, "created": 1})
            await store.put(name, bytes(broken), meta=ObjectMeta(name=name, description=description))
        finally:
            await nc.close()

    asyncio.run(publish())
    status, body = wait_for(lambda: (r := lora_fleet.complete("corrupt"))[0] != 404 and r, 10, "the corrupt adapter listed")
    assert status == 422 and body["error"]["code"] == "adapter_unavailable"
    assert "do not match their revision" in body["error"]["message"]
    assert lora_fleet.complete(MODEL)[0] == 200 and lora_fleet.complete("a0")[0] == 200


def test_a_removed_adapter_is_no_longer_served(lora_fleet: AdapterFleet, tmp_path: Path) -> None:
    assert lora_fleet.cli("add", "short-lived", str(lora_fleet.adapters["a0"]), "--base", MODEL).returncode == 0
    assert wait_for(lambda: lora_fleet.complete("short-lived")[0] == 200, 10, "short-lived served")
    assert lora_fleet.cli("remove", "short-lived").returncode == 0
    wait_for(lambda: lora_fleet.complete("short-lived")[0] == 404, 10, "short-lived refused")
    assert "short-lived" not in lora_fleet.cli("list").stdout


async def test_sigkill_mid_stream_on_adapter_requests_resumes_exactly(lora_fleet: AdapterFleet) -> None:
    fleet = lora_fleet.fleet
    client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key=lora_fleet.keys["all"], max_retries=0, timeout=120)

    async def streamed(model: str, seed: int) -> str:
        stream = await client.completions.create(model=model, prompt=f"a long story, number {seed}", max_tokens=300,
                                                 temperature=0.8, seed=seed, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    requests = [(model, seed) for seed in range(3) for model in ("a0", "a1")]
    async with client:
        running = asyncio.gather(*(streamed(model, seed) for model, seed in requests))
        victim = await asyncio.to_thread(kill_when_streaming, fleet, 1, 60)
        interrupted = await running
        migrated = await counter_total(f"{fleet.base_url}/metrics", "kvlane_ingress_migrations")
        assert migrated >= 1, f"nothing ran on {victim} when it was killed"
        uninterrupted = await asyncio.gather(*(streamed(model, seed) for model, seed in requests))
    assert interrupted == uninterrupted
