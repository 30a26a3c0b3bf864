"""The OpenAI API over NATS request/reply, end to end against a real nats-server and sim fleet.

Driven both with plain nats-py (what any NATS client in any language does) and
with `kvlane.client`. Bad input on every subject gets the OpenAI error body
with `Nats-Service-Error-Code` and the service keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.msg import Msg

from contracts import subjects
from kvlane.client import KvlaneApiError, KvlaneClient
from launch.fleet import Fleet, with_overrides
from launch.launcher import free_port, wait_services_ready
from loadtest.dataplane.hangup import FinishedWatch
from shared.config import to_env
from tests.integration.conftest import MODEL, launch, stop_and_check

pytestmark = pytest.mark.integration

MAX_BODY = 64 * 1024
ERROR_CODE, ERROR = "Nats-Service-Error-Code", "Nats-Service-Error"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # A small body limit, so that an oversized payload fits in one NATS message.
    fleet = launch(tmp_path_factory.mktemp("nats-api"), tune=lambda c: with_overrides(c, ingress={"max_body_bytes": MAX_BODY}))
    yield fleet
    stop_and_check(fleet)


def run(fleet: Fleet, scenario) -> object:
    async def main() -> object:
        nc = await nats.connect(fleet.config.nats.url)
        try:
            return await scenario(nc)
        finally:
            await nc.close()

    return asyncio.run(main())


def http(fleet: Fleet, path: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"{fleet.base_url}{path}", data=body, method="POST" if body is not None else "GET",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def stream(nc: nats.NATS, subject: str, body: dict) -> AsyncIterator[Msg]:
    """Every message of a streamed reply, the end marker included."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    await nc.publish(subject, json.dumps(body).encode(), reply=inbox)
    try:
        while True:
            msg = await subscription.next_msg(timeout=30)
            yield msg
            if (msg.headers or {}).get(subjects.API_STREAM_HEADER) == subjects.API_STREAM_END:
                return
    finally:
        await subscription.unsubscribe()


# --- discovery -----------------------------------------------------------------------


def test_the_ingress_is_discoverable_as_a_micro_service(fleet: Fleet) -> None:
    async def scenario(nc: nats.NATS) -> tuple[dict, dict]:
        ping = await nc.request(f"$SRV.PING.{subjects.API_SERVICE}", b"", timeout=5)
        info = await nc.request(f"$SRV.INFO.{subjects.API_SERVICE}", b"", timeout=5)
        return json.loads(ping.data), json.loads(info.data)

    ping, info = run(fleet, scenario)
    assert ping["name"] == "kvlane" and ping["type"] == "io.nats.micro.v1.ping_response"
    endpoints = {e["name"]: e for e in info["endpoints"]}
    assert {name: e["subject"] for name, e in endpoints.items()} == {
        "chat_completions": "kvlane.v1.api.chat.completions",
        "completions": "kvlane.v1.api.completions",
        "models": "kvlane.v1.api.models",
        "tokenize": "kvlane.v1.api.tokenize",
        "detokenize": "kvlane.v1.api.detokenize",
        "messages": "kvlane.v1.api.messages",
        "responses": "kvlane.v1.api.responses",
    }
    assert {e["queue_group"] for e in endpoints.values()} == {"kvlane-api"}
    assert info["metadata"]["ingress_id"]


# --- replies ---------------------------------------------------------------------------


def test_chat_completion_with_plain_nats_matches_http(fleet: Fleet) -> None:
    async def scenario(nc: nats.NATS) -> Msg:
        return await nc.request(subjects.API_CHAT_COMPLETIONS, json.dumps(CHAT).encode(), timeout=30)

    msg = run(fleet, scenario)
    assert ERROR_CODE not in (msg.headers or {})
    reply = json.loads(msg.data)
    status, over_http = http(fleet, "/v1/chat/completions", json.dumps(CHAT).encode())
    assert status == 200
    assert reply["object"] == "chat.completion" and reply["id"].startswith("chatcmpl-")
    assert reply["choices"][0]["finish_reason"] == "length"
    assert len(reply["choices"][0]["message"]["content"].split()) == 8  # each sim token is one word
    assert reply["usage"]["completion_tokens"] == 8
    assert reply["usage"]["prompt_tokens"] == over_http["usage"]["prompt_tokens"]
    assert set(reply) == set(over_http) and set(reply["choices"][0]) == set(over_http["choices"][0])


def test_models_with_plain_nats_match_http(fleet: Fleet) -> None:
    async def scenario(nc: nats.NATS) -> Msg:
        return await nc.request(subjects.API_MODELS, b"", timeout=5)

    reply = json.loads(run(fleet, scenario).data)
    assert reply == http(fleet, "/v1/models")[1]
    assert [m["id"] for m in reply["data"]] == [MODEL]


def test_streamed_chat_with_plain_nats(fleet: Fleet) -> None:
    body = {**CHAT, "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}

    async def scenario(nc: nats.NATS) -> list[Msg]:
        return [msg async for msg in stream(nc, subjects.API_CHAT_COMPLETIONS, body)]

    messages = run(fleet, scenario)
    end = messages[-1]
    assert end.data == b"" and end.headers[subjects.API_STREAM_HEADER] == "end"
    assert [int(m.headers[subjects.API_SEQ_HEADER]) for m in messages] == list(range(len(messages)))
    chunks = [json.loads(m.data) for m in messages[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(text.split()) == 12
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_client_replies_and_streams(fleet: Fleet) -> None:
    async def scenario() -> tuple[dict, dict, list[dict], list[dict]]:
        async with await KvlaneClient.connect(fleet.config.nats.url, timeout=30) as client:
            chat = await client.chat_completions(CHAT)
            text = await client.completions({"model": MODEL, "prompt": "Once upon", "max_tokens": 5})
            chat_chunks = [c async for c in client.stream_chat_completions(CHAT)]
            text_chunks = [c async for c in client.stream_completions({"model": MODEL, "prompt": "Once", "max_tokens": 6})]
            return chat, text, chat_chunks, text_chunks

    chat, text, chat_chunks, text_chunks = asyncio.run(scenario())
    assert chat["usage"]["completion_tokens"] == 8
    assert text["object"] == "text_completion" and text["usage"]["completion_tokens"] == 5
    assert len("".join(c["choices"][0]["delta"].get("content") or "" for c in chat_chunks).split()) == 8
    assert len("".join(c["choices"][0]["text"] for c in text_chunks).split()) == 6
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_the_client_speaks_every_api(fleet: Fleet) -> None:
    """Anthropic Messages, the Responses API and the tokenizer, through `KvlaneClient` as through HTTP."""
    async def scenario() -> tuple[dict, list[dict], dict, dict, dict]:
        async with await KvlaneClient.connect(fleet.config.nats.url, timeout=30) as client:
            asked = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
            message = await client.messages(asked)
            events = [e async for e in client.stream_messages(asked)]
            response = await client.responses({"model": MODEL, "input": "Hello there", "max_output_tokens": 4})
            tokens = await client.tokenize({"model": MODEL, "prompt": "Hello there"})
            text = await client.detokenize({"model": MODEL, "tokens": [16, 17]})  # two of the sim model's words
            return message, events, response, tokens, text

    message, events, response, tokens, text = asyncio.run(scenario())
    assert message["type"] == "message" and message["usage"]["output_tokens"] == 4
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    assert response["object"] == "response" and response["usage"]["output_tokens"] == 4
    assert tokens["count"] == len(tokens["tokens"]) > 0 and text["prompt"]


def test_a_caller_that_goes_away_aborts_its_stream(fleet: Fleet) -> None:
    long = 2000

    async def scenario(nc: nats.NATS) -> list:
        async with FinishedWatch.open(fleet.config.nats.url) as watch:
            received = 0
            async for _ in stream(nc, subjects.API_COMPLETIONS,
                                  {"model": MODEL, "prompt": "A long story", "max_tokens": long, "stream": True, "ignore_eos": True}):
                received += 1
                if received == 5:
                    break  # unsubscribes: nobody listens on the inbox any more
            await watch.wait_until(watch.of_clients, timeout_s=20)
            return watch.of_clients()

    finished = run(fleet, scenario)
    assert [f.finish_reason for f in finished] == ["abort"]
    assert finished[0].usage.completion_tokens < long


# --- bad input ---------------------------------------------------------------------------


BAD_INPUT = {
    # what arrives: (HTTP status, OpenAI error code)
    "not json": (b"\x00\xffgarbage", 400, "invalid_json"),
    "empty": (b"", 400, "invalid_json"),
    "json but not an object": (b"[1, 2]", 400, "invalid_value"),
    "tool_choice without tools": (json.dumps({**CHAT, "tool_choice": "required"}).encode(), 400, "invalid_value"),
    "missing messages": (json.dumps({"model": MODEL}).encode(), 400, "missing_required_parameter"),
    "temperature out of range": (json.dumps({**CHAT, "temperature": 7}).encode(), 400, "invalid_value"),
    "logit bias on the sim engine": (json.dumps({**CHAT, "logit_bias": {"5": 1.0}}).encode(), 400, "invalid_request"),
    "unknown model": (json.dumps({**CHAT, "model": "nope"}).encode(), 404, "model_not_found"),
    "oversized": (json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}).encode(), 413, None),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_gets_the_http_error_with_service_error_headers(fleet: Fleet, case: str) -> None:
    payload, status, code = BAD_INPUT[case]

    async def scenario(nc: nats.NATS) -> tuple[Msg, Msg]:
        bad = await nc.request(subjects.API_CHAT_COMPLETIONS, payload, timeout=10)
        good = await nc.request(subjects.API_CHAT_COMPLETIONS, json.dumps(CHAT).encode(), timeout=30)
        return bad, good

    bad, good = run(fleet, scenario)
    assert bad.headers[ERROR_CODE] == str(status)
    error = json.loads(bad.data)["error"]
    assert bad.headers[ERROR] == error["message"]
    if code is not None:
        assert error["code"] == code
    http_status, over_http = http(fleet, "/v1/chat/completions", payload)
    assert http_status == status
    if status != 413:  # aiohttp refuses an oversized body before the shared code path sees it
        assert over_http == json.loads(bad.data), "one code path: the same error over HTTP and NATS"
    assert ERROR_CODE not in (good.headers or {}), "the service keeps serving"


def test_a_stream_that_fails_validation_gets_one_error_reply(fleet: Fleet) -> None:
    async def scenario(nc: nats.NATS) -> list[Msg]:
        inbox = nc.new_inbox()
        subscription = await nc.subscribe(inbox)
        await nc.publish(subjects.API_COMPLETIONS, json.dumps({"model": "nope", "prompt": "x", "stream": True}).encode(), reply=inbox)
        first = await subscription.next_msg(timeout=10)
        with pytest.raises(nats.errors.TimeoutError):
            await subscription.next_msg(timeout=0.5)  # nothing after the error
        return [first]

    [msg] = run(fleet, scenario)
    assert msg.headers[ERROR_CODE] == "404"


def test_a_request_without_a_reply_subject_is_dropped_and_the_service_goes_on(fleet: Fleet) -> None:
    async def scenario(nc: nats.NATS) -> dict:
        await nc.publish(subjects.API_CHAT_COMPLETIONS, json.dumps(CHAT).encode())
        await nc.publish(subjects.API_MODELS, b"")
        return json.loads((await nc.request(subjects.API_CHAT_COMPLETIONS, json.dumps(CHAT).encode(), timeout=30)).data)

    assert run(fleet, scenario)["usage"]["completion_tokens"] == 8


def test_client_raises_the_api_error(fleet: Fleet) -> None:
    async def scenario() -> tuple[KvlaneApiError, KvlaneApiError]:
        async with await KvlaneClient.connect(fleet.config.nats.url, timeout=30) as client:
            with pytest.raises(KvlaneApiError) as whole:
                await client.chat_completions({**CHAT, "model": "nope"})
            with pytest.raises(KvlaneApiError) as streamed:
                async for _ in client.stream_chat_completions({**CHAT, "max_tokens": 0}):
                    pass
            return whole.value, streamed.value

    whole, streamed = asyncio.run(scenario())
    assert (whole.status, whole.body["error"]["code"]) == (404, "model_not_found")
    assert streamed.status == 400 and streamed.body["error"]["param"] == "max_tokens"


def test_stats_count_requests_errors_and_time(fleet: Fleet) -> None:
    async def scenario(nc: nats.NATS) -> dict:
        before = json.loads((await nc.request(f"$SRV.STATS.{subjects.API_SERVICE}", b"", timeout=5)).data)
        await nc.request(subjects.API_COMPLETIONS, b"{", timeout=10)
        await nc.request(subjects.API_COMPLETIONS, json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4}).encode(), timeout=30)
        after = json.loads((await nc.request(f"$SRV.STATS.{subjects.API_SERVICE}", b"", timeout=5)).data)
        return {"before": before, "after": after}

    stats = run(fleet, scenario)
    before, after = ({e["name"]: e for e in s["endpoints"]}["completions"] for s in (stats["before"], stats["after"]))
    assert after["num_requests"] - before["num_requests"] == 2
    assert after["num_errors"] - before["num_errors"] == 1
    assert after["last_error"].startswith("400:")
    # The completion's own time counts, not only the handler's hand-off to its task.
    assert after["processing_time"] - before["processing_time"] > 1_000_000


def test_every_ingress_serves_in_one_queue_group(fleet: Fleet) -> None:
    """A second ingress joins the service: discovery finds both, and requests are spread over them, each answered once."""
    env = to_env(fleet.config) | {"KVLANE__INGRESS__PORT": str(free_port()), "KVLANE__INGRESS__INGRESS_ID": '"second"'}
    second = fleet.launcher.start_service("ingress", env, name="ingress-second")
    try:
        wait_services_ready([second])

        async def scenario(nc: nats.NATS) -> tuple[list[dict], list[Msg]]:
            inbox = nc.new_inbox()
            pings = await nc.subscribe(inbox)
            await nc.publish(f"$SRV.PING.{subjects.API_SERVICE}", b"", reply=inbox)
            found = [json.loads((await pings.next_msg(timeout=5)).data) for _ in range(2)]
            body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
            replies = await asyncio.gather(*(nc.request(subjects.API_COMPLETIONS, body, timeout=30) for _ in range(24)))
            stats = []
            for ping in found:
                stats.append(json.loads((await nc.request(f"$SRV.STATS.{subjects.API_SERVICE}.{ping['id']}", b"", timeout=5)).data))
            return stats, replies

        stats, replies = run(fleet, scenario)
        assert all(json.loads(r.data)["usage"]["completion_tokens"] == 2 for r in replies)
        served = {s["metadata"]["ingress_id"]: {e["name"]: e for e in s["endpoints"]}["completions"]["num_requests"] for s in stats}
        assert "second" in served and len(served) == 2
        assert all(count > 0 for count in served.values()), served  # all 24 on one replica: 1 in 8 million
    finally:
        second.stop()
