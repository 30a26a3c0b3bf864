"""Rendering frames as OpenAI bodies and SSE chunks (services/ingress/render.py), shaped as vLLM's server shapes them."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.messages import (
    OutputDelta,
    ParsedOutput,
    ParsedToolCall,
    StreamEnd,
    Timings,
    TokenChunk,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from contracts.openai_api import ChatCompletion, ChatCompletionChunk, Completion, Degraded, KvlaneNotes
from services.ingress.render import (
    DONE,
    AnswerShape,
    ChatRenderer,
    CompletionRenderer,
    chat_logprobs,
    completion_logprobs,
    completion_usage,
    sse,
)

RID, CREATED, MODEL = "chatcmpl-abc", 1_700_000_000, "kvlane-sim"
PLAIN = AnswerShape()


def end(prompt: int = 12, completion: int = 5, cached: int = 8, reason: str = "stop") -> StreamEnd:
    return StreamEnd(
        request_id="r1",
        seq=6,
        finish_reason=reason,
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached),
        timings=Timings(first_token_s=0.1, finished_s=0.5),
        worker_id="w1",
    )


def chunk(text: str, seq: int = 0, **fields: object) -> TokenChunk:
    return TokenChunk("r1", seq, [7] * max(1, len(text.split())), text, **fields)


def event(raw: bytes) -> dict:
    """A chunk, checked to fit one SSE `data:` line."""
    line = sse(raw)
    assert line.startswith(b"data: ") and line.endswith(b"\n\n")
    payload = line[len(b"data: ") : -2]
    assert b"\n" not in payload
    return json.loads(payload)


def events(raws: list[bytes]) -> list[dict]:
    return [event(raw) for raw in raws]


def chat(shape: AnswerShape = PLAIN) -> ChatRenderer:
    return ChatRenderer(RID, CREATED, MODEL, shape)


def test_sse_framing_and_done() -> None:
    assert DONE == b"data: [DONE]\n\n"
    assert sse(b'{"a":1}') == b'data: {"a":1}\n\n'


def test_text_with_newlines_stays_on_one_sse_line() -> None:
    (line,) = chat().delta(chunk("a\nb\n\nc"))
    assert event(line)["choices"][0]["delta"]["content"] == "a\nb\n\nc"


def test_completion_usage_totals() -> None:
    usage = completion_usage(Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=6))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (10, 4, 14)
    assert usage.prompt_tokens_details.cached_tokens == 6
    assert usage.completion_tokens_details is None
    assert completion_usage(Usage(1, 2), reasoning_tokens=2).completion_tokens_details.reasoning_tokens == 2


# --- chat --------------------------------------------------------------------------


def test_chat_opening_chunk_per_choice_has_the_role() -> None:
    chunks = events(chat(AnswerShape(n=2)).opening())
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1]
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        assert (c["id"], c["created"], c["model"]) == (RID, CREATED, MODEL)
        assert c["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        msgspec.convert(c, ChatCompletionChunk)


def test_chat_delta_chunk_and_empty_first_frame_skipped() -> None:
    renderer = chat()
    assert renderer.delta(TokenChunk("r1", 0, [], "")) == []
    (c,) = events(renderer.delta(chunk(" hello")))
    assert c["choices"][0]["delta"] == {"content": " hello"}
    assert c["choices"][0]["finish_reason"] is None


@pytest.mark.parametrize("reason", ["stop", "length", "abort"])
def test_chat_closing_chunk_has_finish_reason(reason: str) -> None:
    (c,) = events(chat().closing(end(reason=reason)))
    assert c["choices"][0]["finish_reason"] == reason
    assert c["choices"][0]["delta"] == {}
    assert c.get("usage") is None


def test_a_choice_finished_in_its_chunk_gets_no_closing_chunk() -> None:
    renderer = chat()
    (c,) = events(renderer.delta(chunk(" done", finish_reason="stop", stop_reason="###")))
    assert (c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"]) == ("stop", "###")
    assert renderer.closing(end()) == []


def test_chat_usage_chunk() -> None:
    c = event(chat().usage([end(prompt=12, completion=5, cached=8)]))
    assert c["choices"] == []
    assert c["usage"] == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17,
                          "prompt_tokens_details": {"cached_tokens": 8}}


def test_chat_whole_body() -> None:
    renderer = chat()
    for piece in (" hello", " world"):
        renderer.add(chunk(piece))
    raw = renderer.whole([end(prompt=3, completion=2, cached=0, reason="length")])
    body = msgspec.json.decode(raw, type=ChatCompletion)
    assert body.object == "chat.completion"
    assert body.choices[0].message.content == " hello world"
    assert body.choices[0].finish_reason == "length"
    assert body.usage.total_tokens == 5
    plain = json.loads(raw)
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"] == {"content": " hello world", "role": "assistant"}


@given(st.lists(st.text(max_size=8), max_size=10))
def test_chat_stream_concatenates_to_the_text(pieces: list[str]) -> None:
    renderer = chat()
    out = events(renderer.opening() + [c for p in pieces for c in renderer.delta(chunk(p))] + renderer.closing(end()))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in out)
    assert text == "".join(pieces)
    assert out[-1]["choices"][0]["finish_reason"] == "stop"


# --- tool calls and reasoning ------------------------------------------------------------

PARSED = AnswerShape(parsed=True, auto_tools=True, tool_choice="auto")


def test_streamed_tool_call_ends_with_tool_calls() -> None:
    renderer = chat(PARSED)
    frames = [
        chunk("<tool_call>", delta=None),
        chunk('{"name": "f"', delta=OutputDelta(tool_calls=[ToolCallDelta(0, "call-1", "f", "")])),
        chunk(', "arguments": {"x": 1}}', delta=OutputDelta(tool_calls=[ToolCallDelta(0, arguments='{"x": 1}')])),
        chunk("</tool_call>", delta=None, finish_reason="stop"),
    ]
    out = events([c for f in frames for c in renderer.delta(f)])
    assert len(out) == 3  # the marker's delta says nothing
    first = out[0]["choices"][0]["delta"]["tool_calls"][0]
    assert first == {"index": 0, "id": "call-1", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert out[1]["choices"][0]["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"x": 1}'}}
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_named_tool_call_ends_with_stop() -> None:
    renderer = chat(AnswerShape(parsed=True, tool_choice="named"))
    renderer.delta(chunk("{", delta=OutputDelta(tool_calls=[ToolCallDelta(0, "c", "f", "{")])))
    (last,) = events(renderer.delta(chunk("}", delta=OutputDelta(tool_calls=[ToolCallDelta(0, arguments="}")]),
                                          finish_reason="stop")))
    assert last["choices"][0]["finish_reason"] == "stop"


def test_parallel_tool_calls_false_streams_only_the_first_call() -> None:
    renderer = chat(AnswerShape(parsed=True, auto_tools=True, tool_choice="auto", parallel_tool_calls=False))
    out = events(renderer.delta(chunk("x", delta=OutputDelta(tool_calls=[ToolCallDelta(0, "a", "f", "{}"),
                                                                          ToolCallDelta(1, "b", "g", "{}")]))))
    assert [t["index"] for t in out[0]["choices"][0]["delta"]["tool_calls"]] == [0]


def test_whole_answer_with_parsed_tool_calls() -> None:
    renderer = chat(PARSED)
    parsed = ParsedOutput(content=None, reasoning="think", tool_calls=[ParsedToolCall("f", '{"x": 1}'),
                                                                        ParsedToolCall("g", "{}", "given-id")])
    renderer.add(chunk("raw", finish_reason="stop", parsed=parsed))
    body = json.loads(renderer.whole([end()]))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["reasoning"] == "think"
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in message["tool_calls"]] == [("f", '{"x": 1}'), ("g", "{}")]
    assert message["tool_calls"][0]["id"].startswith("chatcmpl-tool-") and message["tool_calls"][1]["id"] == "given-id"
    msgspec.convert(body, ChatCompletion)


def test_tool_calls_without_an_auto_parser_stay_text() -> None:
    renderer = chat(AnswerShape(parsed=True, auto_tools=False, tool_choice="auto"))
    renderer.add(chunk("raw", finish_reason="stop", parsed=ParsedOutput(content="raw", tool_calls=[ParsedToolCall("f", "{}")])))
    choice = json.loads(renderer.whole([end()]))["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]


def test_required_tool_choice_finishes_with_tool_calls_and_empty_content() -> None:
    renderer = chat(AnswerShape(parsed=True, tool_choice="required"))
    renderer.add(chunk("[...]", finish_reason="stop", parsed=ParsedOutput(content=None, tool_calls=[ParsedToolCall("f", "{}")])))
    choice = json.loads(renderer.whole([end()]))["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == ""


def test_hidden_reasoning_drops_reasoning_and_logprobs() -> None:
    shape = AnswerShape(parsed=True, include_reasoning=False, chat_logprobs=True, top_logprobs=1)
    renderer = chat(shape)
    lp = [TokenLogprob("a", -0.5, [97], [TopLogprob("a", -0.5, [97])])]
    (c,) = events(renderer.delta(chunk("a", delta=OutputDelta(reasoning="a"), logprobs=lp)))
    assert c["choices"][0]["delta"] == {} and c["choices"][0]["logprobs"] is None


def test_reasoning_tokens_in_usage() -> None:
    renderer = chat(AnswerShape(parsed=True, reasoning_model=True))
    renderer.add(chunk("x", finish_reason="stop", parsed=ParsedOutput(content="x", reasoning="y", reasoning_tokens=3)))
    assert json.loads(renderer.whole([end()]))["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


# --- logprobs, n, echo, usage ------------------------------------------------------------

LOGPROBS = [
    TokenLogprob("a", -0.25, [97], [TopLogprob("a", -0.25, [97]), TopLogprob("b", -2.0, [98]), TopLogprob("c", float("-inf"), [99])]),
    TokenLogprob("bc", None),
]


def test_chat_logprobs_take_the_top_asked_for() -> None:
    first, second = chat_logprobs(LOGPROBS, 2)
    assert (first.token, first.logprob, first.bytes) == ("a", -0.25, [97])
    assert [t.token for t in first.top_logprobs] == ["a", "b"]
    assert (second.logprob, second.bytes, second.top_logprobs) == (-9999.0, [98, 99], [])
    assert [t.logprob for t in chat_logprobs(LOGPROBS, -1)[0].top_logprobs] == [-0.25, -2.0, -9999.0]
    assert chat_logprobs(LOGPROBS, None)[0].top_logprobs == []


def test_completion_logprobs_take_one_more_and_count_offsets() -> None:
    lp = completion_logprobs(LOGPROBS, 1, first_offset=5)
    assert lp.tokens == ["a", "bc"]
    assert lp.text_offset == [5, 6]
    assert lp.token_logprobs == [-0.25, None]
    assert lp.top_logprobs == [{"a": -0.25, "b": -2.0}, None]


def test_two_choices_stream_and_answer_apart() -> None:
    shape = AnswerShape(n=2)
    renderer = chat(shape)
    renderer.delta(chunk(" one", index=0))
    renderer.delta(chunk(" two", index=1, finish_reason="length"))
    renderer.delta(chunk(" more", index=0, finish_reason="stop"))
    whole = chat(shape)
    for f in (chunk(" one", index=0), chunk(" two", index=1, finish_reason="length"), chunk(" more", index=0, finish_reason="stop")):
        whole.add(f)
    choices = json.loads(whole.whole([end()]))["choices"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in choices] == [(0, " one more", "stop"), (1, " two", "length")]


def test_chat_echo_leads_the_answer() -> None:
    shape = AnswerShape(role="assistant", echo_text="Once upon")
    renderer = chat(shape)
    opening = events(renderer.opening())
    assert opening[-1]["choices"][0]["delta"] == {"content": "Once upon"}
    renderer.add(chunk(" a time", finish_reason="stop"))
    assert json.loads(renderer.whole([end()]))["choices"][0]["message"]["content"] == "Once upon a time"


def test_continuous_usage_counts_each_choice_so_far() -> None:
    renderer = chat(AnswerShape(prompt_tokens=4, include_usage=True, continuous_usage=True))
    assert events(renderer.opening())[0]["usage"] == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}
    (c,) = events(renderer.delta(TokenChunk("r1", 0, [1, 2], " ab")))
    assert c["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


# --- completions -------------------------------------------------------------------------


def test_completion_has_no_opening_chunk() -> None:
    assert CompletionRenderer(RID, CREATED, MODEL, PLAIN).opening() == []


def test_completion_delta_and_closing() -> None:
    renderer = CompletionRenderer(RID, CREATED, MODEL, PLAIN)
    (delta,) = events(renderer.delta(chunk(" hi")))
    assert delta["object"] == "text_completion"
    assert delta["choices"][0]["text"] == " hi" and delta["choices"][0]["finish_reason"] is None
    (closing,) = events(renderer.closing(end(reason="length")))
    assert closing["choices"][0]["text"] == "" and closing["choices"][0]["finish_reason"] == "length"
    msgspec.convert(closing, Completion)


def test_completion_batch_echo_and_logprobs() -> None:
    shape = AnswerShape(n=1, echo_text="", completion_logprobs=0)
    renderer = CompletionRenderer(RID, CREATED, MODEL, shape, prompts=2, echo_texts=["P0", "P1"])
    renderer.add(chunk("a", logprobs=LOGPROBS[:1], finish_reason="stop"), prompt_index=0)
    renderer.add(chunk("b", logprobs=LOGPROBS[:1], finish_reason="length"), prompt_index=1)
    body = json.loads(renderer.whole([end(prompt=2, completion=1), end(prompt=3, completion=1)]))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "P0a", "stop"), (1, "P1b", "length")]
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.25}]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 2
    msgspec.convert(body, Completion)


def test_streamed_completion_echoes_once_per_choice() -> None:
    renderer = CompletionRenderer(RID, CREATED, MODEL, AnswerShape(echo_text="Hi"))
    texts = [event(c)["choices"][0]["text"] for f in (chunk(" a"), chunk(" b")) for c in renderer.delta(f)]
    assert texts == ["Hi a", " b"]


@given(st.integers(0, 10_000), st.integers(0, 10_000))
def test_usage_total_property(prompt: int, completion: int) -> None:
    renderer = CompletionRenderer(RID, CREATED, MODEL, PLAIN)
    usage = event(renderer.usage([end(prompt=prompt, completion=completion)]))["usage"]
    assert usage["total_tokens"] == prompt + completion


@pytest.mark.parametrize("renderer", [chat(), CompletionRenderer(RID, CREATED, MODEL, PLAIN)], ids=["chat", "completion"])
def test_kvlanes_notes_ride_on_the_finishing_chunk_only(renderer) -> None:
    notes = KvlaneNotes(degraded=Degraded("overload", 6, 12))
    (first,) = events(renderer.delta(chunk(" a"), notes=notes))
    (last,) = events(renderer.delta(chunk(" b", finish_reason="length"), notes=notes))
    assert "kvlane" not in first and last["kvlane"]["degraded"]["max_tokens"] == 6
    assert renderer.closing(end(), notes) == []
