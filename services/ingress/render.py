"""Rendering relayed frames as OpenAI response bodies and stream chunks (pure).

A chunk is the JSON of one `chat.completion.chunk` (or `text_completion`);
HTTP frames each as an SSE `data:` line, the NATS API publishes each as one
message. The shapes follow vLLM's OpenAI server: one opening chunk per
choice, a chunk per frame that says something, the finish reason on a
choice's last chunk ("tool_calls" when the model called tools on its own or
as required), tool calls and reasoning as the worker parsed them, logprobs
as the API asks for them.

A renderer keeps the state of one answer (each choice's progress, the
output a whole answer gathers): one per request.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal, Protocol

import msgspec
from msgspec import Struct

from contracts.messages import ParsedOutput, StreamEnd, TokenChunk, TokenLogprob, Usage
from contracts.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
    CompletionUsage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    KvlaneNotes,
    NotedChatCompletion,
    NotedChatCompletionChunk,
    NotedCompletion,
    PromptTokensDetails,
    ToolCall,
)
from contracts.openai_api import TokenLogprob as ApiTokenLogprob
from contracts.openai_api import TopLogprob as ApiTopLogprob

_ENCODER = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
# What vLLM reports for a log probability of minus infinity (JSON has no infinity).
_LOWEST_LOGPROB = -9999.0

ToolChoiceKind = Literal["none", "auto", "required", "named"]


def sse(chunk: bytes) -> bytes:
    """One SSE event carrying `chunk` (JSON without newlines)."""
    return b"data: " + chunk + b"\n\n"


def named_sse(event_type: str, data: bytes) -> bytes:
    """One SSE event with its type named (`event: <type>`), as the Anthropic and Responses streams write them."""
    return b"event: " + event_type.encode() + b"\ndata: " + data + b"\n\n"


def tool_call_id() -> str:
    """A tool call's id where the model gave none (vLLM's form: `chatcmpl-tool-` and 32 hex digits)."""
    return f"chatcmpl-tool-{os.urandom(16).hex()}"


class AnswerShape(Struct, frozen=True):
    """What shapes one answer, from its request and its model's parsers."""

    n: int = 1
    prompt_tokens: int = 0
    # The answer's role (chat), and text that leads each choice (`echo`).
    role: str = "assistant"
    echo_text: str = ""
    # Chat: whether to return logprobs, and how many of the most likely tokens with each.
    chat_logprobs: bool = False
    top_logprobs: int | None = None
    # Completions: `logprobs` (the most likely tokens with each; None: no logprobs).
    completion_logprobs: int | None = None
    # The worker parses the output (the model names a tool-call or reasoning parser).
    parsed: bool = False
    # The model's tool-call parser serves tool_choice "auto".
    auto_tools: bool = False
    tool_choice: ToolChoiceKind = "none"
    parallel_tool_calls: bool = True
    include_reasoning: bool = True
    # The model names a reasoning parser: usage says how many tokens were reasoning.
    reasoning_model: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


def completion_usage(usage: Usage, reasoning_tokens: int | None = None) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens),
    )


def _clamp(logprob: float) -> float:
    return max(logprob, _LOWEST_LOGPROB)


def chat_logprobs(logprobs: Sequence[TokenLogprob], top: int | None) -> list[ApiTokenLogprob]:
    """Chat's logprobs of each token: the token, its log probability, and the `top` most likely at its place."""
    out: list[ApiTokenLogprob] = []
    for lp in logprobs:
        if lp.logprob is None:  # the engine gave none for the token it sampled
            out.append(ApiTokenLogprob(lp.token, bytes=list(lp.token.encode("utf-8", errors="replace"))))
            continue
        entries = lp.top if top == -1 else lp.top[: top or 0]
        out.append(ApiTokenLogprob(
            lp.token, _clamp(lp.logprob), lp.bytes,
            [ApiTopLogprob(t.token, _clamp(t.logprob), t.bytes) for t in entries],
        ))
    return out


def completion_logprobs(logprobs: Sequence[TokenLogprob], top: int, first_offset: int) -> CompletionLogprobs:
    """The completions API's logprobs: tokens, their log probabilities, the `top`+1 most likely, text offsets."""
    result = CompletionLogprobs([], [], [], [])
    offset = first_offset
    for lp in logprobs:
        result.tokens.append(lp.token)
        result.text_offset.append(offset)
        offset += len(lp.token)
        if lp.logprob is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_clamp(lp.logprob))
        entries = lp.top if top == -1 else lp.top[: top + 1]
        result.top_logprobs.append({t.token: _clamp(t.logprob) for t in entries})
    return result


class _Choice:
    """One choice's progress through an answer."""

    __slots__ = ("tokens", "pieces", "logprobs", "parsed", "finish_reason", "stop_reason", "tools_streamed", "echoed",
                 "text_offset")

    def __init__(self) -> None:
        self.tokens = 0
        self.pieces: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.parsed: ParsedOutput | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.tools_streamed = False
        self.echoed = False
        self.text_offset = 0

    def add(self, frame: TokenChunk) -> None:
        self.tokens += len(frame.token_ids)
        self.pieces.append(frame.text)
        self.logprobs.extend(frame.prompt_logprobs)  # an echoed prompt's, ahead of the first token's
        self.logprobs.extend(frame.logprobs)
        if frame.parsed is not None:
            self.parsed = frame.parsed
        if frame.finish_reason is not None:
            self.finish_reason, self.stop_reason = frame.finish_reason, frame.stop_reason


class Renderer(Protocol):
    def opening(self) -> list[bytes]: ...

    def delta(self, frame: TokenChunk, prompt_index: int = 0, notes: KvlaneNotes | None = None) -> list[bytes]: ...

    def closing(self, end: StreamEnd, notes: KvlaneNotes | None = None, prompt_index: int = 0) -> list[bytes]: ...

    def usage(self, ends: Sequence[StreamEnd]) -> bytes: ...

    def add(self, frame: TokenChunk, prompt_index: int = 0) -> None: ...

    def whole(self, ends: Sequence[StreamEnd], notes: KvlaneNotes | None = None) -> bytes: ...


class _Answer:
    """What chat and completions renderers share: per-choice state and usage."""

    def __init__(self, response_id: str, created: int, model: str, shape: AnswerShape, prompts: int = 1) -> None:
        self._id, self._created, self._model, self._shape = response_id, created, model, shape
        self._choices = [_Choice() for _ in range(shape.n * prompts)]

    def _choice(self, frame: TokenChunk, prompt_index: int) -> tuple[int, _Choice]:
        index = prompt_index * self._shape.n + frame.index
        return index, self._choices[index]

    def _taken(self, frame: TokenChunk, prompt_index: int) -> tuple[int, _Choice, bool] | None:
        """`frame` added to its choice: the choice's index, the choice, and whether this was its first output;
        None for a frame of a choice already finished."""
        index, choice = self._choice(frame, prompt_index)
        if choice.finish_reason is not None:
            return None
        first_output = choice.tokens == 0
        choice.add(frame)
        return index, choice, first_output

    def add(self, frame: TokenChunk, prompt_index: int = 0) -> None:
        self._choice(frame, prompt_index)[1].add(frame)

    def _usage(self, ends: Sequence[StreamEnd]) -> CompletionUsage:
        prompt = sum(end.usage.prompt_tokens for end in ends)
        completion = sum(end.usage.completion_tokens for end in ends)
        cached = sum(end.usage.cached_tokens for end in ends)
        reasoning = None
        if self._shape.reasoning_model:
            reasoning = sum(c.parsed.reasoning_tokens for c in self._choices if c.parsed is not None)
        return completion_usage(Usage(prompt, completion, cached), reasoning)

    def _running_usage(self, choice: _Choice) -> CompletionUsage | None:
        if not self._shape.continuous_usage:
            return None
        prompt = self._shape.prompt_tokens
        return CompletionUsage(prompt, choice.tokens, prompt + choice.tokens)

    def _unfinished(self, prompt_index: int) -> list[tuple[int, _Choice]]:
        first = prompt_index * self._shape.n
        return [(first + i, c) for i, c in enumerate(self._choices[first:first + self._shape.n]) if c.finish_reason is None]


class ChatRenderer(_Answer):
    def _chunk(self, choices: list[ChatChunkChoice], usage: CompletionUsage | None = None, notes: KvlaneNotes | None = None) -> bytes:
        if notes is not None:
            return _ENCODER.encode(NotedChatCompletionChunk(self._id, self._created, self._model, choices, usage, kvlane=notes))
        return _ENCODER.encode(ChatCompletionChunk(self._id, self._created, self._model, choices, usage))

    def opening(self) -> list[bytes]:
        shape = self._shape
        chunks = [self._chunk([ChatChunkChoice(i, ChatDelta(role=shape.role, content=""))],
                              CompletionUsage(shape.prompt_tokens, 0, shape.prompt_tokens) if shape.continuous_usage else None)
                  for i in range(shape.n)]
        if shape.echo_text:
            chunks += [self._chunk([ChatChunkChoice(i, ChatDelta(content=shape.echo_text))]) for i in range(shape.n)]
        return chunks

    def _finish_reason(self, choice: _Choice, reason: str) -> str:
        # OpenAI's rule, as vLLM keeps it: "tool_calls" for calls the model chose ("auto") or was
        # required to make; a named tool's call ends with "stop".
        if choice.tools_streamed and self._shape.tool_choice != "named" and reason == "stop":
            return "tool_calls"
        return reason

    def _delta_of(self, frame: TokenChunk, choice: _Choice) -> ChatDelta | None:
        if not self._shape.parsed:
            return ChatDelta(content=frame.text)
        if frame.delta is None:
            return None
        calls = frame.delta.tool_calls
        if calls:
            choice.tools_streamed = True
            if not self._shape.parallel_tool_calls:
                calls = [c for c in calls if c.index == 0]
        tool_calls = [DeltaToolCall(c.index, c.id, "function" if c.id else None,
                                    DeltaFunctionCall(c.name, c.arguments) if c.name is not None or c.arguments is not None else None)
                      for c in calls]
        reasoning = frame.delta.reasoning if self._shape.include_reasoning else None
        return ChatDelta(content=frame.delta.content, reasoning=reasoning, tool_calls=tool_calls)

    def delta(self, frame: TokenChunk, prompt_index: int = 0, notes: KvlaneNotes | None = None) -> list[bytes]:
        """The chunks `frame` makes; a choice's finishing chunk carries kvlane's `notes`, if any."""
        if (taken := self._taken(frame, prompt_index)) is None:
            return []
        index, choice, first_output = taken
        if not frame.text and not frame.token_ids and first_output and frame.finish_reason is None:
            return []
        shape = self._shape
        hide = shape.parsed and not shape.include_reasoning
        logprobs = ChatLogprobs(chat_logprobs(frame.logprobs, shape.top_logprobs)) if shape.chat_logprobs and not hide else None
        delta = self._delta_of(frame, choice)
        if delta is None:
            if frame.finish_reason is None and logprobs is None:
                return []
            delta = ChatDelta()
        reason = None if frame.finish_reason is None else self._finish_reason(choice, frame.finish_reason)
        return [self._chunk([ChatChunkChoice(index, delta, reason, logprobs, frame.stop_reason)], self._running_usage(choice),
                            notes if reason is not None else None)]

    def closing(self, end: StreamEnd, notes: KvlaneNotes | None = None, prompt_index: int = 0) -> list[bytes]:
        """The end of a stream: a finish reason for each choice not yet told (a worker that ends choices
        only in its `StreamEnd`), with kvlane's notes, if any."""
        chunks = []
        for index, choice in self._unfinished(prompt_index):
            choice.finish_reason = self._finish_reason(choice, end.finish_reason)
            chunks.append(self._chunk([ChatChunkChoice(index, ChatDelta(), choice.finish_reason)], notes=notes))
        return chunks

    def usage(self, ends: Sequence[StreamEnd]) -> bytes:
        return self._chunk([], self._usage(ends))

    def _message(self, choice: _Choice) -> tuple[AssistantMessage, bool]:
        """The choice's message, and whether the model called tools on its own or as required (vLLM's rules)."""
        shape = self._shape
        text = "".join(choice.pieces)
        parsed = choice.parsed
        if parsed is None:
            content, reasoning, calls = text, None, []
        else:
            content, reasoning, calls = parsed.content, parsed.reasoning, parsed.tool_calls
        if not shape.include_reasoning:
            reasoning = None
        tool_calls: list[ToolCall] = []
        called = False
        if shape.tool_choice in ("named", "required"):
            content = content or ""
            tool_calls = [ToolCall(c.id or tool_call_id(), FunctionCall(c.name, c.arguments)) for c in calls]
        elif shape.tool_choice == "auto" and shape.auto_tools and calls:
            called = True
            tool_calls = [ToolCall(c.id or tool_call_id(), FunctionCall(c.name, c.arguments)) for c in calls]
        if not shape.parallel_tool_calls:
            tool_calls = tool_calls[:1]
        if shape.echo_text:
            content = shape.echo_text + (content or "")
        return AssistantMessage(content, shape.role, reasoning, tool_calls), called

    def whole(self, ends: Sequence[StreamEnd], notes: KvlaneNotes | None = None) -> bytes:
        shape = self._shape
        choices = []
        for index, choice in enumerate(self._choices):
            message, called = self._message(choice)
            reason = choice.finish_reason or (ends[0].finish_reason if ends else "stop")
            if called or (shape.tool_choice == "required" and reason == "stop"):
                reason = "tool_calls"
            hide = shape.parsed and not shape.include_reasoning
            logprobs = ChatLogprobs(chat_logprobs(choice.logprobs, shape.top_logprobs)) if shape.chat_logprobs and not hide else None
            choices.append(ChatChoice(index, message, reason, logprobs, choice.stop_reason))
        fields = (self._id, self._created, self._model, choices, self._usage(ends))
        return _ENCODER.encode(ChatCompletion(*fields) if notes is None else NotedChatCompletion(*fields, kvlane=notes))


class CompletionRenderer(_Answer):
    def __init__(self, response_id: str, created: int, model: str, shape: AnswerShape, prompts: int = 1,
                 echo_texts: Sequence[str] = ()) -> None:
        super().__init__(response_id, created, model, shape, prompts)
        # What each prompt of a batch echoes (`echo`).
        self._echo_texts = list(echo_texts) or [shape.echo_text] * prompts

    def _chunk(self, choices: list[CompletionChoice], usage: CompletionUsage | None = None, notes: KvlaneNotes | None = None) -> bytes:
        fields = (self._id, self._created, self._model, choices, usage)
        return _ENCODER.encode(Completion(*fields) if notes is None else NotedCompletion(*fields, kvlane=notes))

    def opening(self) -> list[bytes]:
        return []

    def delta(self, frame: TokenChunk, prompt_index: int = 0, notes: KvlaneNotes | None = None) -> list[bytes]:
        """The chunks `frame` makes; a choice's finishing chunk carries kvlane's `notes`, if any."""
        if (taken := self._taken(frame, prompt_index)) is None:
            return []
        index, choice, first_output = taken
        text = frame.text
        shape = self._shape
        echo = self._echo_texts[prompt_index]
        if echo and not choice.echoed:
            choice.echoed = True
            text = echo + text
        elif not text and not frame.token_ids and first_output and frame.finish_reason is None:
            return []
        logprobs = None
        if shape.completion_logprobs is not None:
            logprobs = completion_logprobs([*frame.prompt_logprobs, *frame.logprobs], shape.completion_logprobs, choice.text_offset)
            if logprobs.tokens:
                choice.text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        if not text and logprobs is None and frame.finish_reason is None:
            return []
        return [self._chunk([CompletionChoice(index, text, frame.finish_reason, logprobs, frame.stop_reason)],
                            self._running_usage(choice), notes if frame.finish_reason is not None else None)]

    def closing(self, end: StreamEnd, notes: KvlaneNotes | None = None, prompt_index: int = 0) -> list[bytes]:
        chunks = []
        for index, choice in self._unfinished(prompt_index):
            choice.finish_reason = end.finish_reason
            chunks.append(self._chunk([CompletionChoice(index, "", end.finish_reason)], notes=notes))
        return chunks

    def usage(self, ends: Sequence[StreamEnd]) -> bytes:
        return self._chunk([], self._usage(ends))

    def whole(self, ends: Sequence[StreamEnd], notes: KvlaneNotes | None = None) -> bytes:
        shape = self._shape
        choices = []
        for index, choice in enumerate(self._choices):
            logprobs = None
            if shape.completion_logprobs is not None:
                logprobs = completion_logprobs(choice.logprobs, shape.completion_logprobs, 0)
            reason = choice.finish_reason or (ends[0].finish_reason if ends else "stop")
            echo = self._echo_texts[index // shape.n]
            choices.append(CompletionChoice(index, echo + "".join(choice.pieces), reason, logprobs, choice.stop_reason))
        return self._chunk(choices, self._usage(ends), notes)
