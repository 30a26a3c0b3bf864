"""Tool calls, structured outputs, logprobs and `n` on a sim fleet, through the real openai SDK.

The sim engine scripts what these ask for (a call in its `<tool_call>` format,
JSON for a schema), its `kvlane_sim` parser turns calls into OpenAI tool calls,
and every piece is a function of (seed, prompt): a stream cut by a SIGKILLed
worker and resumed elsewhere reads exactly as an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import openai
import pytest

from launch.fleet import Fleet
from tests.integration.conftest import MODEL, launch, stop_and_check
from tests.integration.test_faults import counter_total, kill_when_streaming

pytestmark = pytest.mark.integration

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
}, "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": ["string", "null"]}},
                "required": ["street"]},
}, "required": ["name", "age", "address"]}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    fleet = launch(tmp_path_factory.mktemp("sim-api"), workers=1)
    yield fleet
    stop_and_check(fleet)


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def streamed_chat(stream) -> tuple[str, list[dict], str | None]:
    """A streamed chat answer reassembled: content, tool calls (by index) and the finish reason."""
    content, calls, finish = [], {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(("tool_choice", "finish"), [
    (None, "tool_calls"), ("auto", "tool_calls"), ("required", "tool_calls"),
    ({"type": "function", "function": {"name": "get_time"}}, "stop"),
])
def test_tool_calls_whole_and_streamed(client: openai.OpenAI, tool_choice, finish: str) -> None:
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    expected_tool = "get_time" if isinstance(tool_choice, dict) else "get_weather"
    schema = TIME if isinstance(tool_choice, dict) else WEATHER
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300, seed=3, **extra)
    choice = whole.choices[0]
    assert choice.finish_reason == finish
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == expected_tool and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert not choice.message.content
    content, calls, streamed_finish = streamed_chat(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300, seed=3, stream=True, **extra))
    assert streamed_finish == finish and content == ""
    assert calls == [{"id": call.id, "name": call.function.name, "arguments": call.function.arguments}]


def test_a_tool_result_is_answered_in_text(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300, seed=5)
    call = first.choices[0].message.tool_calls[0]
    conversation = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, max_tokens=10, seed=5)
    assert answer.choices[0].finish_reason == "length"
    assert not answer.choices[0].message.tool_calls
    assert len(answer.choices[0].message.content.split()) == 10


def test_json_schema_answers_are_valid(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format, max_tokens=400, seed=9)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    content, calls, finish = streamed_chat(client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=response_format, max_tokens=400, seed=9, stream=True))
    assert (content, calls, finish) == (whole.choices[0].message.content, [], "stop")
    completion = client.completions.create(model=MODEL, prompt="A person:", max_tokens=400, seed=9,
                                           extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)
    cut = client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format, max_tokens=5, seed=9)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == whole.choices[0].message.content[:5]


def test_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, seed=2, logprobs=True, top_logprobs=3)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 6 and "".join(e.token for e in entries) == chat.choices[0].message.content
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    again = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, seed=2, logprobs=True, top_logprobs=3)
    assert again.choices[0].logprobs == chat.choices[0].logprobs
    completion = client.completions.create(model=MODEL, prompt="Once", max_tokens=4, seed=2, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(top) == 3 for top in logprobs.top_logprobs)


def test_n_choices(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, seed=4, n=2)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].message.content != whole.choices[1].message.content
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage.completion_tokens == 16
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, seed=4, n=2, stream=True)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices} and finishes == {0: "length", 1: "length"}
    calls = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300, seed=4, n=2)
    for choice in calls.choices:
        assert choice.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER)


def test_without_a_tool_call_parser_tool_choices_are_refused(tmp_path: Path) -> None:
    fleet = launch(tmp_path, workers=1, tool_call_parser="")
    try:
        client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
        for tool_choice in ("auto", "required"):
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=5)
            assert caught.value.body["param"] == "tool_choice"
        schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
        reply = client.chat.completions.create(model=MODEL, messages=ASK, response_format=schema, max_tokens=400)
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    finally:
        stop_and_check(fleet)


# --- migration ---------------------------------------------------------------------------------

# Long answers, so that a stream is still running when its worker is killed.
NOTES = {"type": "object", "properties": {
    "notes": {"type": "array", "items": {"type": "string", "minLength": 30, "maxLength": 40}, "minItems": 14, "maxItems": 14},
}, "required": ["notes"]}
LONG_TOOLS = [{"type": "function", "function": {"name": "take_notes", "parameters": NOTES}}]


def migration_requests() -> list[dict]:
    requests = []
    for index in range(4):
        messages = [{"role": "user", "content": f"take notes, request {index}"}]
        requests.append({"messages": messages, "tools": LONG_TOOLS, "seed": index})
        requests.append({"messages": messages, "seed": index,
                         "response_format": {"type": "json_schema", "json_schema": {"name": "notes", "schema": NOTES}}})
    return requests


async def streamed(client: openai.AsyncOpenAI, request: dict) -> tuple[str, list[dict], str | None]:
    stream = await client.chat.completions.create(model=MODEL, max_tokens=1000, stream=True, **request)
    content, calls, finish = [], {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


async def test_sigkill_mid_stream_under_tools_and_a_schema_resumes_exactly(tmp_path: Path) -> None:
    # Slowed down, so the answers (~600 tokens) stream for seconds.
    fleet = launch(tmp_path, workers=3, speed=0.25)
    try:
        client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        async with client:
            requests = migration_requests()
            running = asyncio.gather(*(streamed(client, r) for r in requests))
            victim = await asyncio.to_thread(kill_when_streaming, fleet, 1, 30)
            interrupted = await running
            migrated = await counter_total(f"{fleet.base_url}/metrics", "kvlane_ingress_migrations")
            assert migrated >= 1, f"nothing ran on {victim} when it was killed"
            uninterrupted = await asyncio.gather(*(streamed(client, r) for r in requests))
        assert interrupted == uninterrupted
        for (content, calls, finish), request in zip(uninterrupted, requests, strict=True):
            answer = json.loads(calls[0]["arguments"]) if "tools" in request else json.loads(content)
            jsonschema.validate(answer, NOTES)
            assert finish == ("tool_calls" if "tools" in request else "stop")
    finally:
        fleet.stop()
