"""The Anthropic Messages API's translation to and from chat completions (vLLM's, mirrored)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.anthropic_api import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    StreamEvent,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from contracts.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    CompletionUsage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
)
from services.ingress.anthropic import AnthropicApiError, AnthropicMessages, MessageStream, chat_request, message_of, sse_event
from services.ingress.errors import ApiError

ENCODER = msgspec.json.Encoder()


def request(**fields: object) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=MessagesRequest)


# --- request ------------------------------------------------------------------------


def test_plain_request_becomes_a_chat_request() -> None:
    body = chat_request(request(temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["END"], metadata={"user_id": "u"}))
    assert body == {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
                    "max_completion_tokens": 16, "stop": ["END"], "temperature": 0.5, "top_p": 0.9, "top_k": 40}


def test_streaming_asks_for_usage_on_every_chunk() -> None:
    body = chat_request(request(stream=True))
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_system_as_string_or_text_blocks_without_the_billing_header() -> None:
    assert chat_request(request(system="Be brief."))["messages"][0] == {"role": "system", "content": "Be brief."}
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc=1"}, {"type": "text", "text": "Be "},
              {"type": "text", "text": "brief."}]
    assert chat_request(request(system=blocks))["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat_request(request(system=[]))["messages"][0]["role"] == "user"


def test_content_blocks_tool_use_and_tool_results() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "25C"}]}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "rain"}, {"type": "text", "text": "And?"}]},
    ]
    assert chat_request(request(messages=messages))["messages"] == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning": "Use the tool.", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny\n25C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "rain"},
        {"role": "user", "content": "And?"},
    ]


def test_image_becomes_an_image_url_part() -> None:
    content = [{"type": "text", "text": "What?"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
               {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]
    [message] = chat_request(request(messages=[{"role": "user", "content": content}]))["messages"]
    assert message["content"] == [{"type": "text", "text": "What?"},
                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "weather"}, {"type": "function", "function": {"name": "weather"}}),
])
def test_tools_and_tool_choice(choice: dict, expected: object) -> None:
    tools = [{"name": "weather", "description": "Weather of a city", "input_schema": {"properties": {"city": {"type": "string"}}}}]
    body = chat_request(request(tools=tools, tool_choice={**choice, "disable_parallel_tool_use": True}))
    assert body["tool_choice"] == expected and body["parallel_tool_calls"] is False
    assert body["tools"] == [{"type": "function", "function": {
        "name": "weather", "description": "Weather of a city",
        "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"}}}]


def test_tools_without_a_choice_are_auto() -> None:
    body = chat_request(request(tools=[{"name": "f", "input_schema": {"type": "object"}}]))
    assert body["tool_choice"] == "auto" and "parallel_tool_calls" not in body


def test_thinking_and_output_config() -> None:
    assert chat_request(request(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048))["thinking_token_budget"] == 1024
    assert chat_request(request(thinking={"type": "disabled"}))["reasoning_effort"] == "none"
    assert "reasoning_effort" not in chat_request(request(thinking={"type": "adaptive"}))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = chat_request(request(output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}}))
    assert body["reasoning_effort"] == "low"
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}


@pytest.mark.parametrize("fields", [
    {"thinking": {"type": "enabled", "budget_tokens": 4096}},  # not below max_tokens
    {"tool_choice": {"type": "tool"}},
])
def test_requests_vllm_refuses(fields: dict) -> None:
    with pytest.raises(ApiError) as caught:
        chat_request(request(**fields))
    assert caught.value.status == 400


# --- whole response ------------------------------------------------------------------


def completion(message: AssistantMessage, finish_reason: str = "stop", stop_reason: int | str | None = None,
               usage: CompletionUsage | None = None) -> ChatCompletion:
    return ChatCompletion("chatcmpl-abc", 0, "m", [ChatChoice(0, message, finish_reason, stop_reason=stop_reason)],
                          usage or CompletionUsage(10, 3, 13))


def test_text_message() -> None:
    message = message_of(completion(AssistantMessage("Hello.", "assistant")))
    assert msgspec.to_builtins(message) == {
        "type": "message", "id": "msg_abc", "role": "assistant", "content": [{"type": "text", "text": "Hello."}],
        "model": "m", "usage": {"input_tokens": 10, "output_tokens": 3}, "stop_reason": "end_turn"}


@pytest.mark.parametrize(("finish", "stop", "expected"), [
    ("length", None, ("max_tokens", None)),
    ("stop", "END", ("stop_sequence", "END")),
    ("stop", 42, ("end_turn", None)),  # a stop token id is not a stop sequence
    ("stop", None, ("end_turn", None)),
])
def test_stop_reasons(finish: str, stop: int | str | None, expected: tuple) -> None:
    message = message_of(completion(AssistantMessage("x", "assistant"), finish, stop))
    assert (message.stop_reason, message.stop_sequence) == expected


def test_thinking_text_and_tool_use_blocks() -> None:
    calls = [ToolCall("call_1", FunctionCall("weather", '{"city": "Rome"}'))]
    message = message_of(completion(AssistantMessage("Looking.", "assistant", reasoning="Hmm.", tool_calls=calls), "tool_calls"))
    thinking, text, tool = message.content
    assert isinstance(thinking, ThinkingBlock) and thinking.thinking == "Hmm." and thinking.signature
    assert text == TextBlock("Looking.")
    assert tool == ToolUseBlock("call_1", "weather", {"city": "Rome"})
    assert message.stop_reason == "tool_use"


def test_empty_answer_is_one_empty_text_block() -> None:
    assert message_of(completion(AssistantMessage("", "assistant"))).content == [TextBlock("")]


def test_cached_prompt_tokens_are_counted_apart() -> None:
    usage = CompletionUsage(10, 3, 13, prompt_tokens_details=PromptTokensDetails(cached_tokens=8))
    assert msgspec.to_builtins(message_of(completion(AssistantMessage("x", "assistant"), usage=usage)).usage) == {
        "input_tokens": 2, "output_tokens": 3, "cache_read_input_tokens": 8}


# --- stream --------------------------------------------------------------------------


def chunk(delta: ChatDelta | None = None, finish: str | None = None, stop: int | str | None = None,
          usage: CompletionUsage | None = None) -> ChatCompletionChunk:
    choices = [] if delta is None else [ChatChunkChoice(0, delta, finish, stop_reason=stop)]
    return ChatCompletionChunk("chatcmpl-abc", 0, "m", choices, usage)


def run(chunks: list[ChatCompletionChunk]) -> list[StreamEvent]:
    stream = MessageStream()
    events = [event for c in chunks for event in stream.feed(c)]
    return events + stream.finish()


def test_streamed_text() -> None:
    events = run([chunk(ChatDelta(role="assistant", content=""), usage=CompletionUsage(5, 0, 5)),
                  chunk(ChatDelta(content="Hel")), chunk(ChatDelta(content="lo"), "length"),
                  chunk(usage=CompletionUsage(5, 2, 7))])
    assert [msgspec.to_builtins(e) for e in events] == [
        {"type": "message_start", "message": {"id": "msg_abc", "model": "m", "usage": {"input_tokens": 5, "output_tokens": 0},
                                              "content": [], "stop_reason": None, "stop_sequence": None,
                                              "type": "message", "role": "assistant"}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
         "usage": {"input_tokens": 5, "output_tokens": 2}},
        {"type": "message_stop"},
    ]


def test_streamed_thinking_then_tool_call_with_text_held_back() -> None:
    events = run([
        chunk(ChatDelta(role="assistant", content="")),
        chunk(ChatDelta(reasoning="Think.")),
        chunk(ChatDelta(tool_calls=[DeltaToolCall(0, "call_1", "function", DeltaFunctionCall("weather", '{"city":'))])),
        chunk(ChatDelta(content="aside")),  # while the call is open: held back
        chunk(ChatDelta(tool_calls=[DeltaToolCall(0, function=DeltaFunctionCall(arguments=' "Rome"}'))]), "tool_calls"),
        chunk(usage=CompletionUsage(5, 9, 14)),
    ])
    shapes = [(type(e).__name__, getattr(e, "index", None), type(getattr(e, "delta", None)).__name__) for e in events]
    assert shapes == [
        ("MessageStart", None, "NoneType"),
        ("ContentBlockStart", 0, "NoneType"), ("ContentBlockDelta", 0, "ThinkingDelta"),
        ("ContentBlockDelta", 0, "SignatureDelta"), ("ContentBlockStop", 0, "NoneType"),
        ("ContentBlockStart", 1, "NoneType"), ("ContentBlockDelta", 1, "InputJsonDelta"),
        ("ContentBlockDelta", 1, "InputJsonDelta"), ("ContentBlockStop", 1, "NoneType"),
        ("ContentBlockStart", 2, "NoneType"), ("ContentBlockDelta", 2, "TextDelta"), ("ContentBlockStop", 2, "NoneType"),
        ("MessageDelta", None, "StopDelta"), ("MessageStop", None, "NoneType"),
    ]
    assert events[5].content_block == ToolUseBlock("call_1", "weather", {})
    assert events[-2].delta.stop_reason == "tool_use"


def test_stop_string_cutting_a_tool_call_short_is_a_stop_sequence() -> None:
    events = run([chunk(ChatDelta(tool_calls=[DeltaToolCall(0, "c", "function", DeltaFunctionCall("f", '{"a":'))]), "stop", "END"),
                  chunk(usage=CompletionUsage(1, 1, 2))])
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", "END")


def test_sse_framing() -> None:
    assert sse_event(MessageStop()) == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert sse_event(ContentBlockStop(2)) == b'event: content_block_stop\ndata: {"type":"content_block_stop","index":2}\n\n'


texts = st.sampled_from(["", "a", "bc", " d"])
deltas = st.one_of(
    st.builds(lambda t: ChatDelta(content=t), texts),
    st.builds(lambda t: ChatDelta(reasoning=t), texts),
    st.builds(lambda t, c: ChatDelta(content=t, reasoning=c), texts, texts),
    st.builds(lambda i, name, args: ChatDelta(tool_calls=[DeltaToolCall(i, f"call_{i}", "function", DeltaFunctionCall(name, args))]),
              st.integers(0, 2), st.sampled_from(["f", None]), st.sampled_from([None, "", "{", '{"a": 1}'])),
    st.builds(lambda i, args: ChatDelta(tool_calls=[DeltaToolCall(i, function=DeltaFunctionCall(arguments=args))]),
              st.integers(0, 3), st.sampled_from(["", "}", '"x"'])),
)
chunks = st.one_of(
    st.builds(chunk, deltas, st.sampled_from([None, None, "stop", "length", "tool_calls"]), st.sampled_from([None, "END", 7])),
    st.builds(lambda n: chunk(usage=CompletionUsage(3, n, 3 + n)), st.integers(0, 9)),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(chunks, max_size=25))
def test_any_chunks_give_a_well_formed_stream(stream_chunks: list[ChatCompletionChunk]) -> None:
    events = run(stream_chunks)
    assert isinstance(events[0], MessageStart) and isinstance(events[-1], MessageStop)
    assert isinstance(events[-2], MessageDelta)
    assert sum(isinstance(e, (MessageStart, MessageDelta, MessageStop)) for e in events) == 3
    open_block, opened = None, 0
    for event in events[1:-2]:
        if isinstance(event, ContentBlockStart):
            assert open_block is None and event.index == opened
            open_block, opened = event.content_block, opened + 1
        elif isinstance(event, ContentBlockDelta):
            assert open_block is not None and event.index == opened - 1
            allowed = {TextBlock: ("text_delta",), ThinkingBlock: ("thinking_delta", "signature_delta"),
                       ToolUseBlock: ("input_json_delta",)}[type(open_block)]
            assert type(event.delta).__struct_config__.tag in allowed
        else:
            assert isinstance(event, ContentBlockStop) and open_block is not None and event.index == opened - 1
            open_block = None
    assert open_block is None
    # Every piece of text before the stream's end arrives, in order (some held back while a tool call was open).
    delivered = next((i for i, c in enumerate(stream_chunks) if not c.choices), len(stream_chunks))
    sent = "".join(c.choices[0].delta.content or "" for c in stream_chunks[:delivered])
    got = "".join(e.delta.text for e in events if isinstance(e, ContentBlockDelta) and hasattr(e.delta, "text"))
    assert sorted(got) == sorted(sent)
    for event in events:  # each event encodes and names itself
        assert json.loads(sse_event(event).split(b"\ndata: ")[1])["type"] == sse_event(event).split(b"\n")[0][7:].decode()


# --- errors and the shell ------------------------------------------------------------


def test_errors_in_anthropic_shape() -> None:
    error = AnthropicApiError.of(ApiError(404, "The model `x` does not exist", code="model_not_found", retry_after_s=None))
    assert json.loads(error.response().body) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                             "message": "The model `x` does not exist"}}
    assert error.response().status == 404


class NoAuthCompletions:
    async def authenticate(self, headers: object, model: object) -> None:
        return None


@pytest.mark.parametrize(("body", "said"), [
    ({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 0, "messages": []}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "type"),
])
def test_bad_requests_are_anthropic_400s(body: dict, said: str) -> None:
    messages = AnthropicMessages(NoAuthCompletions())  # type: ignore[arg-type]
    with pytest.raises(AnthropicApiError) as caught:
        asyncio.run(messages.start(json.dumps(body).encode(), lambda: False))
    assert caught.value.status == 400 and said in caught.value.message
    assert msgspec.to_builtins(caught.value.body())["type"] == "error"
