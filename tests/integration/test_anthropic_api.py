"""The Anthropic Messages API end to end: anthropic SDK → ingress (`/v1/messages`) → chat path → sim worker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import nats
import pytest

from contracts import subjects
from launch.fleet import Fleet
from tests.integration.conftest import MODEL, launch, stop_and_check

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = launch(Path(tmp_path_factory.mktemp("anthropic")), workers=1)
    yield fleet
    stop_and_check(fleet)


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fleet.base_url, api_key="x", max_retries=0, timeout=30)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_message_reaching_max_tokens(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, messages=user("Hello there"), max_tokens=8)
    assert message.id.startswith("msg_")
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    [block] = message.content
    assert block.type == "text" and len(block.text.split()) == 8  # each sim token is one word
    assert message.usage.output_tokens == 8 and message.usage.input_tokens > 0


def test_system_prompt_and_content_blocks_reach_the_prompt(client: anthropic.Anthropic) -> None:
    plain = client.messages.create(model=MODEL, messages=user("Tell me"), max_tokens=2)
    with_system = client.messages.create(model=MODEL, system="You are terse. Very terse indeed.", max_tokens=2,
                                         messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me"}]}])
    blocks = client.messages.create(model=MODEL, max_tokens=2, system=[{"type": "text", "text": "You are terse. Very terse indeed."}],
                                    messages=user("Tell me"))
    assert prompt_tokens(with_system) > prompt_tokens(plain)
    assert prompt_tokens(blocks) == prompt_tokens(with_system)


def prompt_tokens(message: anthropic.types.Message) -> int:
    # Anthropic counts prompt tokens read from the cache apart (the second request hits the first's prefix).
    return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_multi_turn_conversation(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count."}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4


def test_stop_sequence_ends_the_message(client: anthropic.Anthropic) -> None:
    # The sim engine is deterministic for a prompt (its configured seed); learn a word it will write, then stop on it.
    free = client.messages.create(model=MODEL, messages=user("abc"), max_tokens=6)
    words = free.content[0].text.split()
    stopped = client.messages.create(model=MODEL, messages=user("abc"), max_tokens=6, stop_sequences=[words[2]])
    assert stopped.content[0].text.split() == words[:2]
    # vLLM names the matched string (`stop_sequence`); the sim engine does not say which stop string matched,
    # so its chat answer has no `stop_reason` and the message ends as a natural end of turn.
    assert (stopped.stop_reason, stopped.stop_sequence) in (("stop_sequence", words[2]), ("end_turn", None))


def test_streamed_text(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, messages=user("Count to ten"), max_tokens=10) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    texts = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    assert len(texts) == 10
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    assert final.content[0].text == "".join(texts)
    start = events[0].message
    assert start.usage.input_tokens == final.usage.input_tokens > 0


def test_streamed_and_whole_agree(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model=MODEL, messages=user("Once upon a time"), max_tokens=6, extra_body={"seed": 7})
    with client.messages.stream(model=MODEL, messages=user("Once upon a time"), max_tokens=6,
                                extra_body={"seed": 7}) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == whole.content[0].text
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_sse_lines_name_each_event(fleet: Fleet, client: anthropic.Anthropic) -> None:
    raw = client.messages.with_raw_response.create(model=MODEL, messages=user("Hi"), max_tokens=3, stream=True)
    assert raw.headers["content-type"].startswith("text/event-stream")
    text = raw.http_response.read().decode()
    frames = [frame for frame in text.split("\n\n") if frame]
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert event_line.removeprefix("event: ") == json.loads(data_line.removeprefix("data: "))["type"]
    assert json.loads(frames[-2].split("\n")[1].removeprefix("data: "))["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


def test_missing_max_tokens_is_a_400_in_anthropic_shape(fleet: Fleet, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post("/v1/messages", body={"model": MODEL, "messages": user("Hi")}, cast_to=object)
    body = caught.value.body
    assert caught.value.status_code == 400
    assert body["type"] == "error" and "max_tokens" in body["error"]["message"] and body["error"]["type"]


def test_unknown_model_is_a_404(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", messages=user("Hi"), max_tokens=3)
    assert caught.value.body["type"] == "error" and "no-such-model" in caught.value.body["error"]["message"]


def test_image_on_a_text_only_model_is_refused(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])


def test_the_model_calls_a_tool(client: anthropic.Anthropic) -> None:
    """The sim model calls the first tool on a user's turn (its parser, `kvlane_sim`, finds the call)."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"name": "get_weather", "description": "Weather of a city", "input_schema": schema}
    message = client.messages.create(model=MODEL, max_tokens=200, messages=user("Weather in Rome?"), tools=[tool])
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str)


def test_messages_over_nats(fleet: Fleet) -> None:
    async def scenario() -> tuple[dict, list[dict], dict]:
        nc = await nats.connect(fleet.config.nats.url)
        try:
            body = {"model": MODEL, "messages": user("Hi"), "max_tokens": 4}
            whole = await nc.request(subjects.API_MESSAGES, json.dumps(body).encode(), timeout=30)
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish(subjects.API_MESSAGES, json.dumps({**body, "stream": True}).encode(), reply=inbox)
            events = []
            while True:
                msg = await sub.next_msg(timeout=30)
                assert msg.headers[subjects.API_SEQ_HEADER] == str(len(events))
                if msg.headers.get(subjects.API_STREAM_HEADER) == subjects.API_STREAM_END:
                    break
                events.append(json.loads(msg.data))
            bad = await nc.request(subjects.API_MESSAGES, json.dumps({"model": MODEL, "messages": user("Hi")}).encode(), timeout=30)
            assert bad.headers["Nats-Service-Error-Code"] == "400"
            return json.loads(whole.data), events, json.loads(bad.data)
        finally:
            await nc.close()

    whole, events, bad = asyncio.run(scenario())
    assert whole["type"] == "message" and whole["stop_reason"] == "max_tokens" and whole["usage"]["output_tokens"] == 4
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == whole["content"][0]["text"]
    assert bad["type"] == "error"
