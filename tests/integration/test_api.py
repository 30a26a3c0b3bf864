"""The OpenAI-compatible API end to end: openai client → ingress → balancer → sim worker."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import msgspec
import nats
import openai
import pytest

from contracts import subjects
from contracts.messages import EngineStats, Heartbeat, WorkerRegistration
from launch.fleet import Fleet
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(shared_fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shared_fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def http(fleet: Fleet, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(f"{fleet.base_url}{path}", data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_chat_completion(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=12)
    choice = reply.choices[0]
    assert reply.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert len(choice.message.content.split()) == 12  # each sim token is one word
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_chat_completion_streaming_usage_matches_tokens(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to ten"}],
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[0].choices[0].delta.role == "assistant"
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert usage.completion_tokens == len(content) == 20
    assert len({c.id for c in chunks}) == 1


def test_completion_and_streamed_completion_agree(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, seed=7)
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, seed=7, stream=True)
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert whole.object == "text_completion"
    assert whole.usage.completion_tokens == 10
    # The sim engine is deterministic for a seed, on whichever worker runs it.
    assert "".join(pieces) == whole.choices[0].text


def test_stop_string_ends_generation(client: openai.OpenAI) -> None:
    first = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, seed=3).choices[0].text
    words = first.split()
    stopped = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, seed=3, stop=[words[2]])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == " " + " ".join(words[:2]) + " "


def test_models_lists_the_live_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_health_ready_metrics_openapi(shared_fleet: Fleet, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="warm", max_tokens=2)
    status, _, body = http(shared_fleet, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = http(shared_fleet, "GET", "/ready")
    assert status == 200 and json.loads(body) == {"status": "ok", "workers": 2, "models": [MODEL], "missing": [],
                                                "degraded": []}
    status, _, body = http(shared_fleet, "GET", "/metrics")
    text = body.decode()
    assert status == 200
    for name in ("kvlane_ingress_requests_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 'vllm:num_requests_running{model_name="kvlane-sim",worker="w0"}'):
        assert name in text
    status, _, body = http(shared_fleet, "GET", "/openapi.json")
    assert status == 200 and "/v1/chat/completions" in json.loads(body)["paths"]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

BAD_REQUESTS = [
    # (what is wrong, body, expected status, expected code, expected param)
    ("invalid JSON", b'{"model": ', 400, "invalid_json", None),
    ("not an object", b"[1, 2]", 400, "invalid_value", None),
    ("missing messages", {"model": MODEL}, 400, "missing_required_parameter", "messages"),
    ("missing model", {"messages": CHAT["messages"]}, 400, "missing_required_parameter", "model"),
    ("messages not a list", {**CHAT, "messages": "hi"}, 400, "invalid_value", "messages"),
    ("empty messages", {**CHAT, "messages": []}, 400, "invalid_value", "messages"),
    ("role not a string", {**CHAT, "messages": [{"role": 3, "content": "x"}]}, 400, "invalid_value", "messages"),
    ("max_tokens wrong type", {**CHAT, "max_tokens": "ten"}, 400, "invalid_value", "max_tokens"),
    ("max_tokens zero", {**CHAT, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("max_tokens negative", {**CHAT, "max_tokens": -5}, 400, "invalid_value", "max_tokens"),
    ("max_tokens above the context", {**CHAT, "max_tokens": 10_000}, 400, "context_length_exceeded", "max_tokens"),
    ("temperature out of range", {**CHAT, "temperature": 3}, 400, "invalid_value", "temperature"),
    # What the sim engine cannot honour is refused, naming the parameter (a vLLM engine honours them); n, logprobs,
    # tools and JSON schemas it honours (tests/integration/test_sim_api_features.py).
    ("logit bias on the sim engine", {**CHAT, "logit_bias": {"5": 1.0}}, 400, "invalid_request", "logit_bias"),
    ("a JSON schema keyword the sim cannot satisfy", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "^a+$"}}}}, 400, "invalid_request", "response_format"),
    ("a regex on the sim engine", {**CHAT, "structured_outputs": {"regex": "a+"}}, 400, "invalid_request", "structured_outputs"),
    ("tool_choice without tools", {**CHAT, "tool_choice": "required"}, 400, "invalid_value", "tool_choice"),
    ("image content for a text-only model", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}, 400, "invalid_value", "messages[0].content[0]"),
    ("stream_options without stream", {**CHAT, "stream_options": {"include_usage": True}}, 400, "invalid_value", "stream_options"),
    ("unknown model", {**CHAT, "model": "no-such-model"}, 404, "model_not_found", "model"),
    ("prompt longer than the context", {**CHAT, "messages": [{"role": "user", "content": "word " * 5000}]}, 400,
     "context_length_exceeded", "messages"),
]


@pytest.mark.parametrize(("case", "body", "status", "code", "param"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_chat_requests_get_openai_errors(shared_fleet: Fleet, case: str, body, status: int, code: str, param: str | None) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got_status, headers, payload = http(shared_fleet, "POST", "/v1/chat/completions", raw, {"Content-Type": "application/json"})
    error = json.loads(payload)["error"]
    assert got_status == status, error
    assert error["code"] == code
    assert error["param"] == param
    assert error["message"] and error["type"]
    assert headers["Content-Type"].startswith("application/json")


@pytest.mark.parametrize(
    ("case", "body", "code"),
    [
        ("empty prompt", {"model": MODEL, "prompt": ""}, "invalid_value"),
        ("logit bias on the sim engine", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 1.0}}, "invalid_request"),
        ("suffix", {"model": MODEL, "prompt": "x", "suffix": "y"}, "invalid_value"),
        ("a batch mixing texts and token ids", {"model": MODEL, "prompt": ["x", [1, 2]]}, "invalid_value"),
        ("token id outside the vocabulary", {"model": MODEL, "prompt": [1, 2, 99_999_999]}, "invalid_value"),
        ("negative token id", {"model": MODEL, "prompt": [-1] * 40}, "invalid_value"),
    ],
)
def test_bad_completion_requests_get_openai_errors(shared_fleet: Fleet, case: str, body: dict, code: str) -> None:
    status, _, payload = http(shared_fleet, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400
    assert json.loads(payload)["error"]["code"] == code


@pytest.mark.parametrize(
    ("case", "extra"),
    [
        ("parameters vLLM accepts and ignores", {"store": True, "metadata": {"a": "b"}, "service_tier": "auto", "frobnicate": 1}),
        ("a role the template renders", {"messages": [{"role": "narrator", "content": "Once upon a time"}]}),
        ("text parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}),
        ("tools the model may not call", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}),
        ("a tool call and its result in the history", {"messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}),
    ],
)
def test_requests_vllm_serve_accepts_are_answered(shared_fleet: Fleet, case: str, extra: dict) -> None:
    status, _, payload = http(shared_fleet, "POST", "/v1/chat/completions", json.dumps({**CHAT, **extra}).encode())
    assert status == 200, payload
    assert json.loads(payload)["choices"][0]["message"]["content"]


def test_completion_batch_and_echo(shared_fleet: Fleet) -> None:
    body = {"model": MODEL, "prompt": ["one two", "three"], "max_tokens": 3, "echo": True}
    status, _, payload = http(shared_fleet, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 200, payload
    reply = json.loads(payload)
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert reply["choices"][0]["text"].startswith("one two") and reply["choices"][1]["text"].startswith("three")
    assert reply["usage"]["completion_tokens"] == 6


def test_tokenize_and_detokenize(shared_fleet: Fleet) -> None:
    status, _, payload = http(shared_fleet, "POST", "/tokenize", json.dumps({"model": MODEL, "prompt": "hello there"}).encode())
    assert status == 200, payload
    tokens = json.loads(payload)
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    chat = {"model": MODEL, "messages": CHAT["messages"]}
    status, _, payload = http(shared_fleet, "POST", "/tokenize", json.dumps(chat).encode())
    assert status == 200 and json.loads(payload)["count"] > tokens["count"]
    status, _, payload = http(shared_fleet, "POST", "/detokenize", json.dumps({"model": MODEL, "tokens": [16, 17]}).encode())
    assert status == 200 and json.loads(payload)["prompt"]
    status, _, payload = http(shared_fleet, "POST", "/tokenize", json.dumps({"model": MODEL}).encode())
    assert status == 400 and json.loads(payload)["error"]["param"] == "prompt"
    status, _, payload = http(shared_fleet, "POST", "/detokenize", json.dumps({"model": "nope", "tokens": [1]}).encode())
    assert status == 404


def test_unknown_path_and_wrong_method_and_huge_body(shared_fleet: Fleet) -> None:
    status, _, payload = http(shared_fleet, "GET", "/v1/nope")
    assert status == 404 and "error" in json.loads(payload)
    status, _, payload = http(shared_fleet, "GET", "/v1/chat/completions")
    assert status == 405 and "error" in json.loads(payload)
    status, _, payload = http(shared_fleet, "POST", "/v1/completions", b"x" * (9 * 1024 * 1024))
    assert status == 413 and json.loads(payload)["error"]["type"] == "invalid_request_error"


def test_fleet_still_serves_after_bad_input(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=3)
    assert reply.usage.completion_tokens == 3


def test_a_model_whose_tokenizer_cannot_load_is_not_ready_and_answers_503(own_fleet: Fleet) -> None:
    """A worker advertises a tokenizer this ingress cannot load: /ready names it, its requests get a
    clear 503, and the other model is served as before."""
    registration = WorkerRegistration(
        worker_id="ghost", role="aggregated", model="ghost-model", engine="vllm", inbox="kvlane.v1.worker.ghost.generate",
        block_size=16, max_model_len=1024, tokenizer="hf:/nonexistent/model", started_at=time.time(),
    )

    async def scenario() -> tuple[int, dict, int, dict, str]:
        nc = await nats.connect(own_fleet.config.nats.url)
        stop = asyncio.Event()

        async def beat() -> None:  # as a live worker would, faster than the fleet's 1 s TTL
            seq = 0
            while not stop.is_set():
                seq += 1
                beat = Heartbeat(registration, EngineStats(), time.time(), seq)
                await nc.publish(subjects.heartbeat("ghost"), msgspec.msgpack.encode(beat))
                await asyncio.sleep(0.2)

        beating = asyncio.create_task(beat())
        try:
            ready: tuple[int, dict] = (0, {})
            for _ in range(100):  # until ingress has seen the ghost and tried its tokenizer
                status, _, body = await asyncio.to_thread(http, own_fleet, "GET", "/ready")
                ready = (status, json.loads(body))
                if "ghost-model" in ready[1]["models"] and "tokenizer:ghost-model" in ready[1]["missing"]:
                    break
                await asyncio.sleep(0.1)
            request = json.dumps({"model": "ghost-model", "prompt": "hi", "max_tokens": 2}).encode()
            status, _, body = await asyncio.to_thread(http, own_fleet, "POST", "/v1/completions", request,
                                                      {"Content-Type": "application/json"})
            served = await asyncio.to_thread(
                openai.OpenAI(base_url=f"{own_fleet.base_url}/v1", api_key="unused", max_retries=0).completions.create,
                model=MODEL, prompt="still here", max_tokens=2)
            return *ready, status, json.loads(body), served.choices[0].finish_reason
        finally:
            stop.set()
            await beating
            await nc.close()

    ready_status, ready_body, status, error, served = asyncio.run(scenario())
    assert ready_status == 503 and "tokenizer:ghost-model" in ready_body["missing"]
    assert "tokenizer:" + MODEL not in ready_body["missing"]
    assert status == 503 and error["error"]["code"] == "tokenizer_unavailable"
    assert "/nonexistent/model" in error["error"]["message"]
    assert served == "length"
