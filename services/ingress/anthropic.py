"""The Anthropic Messages API (`/v1/messages`), served as `vllm serve` serves it: through chat completions.

vLLM translates a Messages request into a chat completion request, runs it,
and translates the answer back (`vllm/entrypoints/anthropic/serving.py`);
kvlane does the same on its own chat path (`Completions.start(CHAT, ...)`),
so limits, auth, routing and every chat validation apply unchanged. The
translation is pure (`chat_request`, `message_of`, `MessageStream`); the
transports (HTTP in `app.py`, NATS in `nats_api.py`) call `AnthropicMessages`
and frame what comes out.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgspec
import structlog

from contracts.anthropic_api import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockParam,
    ContentBlockStart,
    ContentBlockStop,
    ErrorDetail,
    ErrorEvent,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageParam,
    MessagesRequest,
    MessageStart,
    MessageStop,
    OpenedMessage,
    SignatureDelta,
    StopDelta,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolUseBlock,
    Usage,
    event_type,
)
from contracts.openai_api import ChatCompletion, ChatCompletionChunk, CompletionUsage
from services.ingress.completions import CHAT, Completions, TranslatedAnswer
from services.ingress.errors import ApiError, from_decode_error
from services.ingress.render import named_sse

log = structlog.get_logger("kvlane.ingress")
_ENCODER = msgspec.json.Encoder()
_REQUEST = msgspec.json.Decoder(MessagesRequest)
_COMPLETION = msgspec.json.Decoder(ChatCompletion)
_CHUNK = msgspec.json.Decoder(ChatCompletionChunk)

# Claude Code puts a per-request hash in a system block of this prefix; vLLM drops it so the prefix cache still hits.
_BILLING_HEADER = "x-anthropic-billing-header"
# What vLLM sends for `thinking: {"type": "disabled"}` when it does not probe the template (kvlane cannot: the template is the worker's).
_DISABLED_THINKING_EFFORT = "none"



# --- request: Anthropic → chat completion ------------------------------------------


def chat_request(request: MessagesRequest) -> dict[str, Any]:
    """The chat completion request body vLLM builds from `request` (its `to_chat_completion_request`)."""
    if isinstance(request.thinking, ThinkingEnabled) and request.thinking.budget_tokens >= request.max_tokens:
        raise ApiError(400, "thinking.budget_tokens must be less than max_tokens", code="invalid_value", param="thinking")
    if request.tool_choice is not None and request.tool_choice.type == "tool" and not request.tool_choice.name:
        raise ApiError(400, "tool_choice.name is required when type is 'tool'", code="invalid_value", param="tool_choice")
    messages: list[dict[str, Any]] = []
    system = _system_text(request.system)
    if system:
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        messages.extend(_chat_messages(message))
    body: dict[str, Any] = {"model": request.model, "messages": messages,
                            "max_tokens": request.max_tokens, "max_completion_tokens": request.max_tokens}
    optional = {"stop": request.stop_sequences, "temperature": request.temperature, "top_p": request.top_p,
                "top_k": request.top_k, "chat_template_kwargs": request.chat_template_kwargs}
    body.update((name, value) for name, value in optional.items() if value is not None)
    if request.stream:
        # Usage on every chunk: the opening one gives `message_start` its input tokens, the last one `message_delta`.
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    output = request.output_config
    if output is not None and output.format is not None and output.format.schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": output.format.schema}}
    if output is not None and output.effort is not None:
        body["reasoning_effort"] = output.effort
    if isinstance(request.thinking, ThinkingDisabled):
        body["reasoning_effort"] = _DISABLED_THINKING_EFFORT
    elif isinstance(request.thinking, ThinkingEnabled):
        body["thinking_token_budget"] = request.thinking.budget_tokens  # a vLLM sampling extra, left to the engine
    choice = request.tool_choice
    if choice is not None:
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                               else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
    if request.tools is not None:
        body["tools"] = [_chat_tool(tool.name, tool.description, tool.input_schema, tool.strict) for tool in request.tools]
        body.setdefault("tool_choice", "auto")
    return body


def _chat_tool(name: str, description: str | None, schema: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "parameters": schema if "type" in schema else {**schema, "type": "object"}}
    if description is not None:
        function["description"] = description
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def _system_text(system: str | list[ContentBlockParam] | None) -> str:
    if not system:
        return ""
    if isinstance(system, str):
        return system
    return "".join(block.text for block in system
                   if block.type == "text" and block.text and not block.text.startswith(_BILLING_HEADER))


def _chat_messages(message: MessageParam) -> list[dict[str, Any]]:
    """The chat messages one Anthropic message becomes: tool results of a user turn are `tool` messages before it."""
    if message.role == "system":
        # An inline system message stays in place (vLLM merges it into the first only for templates that refuse it).
        text = _system_text(message.content)
        if text.startswith(_BILLING_HEADER):  # a string inline system message is dropped whole, as vLLM drops it
            text = ""
        return [{"role": "system", "content": text}] if text else []
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    before: list[dict[str, Any]] = []  # tool results, in the order they came
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in message.content:
        if block.type == "text" and block.text:
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image" and block.source:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source)}})
        elif block.type == "thinking" and block.thinking is not None:
            reasoning.append(block.thinking)
        elif block.type == "tool_use":
            tool_calls.append({"id": block.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": block.name or "", "arguments": json.dumps(block.input or {})}})
        elif block.type == "tool_result":
            if message.role == "user":
                before.extend(_tool_result_messages(block))
            else:
                parts.append({"type": "text", "text": f"Tool result: {str(block.content) if block.content else ''}"})
        # redacted_thinking and tool_reference blocks carry nothing a chat template renders.
    chat: dict[str, Any] = {"role": message.role}
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if tool_calls:
        chat["tool_calls"] = tool_calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    # A user turn of nothing but tool results is only its tool messages.
    return before if message.role == "user" and "content" not in chat else [*before, chat]


def _tool_result_messages(block: ContentBlockParam) -> list[dict[str, Any]]:
    text, images, references = "", [], []
    if isinstance(block.content, str):
        text = block.content
    elif isinstance(block.content, list):
        texts = []
        for item in block.content:
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image" and (url := _image_url(item.get("source", {}))):
                images.append(url)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    messages: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": block.tool_use_id or "", "content": text}]
    if images:
        messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in images]})
    if references:
        messages.append({"role": "tool", "tool_call_id": block.tool_use_id or "", "content": references})
    return messages


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


# --- response: chat completion → Anthropic -----------------------------------------


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def usage_of(usage: CompletionUsage | None) -> Usage:
    """Anthropic counts cached prompt tokens apart from `input_tokens` (when the chat usage says how many were cached)."""
    if usage is None:
        return Usage(0, 0)
    details = usage.prompt_tokens_details
    if details is None:
        return Usage(usage.prompt_tokens, usage.completion_tokens)
    return Usage(max(0, usage.prompt_tokens - details.cached_tokens), usage.completion_tokens,
                 cache_read_input_tokens=details.cached_tokens)


def stop_reason_of(finish_reason: str | None, stop_reason: int | str | None, tool_used: bool,
                   tool_complete: bool) -> tuple[StopReason | None, str | None]:
    """vLLM's mapping: a length limit wins, then complete tool calls, then a matched stop string (a str, not a token id)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def message_of(chat: ChatCompletion) -> Message:
    """A whole chat completion as a Message (vLLM's `messages_full_converter`)."""
    choice = chat.choices[0]
    calls = choice.message.tool_calls
    stop, sequence = stop_reason_of(choice.finish_reason, choice.stop_reason, tool_used=bool(calls), tool_complete=bool(calls))
    content: list[ContentBlock] = []
    if choice.message.reasoning:
        content.append(ThinkingBlock(choice.message.reasoning, signature=uuid.uuid4().hex))
    if choice.message.content:
        content.append(TextBlock(choice.message.content))
    content += [ToolUseBlock(call.id, call.function.name, _arguments(call.function.arguments)) for call in calls]
    # Anthropic's empty answer is one empty text block: clients read content[0].
    return Message(message_id(chat.id), "assistant", content or [TextBlock("")], chat.model, usage_of(chat.usage), stop, sequence)


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {}  # vLLM would fail the request with a 500 here


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class MessageStream:
    """Chat completion chunks in, Messages stream events out (vLLM's `message_stream_converter`).

    One content block is open at a time; a new kind of output closes it and
    opens the next. Text that comes while a tool call is open is held back
    and sent as a text block of its own once the call closes. Whatever the
    chunks, the events are well formed: `message_start` first, blocks opened
    and closed in order, one `message_delta`, `message_stop` last.
    """

    def __init__(self) -> None:
        self._started = False
        self._delivered = False  # message_delta sent: the answer is complete
        self._next_index = 0
        self._open: str | None = None  # the open block's type
        self._signature: str | None = None  # of the open thinking block
        self._tool_use_id: str | None = None  # of the open tool_use block
        self._held_text: list[str] = []
        self._tool_ids: dict[int, str] = {}  # chat tool-call index → tool_use id
        self._tool_used = False
        self._last_tool_args: list[str] = []  # only the last call can be cut short by a stop string
        self._finish_reason: str | None = None
        self._stop_reason: int | str | None = None
        self._usage: CompletionUsage | None = None

    def feed(self, chunk: ChatCompletionChunk) -> list[StreamEvent]:
        if self._delivered:
            return []
        events: list[StreamEvent] = []
        if chunk.usage is not None:
            self._usage = chunk.usage
        if not self._started:
            self._started = True
            events.append(MessageStart(OpenedMessage(message_id(chunk.id), chunk.model, usage_of(chunk.usage))))
        if not chunk.choices:  # the usage chunk that ends a stream
            events += self._deliver()
            return events
        choice = chunk.choices[0]
        if choice.finish_reason is not None:
            self._finish_reason, self._stop_reason = choice.finish_reason, choice.stop_reason
        delta = choice.delta
        if delta.reasoning:
            if self._open != "thinking":
                events += self._close_and_flush()
                events.append(self._start(ThinkingBlock("")))
            events.append(ContentBlockDelta(self._index, ThinkingDelta(delta.reasoning)))
        if delta.content:
            if self._open == "tool_use":
                self._held_text.append(delta.content)
            else:
                if self._open != "text":
                    events += self._close_and_flush()
                    events.append(self._start(TextBlock("")))
                events.append(ContentBlockDelta(self._index, TextDelta(delta.content)))
        for call in delta.tool_calls:
            name = call.function.name if call.function else None
            arguments = call.function.arguments if call.function else None
            call_id = call.id
            if call_id is not None:
                self._tool_ids[call.index] = call_id
                if self._tool_use_id != call_id and name is not None:
                    events += self._close_and_flush()
                    self._tool_used = True
                    self._last_tool_args = []
                    events.append(self._start(ToolUseBlock(call_id, name, {})))
            else:
                call_id = self._tool_ids.get(call.index)
            # Arguments of a call whose block is no longer open are dropped, as vLLM drops them.
            if arguments and call_id is not None and self._tool_use_id == call_id:
                self._last_tool_args.append(arguments)
                events.append(ContentBlockDelta(self._index, InputJsonDelta(arguments)))
        return events

    def finish(self) -> list[StreamEvent]:
        """The events that end the stream, once the chunks have run out."""
        events: list[StreamEvent] = []
        if not self._started:
            self._started = True
            events.append(MessageStart(OpenedMessage("msg_" + uuid.uuid4().hex, "", Usage(0, 0))))
        if not self._delivered:
            events += self._deliver()
        return [*events, MessageStop()]

    @property
    def _index(self) -> int:
        return self._next_index - 1  # the open block's

    def _deliver(self) -> list[StreamEvent]:
        events = self._close_and_flush()
        complete = self._tool_used and _is_json("".join(self._last_tool_args))
        stop, sequence = stop_reason_of(self._finish_reason or "stop", self._stop_reason, self._tool_used, complete)
        self._delivered = True
        return [*events, MessageDelta(StopDelta(stop, sequence), usage_of(self._usage))]

    def _start(self, block: ContentBlock) -> ContentBlockStart:
        self._open = type(block).__struct_config__.tag  # type: ignore[assignment]
        self._signature = uuid.uuid4().hex if isinstance(block, ThinkingBlock) else None
        self._tool_use_id = block.id if isinstance(block, ToolUseBlock) else None
        self._next_index += 1
        return ContentBlockStart(self._index, block)

    def _close(self) -> list[StreamEvent]:
        if self._open is None:
            return []
        events: list[StreamEvent] = []
        if self._signature is not None:
            events.append(ContentBlockDelta(self._index, SignatureDelta(self._signature)))
        events.append(ContentBlockStop(self._index))
        self._open = self._signature = self._tool_use_id = None
        return events

    def _close_and_flush(self) -> list[StreamEvent]:
        held, self._held_text = "".join(self._held_text), []
        events = self._close()
        if held:
            events.append(self._start(TextBlock("")))
            events.append(ContentBlockDelta(self._index, TextDelta(held)))
            events += self._close()
        return events


# --- the shell the transports call -------------------------------------------------


class AnthropicApiError(ApiError):
    """An `ApiError` whose body is in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""

    def body(self) -> ErrorEvent:  # type: ignore[override]
        return ErrorEvent(ErrorDetail(self.type, self.message))

    @classmethod
    def of(cls, error: ApiError) -> AnthropicApiError:
        if isinstance(error, AnthropicApiError):
            return error
        return cls(error.status, error.message, code=error.code, param=error.param, retry_after_s=error.retry_after_s)


def error_body(error: ApiError) -> bytes:
    return _ENCODER.encode(AnthropicApiError.of(error).body())


def sse_event(event: StreamEvent) -> bytes:
    """One event as vLLM writes it: `event: <type>` and `data: <json>`."""
    return named_sse(event_type(event), _ENCODER.encode(event))


class AnthropicMessages:
    def __init__(self, completions: Completions) -> None:
        self._completions = completions

    async def start(self, payload: bytes, caller_gone: Callable[[], bool],
                    headers: Mapping[str, str] | None = None) -> MessagesAnswer:
        """Translate, run as a chat completion, wait for the first output; every error raised is an `AnthropicApiError`."""
        try:
            try:
                request = _REQUEST.decode(payload)
            except msgspec.DecodeError as exc:
                # As on the chat path: a caller without a valid key learns nothing of its body.
                await self._completions.authenticate(headers, None)
                raise from_decode_error(exc) from exc
            chat = _ENCODER.encode(chat_request(request))
            return MessagesAnswer(await self._completions.start(CHAT, chat, caller_gone, headers))
        except ApiError as exc:
            raise AnthropicApiError.of(exc) from exc


class MessagesAnswer(TranslatedAnswer):
    """What a transport serves: one Message, or a stream of events. Close it (`async with`) to end or abort it."""

    async def body(self) -> bytes:
        try:
            chat = await self._answer.body()
        except ApiError as exc:
            raise AnthropicApiError.of(exc) from exc
        return _ENCODER.encode(message_of(_COMPLETION.decode(chat)))

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The stream's events, in order; an error mid-stream raises `AnthropicApiError` (the transport sends it as an `error` event)."""
        translator = MessageStream()
        try:
            async for chunk in self._answer.chunks():
                for event in translator.feed(_CHUNK.decode(chunk)):
                    yield event
        except ApiError as exc:
            raise AnthropicApiError.of(exc) from exc
        for event in translator.finish():
            yield event

    async def sse(self) -> AsyncIterator[bytes]:
        """The stream as server-sent events; vLLM ends a broken stream with an `error` event."""
        try:
            async for event in self.events():
                yield sse_event(event)
        except AnthropicApiError as exc:
            log.warning("stream_failed", code=exc.code, error=exc.message)
            yield sse_event(exc.body())
