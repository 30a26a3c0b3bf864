"""The real `openai` SDK against kvlane (one vllm worker, hermes tool calls, qwen3 reasoning).

Tool calls (tool_choice auto, required and named; streaming and not) must come
back as `tool_calls` whose parsed arguments validate against the tool's JSON
schema, and `response_format` json_schema output must validate against its
schema. The tiny model is random, so it is steered into complete, valid calls
as in tests/vllm/api_shapes.py: thinking off (structured outputs start after
the reasoning), strict tools with whitespace tokens banned (else the
structural tag's JSON fills up with whitespace), and under tool_choice auto a
`structured_outputs` regex in the hermes format.

Still to come (not tests yet: placeholders for the shapes that will be added
once kvlane serves them):

TODO_SHAPES = [
    "responses_api_create_text",            # client.responses.create(model, input="...") -> output_text
    "responses_api_stream",                 # client.responses.stream(...) events reassembled
    "responses_api_function_tools",         # tools=[{"type": "function", ...}], tool_choice required -> function_call items
    "responses_api_previous_response_id",   # a second turn chained by previous_response_id
    "responses_api_reasoning",              # reasoning items with the qwen3 parser
    "anthropic_messages_create",            # anthropic.Anthropic(base_url=kvlane).messages.create(...)
    "anthropic_messages_stream",            # client.messages.stream(...) text deltas
    "anthropic_tool_use",                   # tools + tool_choice {"type": "tool", "name": ...} -> tool_use blocks
    "anthropic_tool_result_history",        # tool_result content blocks in the history
    "anthropic_thinking",                   # thinking blocks from the reasoning parser
]
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from launch.fleet import Fleet
from tests.vllm.api_shapes import HERMES_TIME, HERMES_WEATHER, LOOSE_TOOLS, TIME_SCHEMA, TOOLS, WEATHER_SCHEMA, whitespace_token_ids
from tests.vllm.conftest import MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris today, and should I bring tea?"}]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["paris", "rome"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["city", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(api_fleet: Fleet) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api_fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def ban_whitespace(tiny_model: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    return {str(i): -100 for i in whitespace_token_ids(AutoTokenizer.from_pretrained(str(tiny_model)))}


def validated(calls: list[tuple[str, str]], allowed: set[str]) -> None:
    assert calls, "no tool calls"
    for name, arguments in calls:
        assert name in allowed, (name, allowed)
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def calls_of(completion: openai.types.chat.ChatCompletion) -> list[tuple[str, str]]:
    choice = completion.choices[0]
    assert choice.finish_reason in ("tool_calls", "stop"), choice
    return [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]


def streamed_calls(stream: openai.Stream) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish_reason = None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, ["", ""])
                if call.function and call.function.name:
                    slot[0] += call.function.name
                if call.function and call.function.arguments:
                    slot[1] += call.function.arguments
            finish_reason = choice.finish_reason or finish_reason
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))], finish_reason


def tool_request(tool_choice: object, ban_whitespace: dict[str, int], **extra: object) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 100, "tools": TOOLS,
            "tool_choice": tool_choice, "logit_bias": ban_whitespace, "extra_body": NO_THINKING, **extra}


def forced_request(regex: str, **extra: object) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 160, "tools": LOOSE_TOOLS,
            "tool_choice": "auto", "extra_body": {**NO_THINKING, "structured_outputs": {"regex": regex}}, **extra}


def test_tool_choice_auto(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(**forced_request(HERMES_WEATHER))
    validated(calls_of(completion), {"get_weather"})
    assert completion.choices[0].finish_reason == "tool_calls"


def test_tool_choice_auto_parallel_streamed(client: openai.OpenAI) -> None:
    calls, finish_reason = streamed_calls(client.chat.completions.create(**forced_request(HERMES_WEATHER + r"\n" + HERMES_TIME),
                                                                        stream=True))
    validated(calls, {"get_weather", "get_time"})
    assert [name for name, _ in calls] == ["get_weather", "get_time"] and finish_reason == "tool_calls"


def test_tool_choice_required(client: openai.OpenAI, ban_whitespace: dict[str, int]) -> None:
    completion = client.chat.completions.create(**tool_request("required", ban_whitespace, parallel_tool_calls=False))
    validated(calls_of(completion), set(SCHEMAS))


def test_tool_choice_required_streamed(client: openai.OpenAI, ban_whitespace: dict[str, int]) -> None:
    calls, _ = streamed_calls(client.chat.completions.create(**tool_request("required", ban_whitespace, parallel_tool_calls=False),
                                                             stream=True))
    validated(calls, set(SCHEMAS))


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_tool_choice_named(client: openai.OpenAI, ban_whitespace: dict[str, int], name: str) -> None:
    completion = client.chat.completions.create(**tool_request({"type": "function", "function": {"name": name}}, ban_whitespace))
    calls = calls_of(completion)
    validated(calls, {name})
    assert len(calls) == 1


def test_tool_choice_named_streamed(client: openai.OpenAI, ban_whitespace: dict[str, int]) -> None:
    request = tool_request({"type": "function", "function": {"name": "get_weather"}}, ban_whitespace)
    calls, _ = streamed_calls(client.chat.completions.create(**request, stream=True))
    validated(calls, {"get_weather"})
    assert len(calls) == 1


def test_tool_choice_none_gives_text(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12, tools=TOOLS,
                                                tool_choice="none", extra_body=NO_THINKING)
    assert not completion.choices[0].message.tool_calls and completion.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client: openai.OpenAI, ban_whitespace: dict[str, int], stream: bool) -> None:
    request = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 48, "logit_bias": ban_whitespace,
               "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": ANSWER_SCHEMA}},
               "extra_body": NO_THINKING}
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**request, stream=True)
                       if chunk.choices)
    else:
        completion = client.chat.completions.create(**request)
        assert completion.choices[0].finish_reason == "stop"
        text = completion.choices[0].message.content
    jsonschema.validate(json.loads(text), ANSWER_SCHEMA)


def test_response_format_parse(client: openai.OpenAI, ban_whitespace: dict[str, int]) -> None:
    """The SDK's own structured-output helper: `beta.chat.completions.parse` / `chat.completions.parse`."""
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    completion = parse(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=48, logit_bias=ban_whitespace,
                       response_format={"type": "json_schema", "json_schema": {"name": "answer", "strict": True,
                                                                              "schema": ANSWER_SCHEMA}},
                       extra_body=NO_THINKING)
    jsonschema.validate(json.loads(completion.choices[0].message.content), ANSWER_SCHEMA)
