"""HTTP types of the Anthropic Messages API (`/v1/messages`) as `vllm serve` accepts and answers it.

Requests are lenient where vLLM's pydantic models are (unknown fields are
ignored, one flat content-block type); responses carry only what vLLM's
serialisation leaves in (`omit_defaults` stands for its `exclude_none` /
`exclude_unset`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]

# --- request ----------------------------------------------------------------------


class ContentBlockParam(Struct, omit_defaults=True):
    """One block of a message's content: vLLM reads the fields its `type` needs and ignores the rest."""

    type: Literal["text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking"]
    text: str | None = None
    source: dict[str, Any] | None = None  # image: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    tool_name: str | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class MessageParam(Struct):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlockParam]


class ToolParam(Struct):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class ToolChoiceParam(Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingEnabled(Struct, tag_field="type", tag="enabled"):
    budget_tokens: Annotated[int, Meta(ge=1024)]
    display: str | None = None  # accepted and ignored, as vLLM does: reasoning is always returned


class ThinkingDisabled(Struct, tag_field="type", tag="disabled"):
    pass


class ThinkingAdaptive(Struct, tag_field="type", tag="adaptive"):
    display: str | None = None


ThinkingParam = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive


class JsonOutputFormat(Struct):
    schema: dict[str, Any] | None = None
    type: Literal["json_schema"] = "json_schema"


class OutputConfig(Struct):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class MessagesRequest(Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    messages: list[MessageParam]
    max_tokens: Annotated[int, Meta(ge=1)]
    metadata: dict[str, Any] | None = None  # accepted and ignored
    system: str | list[ContentBlockParam] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    # vLLM extension: passed on to the chat template.
    chat_template_kwargs: dict[str, Any] | None = None


# --- response ---------------------------------------------------------------------


class Usage(Struct, omit_defaults=True):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class TextBlock(Struct, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(Struct, tag_field="type", tag="thinking", omit_defaults=True):
    thinking: str
    signature: str | None = None  # absent when a streamed block opens; its signature comes as a delta


class ToolUseBlock(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Message(Struct, tag_field="type", tag="message", omit_defaults=True):
    """A whole response (`"stream": false`): vLLM leaves out a `stop_sequence` of None (the tag keeps `type` in)."""

    id: str
    role: Literal["assistant"]
    content: list[ContentBlock]
    model: str
    usage: Usage
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class OpenedMessage(Struct):
    """The message as `message_start` announces it: every field there, nulls included (strict SDKs need them)."""

    id: str
    model: str
    usage: Usage
    content: list[ContentBlock] = []
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


# --- stream events ----------------------------------------------------------------


class TextDelta(Struct, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(Struct, tag_field="type", tag="signature_delta"):
    signature: str


BlockDelta = TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class StopDelta(Struct):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageStart(Struct, tag_field="type", tag="message_start"):
    message: OpenedMessage


class ContentBlockStart(Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentBlock


class ContentBlockDelta(Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: BlockDelta


class ContentBlockStop(Struct, tag_field="type", tag="content_block_stop"):
    index: int


class MessageDelta(Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: Usage


class MessageStop(Struct, tag_field="type", tag="message_stop"):
    pass


class ErrorDetail(Struct):
    type: str
    message: str


class ErrorEvent(Struct, tag_field="type", tag="error"):
    """An error: the body of an error response, and the event that breaks off a stream."""

    error: ErrorDetail


StreamEvent = MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | ErrorEvent


def event_type(event: StreamEvent) -> str:
    """The event's `type` (its SSE `event:` line)."""
    return type(event).__struct_config__.tag  # type: ignore[return-value]
