"""Rendering relayed frames as OpenAI response bodies and stream chunks (pure).

A chunk is the JSON of one `chat.completion.chunk` (or `text_completion`);
HTTP frames each as an SSE `data:` line, the NATS API publishes each as one
message.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from contracts.messages import StreamEnd, Usage
from contracts.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionUsage,
    KvlaneNotes,
    NotedChatCompletion,
    NotedChatCompletionChunk,
    NotedCompletion,
    PromptTokensDetails,
)

_ENCODER = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def sse(chunk: bytes) -> bytes:
    """One SSE event carrying `chunk` (JSON without newlines)."""
    return b"data: " + chunk + b"\n\n"


def completion_usage(usage: Usage) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


class Renderer(Protocol):
    def opening(self) -> bytes | None: ...

    def delta(self, text: str) -> bytes | None: ...

    def closing(self, end: StreamEnd, notes: KvlaneNotes | None = None) -> bytes: ...

    def usage(self, end: StreamEnd) -> bytes: ...

    def whole(self, text: str, end: StreamEnd, notes: KvlaneNotes | None = None) -> bytes: ...


class ChatRenderer:
    def __init__(self, response_id: str, created: int, model: str) -> None:
        self._id, self._created, self._model = response_id, created, model

    def _chunk(self, choices: list[ChatChunkChoice], usage: CompletionUsage | None = None, notes: KvlaneNotes | None = None) -> bytes:
        if notes is not None:
            return _ENCODER.encode(NotedChatCompletionChunk(self._id, self._created, self._model, choices, usage, kvlane=notes))
        return _ENCODER.encode(ChatCompletionChunk(self._id, self._created, self._model, choices, usage))

    def opening(self) -> bytes | None:
        return self._chunk([ChatChunkChoice(0, ChatDelta(role="assistant", content=""))])

    def delta(self, text: str) -> bytes | None:
        return self._chunk([ChatChunkChoice(0, ChatDelta(content=text))]) if text else None

    def closing(self, end: StreamEnd, notes: KvlaneNotes | None = None) -> bytes:
        return self._chunk([ChatChunkChoice(0, ChatDelta(), end.finish_reason)], notes=notes)

    def usage(self, end: StreamEnd) -> bytes:
        return self._chunk([], completion_usage(end.usage))

    def whole(self, text: str, end: StreamEnd, notes: KvlaneNotes | None = None) -> bytes:
        choice = ChatChoice(0, AssistantMessage(content=text), end.finish_reason)
        fields = (self._id, self._created, self._model, [choice], completion_usage(end.usage))
        return _ENCODER.encode(ChatCompletion(*fields) if notes is None else NotedChatCompletion(*fields, kvlane=notes))


class CompletionRenderer:
    def __init__(self, response_id: str, created: int, model: str) -> None:
        self._id, self._created, self._model = response_id, created, model

    def _chunk(self, choices: list[CompletionChoice], usage: CompletionUsage | None = None, notes: KvlaneNotes | None = None) -> bytes:
        fields = (self._id, self._created, self._model, choices, usage)
        return _ENCODER.encode(Completion(*fields) if notes is None else NotedCompletion(*fields, kvlane=notes))

    def opening(self) -> bytes | None:
        return None

    def delta(self, text: str) -> bytes | None:
        return self._chunk([CompletionChoice(0, text)]) if text else None

    def closing(self, end: StreamEnd, notes: KvlaneNotes | None = None) -> bytes:
        return self._chunk([CompletionChoice(0, "", end.finish_reason)], notes=notes)

    def usage(self, end: StreamEnd) -> bytes:
        return self._chunk([], completion_usage(end.usage))

    def whole(self, text: str, end: StreamEnd, notes: KvlaneNotes | None = None) -> bytes:
        return self._chunk([CompletionChoice(0, text, end.finish_reason)], completion_usage(end.usage), notes)
