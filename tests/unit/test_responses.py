"""The Responses API's translation to and from chat completions (vLLM's non-harmony path, mirrored)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec
import openai.types.responses as oai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from contracts.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    CompletionTokensDetails,
    CompletionUsage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
)
from contracts.responses_api import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ResponsesRequest,
    StoredResponse,
)
from services.ingress.errors import ApiError
from services.ingress.responses import (
    ResponseDraft,
    Responses,
    ResponseStream,
    chat_request,
    history_of,
    output_of,
    sse_event,
)

ENCODER = msgspec.json.Encoder()
EVENTS = TypeAdapter(oai.ResponseStreamEvent)


def request(**fields: object) -> ResponsesRequest:
    body = {"model": "m", "input": "Hi", **fields}
    return msgspec.json.decode(json.dumps(body), type=ResponsesRequest)


def draft(**fields: object) -> ResponseDraft:
    return ResponseDraft("resp_1", 1700000000, "m", request(**fields), max_tokens_default=512, max_model_len=4096)


def sdk_response(response: object) -> oai.Response:
    """The response as the openai SDK reads it (a field it cannot read fails here)."""
    return oai.Response.model_validate(json.loads(ENCODER.encode(response)))


# --- request ------------------------------------------------------------------------


def test_text_input_and_instructions_become_system_and_user_messages() -> None:
    body, messages = chat_request(request(instructions="Be brief.", max_output_tokens=8, temperature=0.5, top_p=0.9))
    assert body == {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                    "max_tokens": 8, "temperature": 0.5, "top_p": 0.9}
    assert messages == body["messages"]


def test_streaming_asks_for_usage_on_every_chunk() -> None:
    body, _ = chat_request(request(stream=True))
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_items_become_chat_messages_with_calls_merged_into_the_assistant_turn() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\":\"Oslo\"}"},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    _, messages = chat_request(request(input=items))
    assert messages == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "reasoning": "Look it up.", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1"},
        {"role": "tool", "content": [{"type": "text", "text": "noon"}], "tool_call_id": "c2"},
    ]


def test_a_partial_assistant_message_last_is_continued() -> None:
    body, _ = chat_request(request(input=[{"role": "user", "content": "Count"},
                                          {"type": "message", "role": "assistant", "status": "incomplete",
                                           "content": [{"type": "output_text", "text": "1, 2,"}]}]))
    assert body["add_generation_prompt"] is False and body["continue_final_message"] is True


@pytest.mark.parametrize(("item", "message"), [
    ({"type": "reasoning", "summary": [], "encrypted_content": "xx"}, "Encrypted content is not supported."),
    ({"type": "web_search_call", "id": "ws_1"}, "Unsupported input item type: web_search_call"),
])
def test_unsupported_items_are_a_400(item: dict, message: str) -> None:
    with pytest.raises(ApiError) as caught:
        chat_request(request(input=[item]))
    assert caught.value.status == 400 and caught.value.message == message


def test_function_tools_and_tool_choice_become_chat_tools() -> None:
    tools = [{"type": "function", "name": "weather", "description": "Weather of a city", "strict": True,
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
             {"type": "web_search_preview"}]
    body, _ = chat_request(request(tools=tools, tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False))
    assert body["tools"] == [{"type": "function", "function": {
        "name": "weather", "description": "Weather of a city", "parameters": tools[0]["parameters"], "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert body["parallel_tool_calls"] is False
    auto, _ = chat_request(request(tools=tools))
    assert auto["tool_choice"] == "auto"


@pytest.mark.parametrize(("fields", "message"), [
    ({"tool_choice": "required"}, "Tool choice 'required' must be specified with 'tools' parameter."),
    ({"tool_choice": {"type": "function", "name": "x"}}, "Tool choice 'function' not found in 'tools' parameter."),
    ({"tools": [{"type": "function", "name": "y"}], "tool_choice": {"type": "function", "name": "x"}},
     "Tool choice 'function' not found in 'tools' parameter."),
    ({"prompt": {"id": "p"}}, "prompt template is not supported"),
])
def test_tool_choice_misfits_are_a_400(fields: dict, message: str) -> None:
    with pytest.raises(ApiError) as caught:
        chat_request(request(**fields))
    assert caught.value.status == 400 and caught.value.message == message


def test_text_format_and_reasoning_effort() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body, _ = chat_request(request(text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
                                   reasoning={"effort": "low"}))
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    assert body["reasoning_effort"] == "low" and body["chat_template_kwargs"] == {"enable_thinking": True}
    body, _ = chat_request(request(text={"format": {"type": "json_object"}}, reasoning={"effort": "none"},
                                   chat_template_kwargs={"enable_thinking": True}))
    assert body["response_format"] == {"type": "json_object"}
    assert body["chat_template_kwargs"] == {"enable_thinking": True}  # the caller's own word wins
    plain, _ = chat_request(request(text={"format": {"type": "text"}}))
    assert "response_format" not in plain


def test_previous_response_history_comes_before_the_new_input_without_its_instructions() -> None:
    previous = StoredResponse(
        draft().response("completed", [ReasoningItem("rs_1"), OutputMessage("msg_1", [OutputText("Hello!")]),
                                       FunctionCallItem("{}", "c1", "time", "fc_1")], None),
        [{"role": "system", "content": "Old rules."}, {"role": "user", "content": "Hi"}])
    assert history_of(previous) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "time", "arguments": "{}"}}]}]
    _, messages = chat_request(request(instructions="New rules.", input=[
        {"type": "function_call_output", "call_id": "c1", "output": "noon"}]), previous)
    assert messages[0] == {"role": "system", "content": "New rules."}
    assert messages[1:3] == history_of(previous) and messages[3]["role"] == "tool"


# --- response -----------------------------------------------------------------------


def completion(content: str | None = "Hello there", reasoning: str | None = None, calls: list[ToolCall] | None = None,
               finish_reason: str = "stop") -> ChatCompletion:
    usage = CompletionUsage(7, 3, 10, prompt_tokens_details=PromptTokensDetails(4),
                            completion_tokens_details=CompletionTokensDetails(1))
    message = AssistantMessage(content, "assistant", reasoning=reasoning, tool_calls=calls or [])
    return ChatCompletion("chatcmpl-1", 1, "m", [ChatChoice(0, message, finish_reason)], usage)


def test_a_whole_answer_becomes_reasoning_message_and_calls() -> None:
    chat = completion("Sunny.", reasoning="Think.", calls=[ToolCall("c1", FunctionCall("weather", "{\"city\":\"Oslo\"}"))],
                      finish_reason="tool_calls")
    response = draft(instructions="Be brief.", metadata={"k": "v"}).whole(chat, parsed=True)
    sdk = sdk_response(response)
    assert [item.type for item in sdk.output] == ["reasoning", "message", "function_call"]
    assert sdk.output_text == "Sunny."
    assert sdk.output[0].content[0].text == "Think."
    call = sdk.output[2]
    assert (call.call_id, call.name, call.arguments) == ("c1", "weather", "{\"city\":\"Oslo\"}")
    assert sdk.status == "completed" and sdk.incomplete_details is None
    assert sdk.id == "resp_1" and sdk.object == "response" and sdk.created_at == 1700000000
    assert sdk.instructions == "Be brief." and sdk.metadata == {"k": "v"} and sdk.tool_choice == "none"
    assert (sdk.temperature, sdk.top_p, sdk.max_output_tokens, sdk.parallel_tool_calls) == (1.0, 1.0, 512, True)
    usage = sdk.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (7, 3, 10)
    assert usage.input_tokens_details.cached_tokens == 4 and usage.output_tokens_details.reasoning_tokens == 1


def test_max_tokens_reached_is_incomplete() -> None:
    sdk = sdk_response(draft(max_output_tokens=3).whole(completion(finish_reason="length"), parsed=False))
    assert sdk.status == "incomplete" and sdk.incomplete_details.reason == "max_output_tokens"
    assert sdk.max_output_tokens == 3


def test_an_empty_answer_is_an_empty_message_only_without_a_parser() -> None:
    [item] = output_of(completion(""), parsed=False)
    assert isinstance(item, OutputMessage) and item.content == []
    assert output_of(completion(""), parsed=True) == []


# --- stream -------------------------------------------------------------------------


def chunk(delta: ChatDelta | None = None, finish_reason: str | None = None, usage: CompletionUsage | None = None) -> ChatCompletionChunk:
    choices = [] if delta is None else [ChatChunkChoice(0, delta, finish_reason)]
    return ChatCompletionChunk("chatcmpl-1", 1, "m", choices, usage)


def run_stream(chunks: list[ChatCompletionChunk], **fields: object) -> list[dict[str, Any]]:
    stream = ResponseStream(draft(**fields))
    events = [event for c in chunks for event in stream.feed(c)] + stream.finish()
    as_json = [json.loads(ENCODER.encode(event)) for event in events]
    for event in as_json:
        EVENTS.validate_python(event)  # each event reads as the openai SDK's event of its type
    return as_json


def test_streamed_text_makes_vllms_event_sequence() -> None:
    events = run_stream([chunk(ChatDelta(role="assistant", content=""), usage=CompletionUsage(5, 0, 5)),
                         chunk(ChatDelta(content="Hel")), chunk(ChatDelta(content="lo"), "length"),
                         chunk(usage=CompletionUsage(5, 2, 7))], max_output_tokens=2)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[6]["text"] == "Hello"
    final = oai.Response.model_validate(events[-1]["response"])
    assert final.status == "incomplete" and final.output_text == "Hello" and final.usage.output_tokens == 2
    assert final.output[0].id == events[2]["item"]["id"]


def test_streamed_reasoning_then_calls_open_one_item_each() -> None:
    events = run_stream([
        chunk(ChatDelta(reasoning="Hmm")),
        chunk(ChatDelta(content="Let me check.")),
        chunk(ChatDelta(tool_calls=[DeltaToolCall(0, "c1", "function", DeltaFunctionCall("weather", ""))])),
        chunk(ChatDelta(tool_calls=[DeltaToolCall(0, function=DeltaFunctionCall(arguments="{\"city\":"))])),
        chunk(ChatDelta(tool_calls=[DeltaToolCall(0, function=DeltaFunctionCall(arguments="\"Oslo\"}"))])),
        chunk(ChatDelta(tool_calls=[DeltaToolCall(1, "c2", "function", DeltaFunctionCall("time", "{}"))]), "tool_calls"),
        chunk(usage=CompletionUsage(5, 9, 14)),
    ], tools=[{"type": "function", "name": "weather"}, {"type": "function", "name": "time"}])
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [item["type"] for item in added] == ["reasoning", "message", "function_call", "function_call"]
    assert [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"] == ["{\"city\":", "\"Oslo\"}", "{}"]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == [("weather", "{\"city\":\"Oslo\"}"), ("time", "{}")]
    final = oai.Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert [item.call_id for item in final.output[2:]] == ["c1", "c2"] and final.status == "completed"


def test_sse_lines_name_each_event() -> None:
    stream = ResponseStream(draft())
    [created, _] = stream.feed(chunk(ChatDelta(content="")))
    frame = sse_event(created).decode()
    event_line, data_line, *_ = frame.split("\n")
    assert frame.endswith("\n\n") and event_line == "event: response.created"
    assert json.loads(data_line.removeprefix("data: "))["type"] == "response.created"


def test_an_error_mid_stream_ends_it_with_an_error_event() -> None:
    stream = ResponseStream(draft())
    opened = stream.feed(chunk(ChatDelta(content="Hi")))
    [error] = stream.fail(ApiError(502, "worker lost", code="stream_incomplete"))
    assert json.loads(ENCODER.encode(error)) == {"type": "error", "sequence_number": len(opened), "code": "stream_incomplete",
                                                 "message": "worker lost", "param": None}
    assert stream.finish() == [] and stream.fail(ApiError(500, "again")) == []


delta_strategy = st.builds(
    ChatDelta,
    role=st.sampled_from([None, "assistant"]),
    content=st.one_of(st.none(), st.text(max_size=5)),
    reasoning=st.one_of(st.none(), st.text(max_size=5)),
    tool_calls=st.lists(st.builds(
        DeltaToolCall, index=st.integers(0, 2), id=st.one_of(st.none(), st.sampled_from(["c1", "c2"])),
        function=st.one_of(st.none(), st.builds(DeltaFunctionCall, name=st.one_of(st.none(), st.sampled_from(["f", "g"])),
                                                arguments=st.one_of(st.none(), st.text(max_size=4))))), max_size=3),
)
chunk_strategy = st.builds(
    lambda delta, finish, usage: chunk(delta, finish, usage),
    st.one_of(st.none(), delta_strategy),
    st.sampled_from([None, "stop", "length", "tool_calls"]),
    st.one_of(st.none(), st.builds(lambda p, c: CompletionUsage(p, c, p + c), st.integers(0, 99), st.integers(0, 99))),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(chunk_strategy, max_size=12))
def test_any_chunks_make_a_well_formed_event_sequence(chunks: list[ChatCompletionChunk]) -> None:
    events = run_stream(chunks)
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert types.count("response.created") == types.count("response.completed") == 1
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    open_item: dict | None = None
    done_items = []
    for event in events[2:-1]:
        if event["type"] == "response.output_item.added":
            assert open_item is None and event["output_index"] == len(done_items)
            open_item = event["item"]
        elif event["type"] == "response.output_item.done":
            assert open_item is not None and event["item"]["id"] == open_item["id"] and event["output_index"] == len(done_items)
            done_items.append(event["item"])
            open_item = None
        else:  # every delta, part and done event belongs to the open item
            assert open_item is not None and event["item_id"] == open_item["id"] and event["output_index"] == len(done_items)
    assert open_item is None
    assert events[-1]["response"]["output"] == done_items


# --- the shell ----------------------------------------------------------------------


class FakeAnswer:
    def __init__(self, chat: ChatCompletion, stream: bool) -> None:
        self.stream, self.request_id, self._chat = stream, "r1", chat
        self.closed = False

    def degraded_header(self) -> dict[str, str]:
        return {}

    async def body(self) -> bytes:
        return ENCODER.encode(self._chat)

    async def chunks(self) -> AsyncIterator[bytes]:
        yield ENCODER.encode(chunk(ChatDelta(role="assistant", content=""), usage=CompletionUsage(5, 0, 5)))
        yield ENCODER.encode(chunk(ChatDelta(content=self._chat.choices[0].message.content), "stop"))
        yield ENCODER.encode(chunk(usage=self._chat.usage))

    async def aclose(self, error: BaseException | None = None) -> None:
        self.closed = True


class FakeCompletions:
    """The chat path, answering each chat request with `answer` and keeping the bodies it was given."""

    def __init__(self, content: str = "Hello there") -> None:
        self.bodies: list[dict] = []
        self.content = content

    async def authenticate(self, headers: object, model: str | None) -> None:
        return None

    async def resolve(self, name: str | None) -> tuple[object, object]:
        return SimpleNamespace(model="m", max_model_len=4096, tool_call_parser="", reasoning_parser=""), None

    async def start(self, operation: object, payload: bytes, caller_gone: object, headers: object = None) -> FakeAnswer:
        body = json.loads(payload)
        self.bodies.append(body)
        return FakeAnswer(completion(self.content), bool(body.get("stream")))


class MemoryStore:
    def __init__(self) -> None:
        self.kept: dict[str, StoredResponse] = {}

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.kept.get(response_id)

    async def put(self, stored: StoredResponse) -> None:
        self.kept[stored.response.id] = msgspec.json.decode(ENCODER.encode(stored), type=StoredResponse)


def test_stored_responses_continue_and_unknown_ones_are_a_404() -> None:
    async def scenario() -> None:
        chat, store = FakeCompletions(), MemoryStore()
        responses = Responses(chat, store, 512)  # type: ignore[arg-type]
        async with await responses.start(ENCODER.encode({"input": "Hi", "instructions": "Rules."}), lambda: False) as first:
            body = json.loads(await first.body())
        assert body["model"] == "m" and body["id"] in store.kept
        assert json.loads(await responses.retrieve(body["id"])) == body
        payload = {"model": "m", "input": "More", "previous_response_id": body["id"], "stream": True}
        async with await responses.start(ENCODER.encode(payload), lambda: False) as second:
            events = [json.loads(ENCODER.encode(e)) async for e in second.events()]
        assert chat.bodies[1]["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                                              {"role": "user", "content": "More"}]
        completed = events[-1]["response"]
        assert completed["previous_response_id"] == body["id"] and store.kept[completed["id"]].response.output
        async with await responses.start(ENCODER.encode({"input": "x", "store": False}), lambda: False) as unstored:
            assert json.loads(await unstored.body())["id"] not in store.kept
        for missing in (responses.start(ENCODER.encode({"input": "x", "previous_response_id": "resp_nope"}), lambda: False),
                        responses.retrieve("resp_nope")):
            with pytest.raises(ApiError) as caught:
                await missing
            assert caught.value.status == 404 and caught.value.message == "Response with id 'resp_nope' not found."

    asyncio.run(scenario())
