"""Rendering frames as OpenAI bodies and SSE chunks (services/ingress/render.py)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.messages import StreamEnd, Timings, Usage
from contracts.openai_api import ChatCompletion, ChatCompletionChunk, Completion
from services.ingress.render import DONE, ChatRenderer, CompletionRenderer, completion_usage, sse

RID, CREATED, MODEL = "chatcmpl-abc", 1_700_000_000, "kvlane-sim"


def end(prompt: int = 12, completion: int = 5, cached: int = 8, reason: str = "stop") -> StreamEnd:
    return StreamEnd(
        request_id="r1",
        seq=6,
        finish_reason=reason,
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached),
        timings=Timings(first_token_s=0.1, finished_s=0.5),
        worker_id="w1",
    )


def event(chunk: bytes | None) -> dict:
    """A chunk, checked to fit one SSE `data:` line."""
    assert chunk is not None
    line = sse(chunk)
    assert line.startswith(b"data: ")
    assert line.endswith(b"\n\n")
    payload = line[len(b"data: ") : -2]
    assert b"\n" not in payload
    return json.loads(payload)


def test_sse_framing_and_done() -> None:
    assert DONE == b"data: [DONE]\n\n"
    assert sse(b'{"a":1}') == b'data: {"a":1}\n\n'


def test_text_with_newlines_stays_on_one_sse_line() -> None:
    line = ChatRenderer(RID, CREATED, MODEL).delta("a\nb\n\nc")
    assert event(line)["choices"][0]["delta"]["content"] == "a\nb\n\nc"


def test_completion_usage_totals() -> None:
    usage = completion_usage(Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=6))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (10, 4, 14)
    assert usage.prompt_tokens_details.cached_tokens == 6


# --- chat --------------------------------------------------------------------------


def test_chat_opening_chunk_has_role_assistant() -> None:
    chunk = event(ChatRenderer(RID, CREATED, MODEL).opening())
    assert chunk["object"] == "chat.completion.chunk"
    assert (chunk["id"], chunk["created"], chunk["model"]) == (RID, CREATED, MODEL)
    assert len(chunk["choices"]) == 1
    choice = chunk["choices"][0]
    assert choice["index"] == 0
    assert choice["delta"]["role"] == "assistant"
    assert choice["delta"].get("content", "") == ""
    assert choice["finish_reason"] is None
    assert chunk.get("usage") is None
    msgspec.convert(chunk, ChatCompletionChunk)


def test_chat_delta_chunk() -> None:
    renderer = ChatRenderer(RID, CREATED, MODEL)
    chunk = event(renderer.delta(" hello"))
    choice = chunk["choices"][0]
    assert choice["delta"] == {"content": " hello"}
    assert choice["finish_reason"] is None
    assert renderer.delta("") is None


@pytest.mark.parametrize("reason", ["stop", "length", "abort"])
def test_chat_closing_chunk_has_finish_reason(reason: str) -> None:
    chunk = event(ChatRenderer(RID, CREATED, MODEL).closing(end(reason=reason)))
    assert chunk["object"] == "chat.completion.chunk"
    choice = chunk["choices"][0]
    assert choice["finish_reason"] == reason
    assert choice["delta"] == {}
    assert chunk.get("usage") is None


def test_chat_usage_chunk() -> None:
    chunk = event(ChatRenderer(RID, CREATED, MODEL).usage(end(prompt=12, completion=5, cached=8)))
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"] == []
    assert chunk["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 5,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    msgspec.convert(chunk, ChatCompletionChunk)


def test_chat_whole_body() -> None:
    raw = ChatRenderer(RID, CREATED, MODEL).whole(" hello world", end(prompt=3, completion=2, cached=0, reason="length"))
    body = msgspec.json.decode(raw, type=ChatCompletion)
    assert body.object == "chat.completion"
    assert (body.id, body.created, body.model) == (RID, CREATED, MODEL)
    assert len(body.choices) == 1
    assert body.choices[0].message.role == "assistant"
    assert body.choices[0].message.content == " hello world"
    assert body.choices[0].finish_reason == "length"
    assert body.usage.total_tokens == 5
    assert body.usage.prompt_tokens_details.cached_tokens == 0
    plain = json.loads(raw)
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"] == {"content": " hello world", "role": "assistant"}


def test_chat_stream_concatenates_to_the_text() -> None:
    renderer = ChatRenderer(RID, CREATED, MODEL)
    pieces = [" The", " cat", "", " sat", "."]
    lines = [renderer.opening(), *(renderer.delta(p) for p in pieces), renderer.closing(end())]
    chunks = [event(line) for line in lines if line is not None]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == " The cat sat."
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert {c["id"] for c in chunks} == {RID}


# --- completions ----------------------------------------------------------------------


def test_completion_has_no_opening_chunk() -> None:
    assert CompletionRenderer(RID, CREATED, MODEL).opening() is None


def test_completion_delta_and_closing() -> None:
    renderer = CompletionRenderer(RID, CREATED, MODEL)
    chunk = event(renderer.delta(" hi"))
    assert chunk["object"] == "text_completion"
    assert chunk["choices"][0]["text"] == " hi"
    assert chunk["choices"][0]["finish_reason"] is None
    assert renderer.delta("") is None
    closing = event(renderer.closing(end(reason="length")))
    assert closing["choices"][0]["text"] == ""
    assert closing["choices"][0]["finish_reason"] == "length"
    msgspec.convert(closing, Completion)


def test_completion_usage_chunk() -> None:
    chunk = event(CompletionRenderer(RID, CREATED, MODEL).usage(end(prompt=7, completion=9, cached=4)))
    assert chunk["object"] == "text_completion"
    assert chunk["choices"] == []
    assert chunk["usage"]["total_tokens"] == 16
    assert chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def test_completion_whole_body() -> None:
    raw = CompletionRenderer(RID, CREATED, MODEL).whole(" text", end(prompt=4, completion=1, cached=0))
    body = msgspec.json.decode(raw, type=Completion)
    assert body.object == "text_completion"
    assert body.choices[0].text == " text"
    assert body.choices[0].finish_reason == "stop"
    assert body.choices[0].index == 0
    assert body.usage is not None and body.usage.total_tokens == 5


@given(prompt=st.integers(0, 10**6), completion=st.integers(0, 10**6), text=st.text(max_size=30))
def test_usage_total_property(prompt: int, completion: int, text: str) -> None:
    stream_end = end(prompt=prompt, completion=completion, cached=min(prompt, 3))
    for renderer in (ChatRenderer(RID, CREATED, MODEL), CompletionRenderer(RID, CREATED, MODEL)):
        usage = event(renderer.usage(stream_end))["usage"]
        assert usage["total_tokens"] == prompt + completion
        whole = json.loads(renderer.whole(text, stream_end))
        assert whole["usage"]["total_tokens"] == prompt + completion
