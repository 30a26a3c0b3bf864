"""HTTP types of the OpenAI Responses API (`/v1/responses`) as `vllm serve` accepts and answers it.

Requests are lenient where vLLM's pydantic models are: unknown fields are
ignored, and input items are one flat type whose `type` says which fields
matter. Responses and stream events carry the fields vLLM's
`model_dump(mode="json")` writes, nulls included.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

# --- request ----------------------------------------------------------------------


class InputContent(Struct, omit_defaults=True):
    """One part of an input message (`input_text`, `output_text`, `input_image`, ...) or of a reasoning item."""

    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputItem(Struct, kw_only=True, omit_defaults=True):
    """One input item: a message (the default when `type` is left out), `function_call`,
    `function_call_output` or `reasoning`; a previous response's output items are input items too."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputContent] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    arguments: str | None = None
    output: str | list[InputContent] | None = None
    summary: list[InputContent] | None = None
    encrypted_content: str | None = None


class TextFormat(Struct, omit_defaults=True):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, omit_defaults=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(Struct):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(Struct, kw_only=True):
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    # Tools echo back as sent; function tools ({type, name, description, parameters, strict}) reach the model.
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = True
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    include_reasoning: bool = True
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = 0
    background: bool | None = False
    prompt: dict[str, Any] | None = None
    service_tier: str = "auto"
    truncation: str | None = "disabled"
    user: str | None = None
    # vLLM's sampling extras, passed on to the chat completion as they are.
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int | None = None


# --- response ---------------------------------------------------------------------


class OutputText(Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | None = None


class ReasoningText(Struct, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(Struct, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"
    status: str = "completed"


class ReasoningItem(Struct, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionCallItem(Struct, tag_field="type", tag="function_call"):
    arguments: str
    call_id: str
    name: str
    id: str
    status: str = "completed"
    namespace: str | None = None


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens", "content_filter"]


class InputTokensDetails(Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    input_tokens_per_turn: list[int] = []
    cached_tokens_per_turn: list[int] = []


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0
    tool_output_tokens: int = 0
    output_tokens_per_turn: list[int] = []
    tool_output_tokens_per_turn: list[int] = []


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class Response(Struct, kw_only=True):
    id: str
    created_at: int
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    model: str
    object: Literal["response"] = "response"
    output: list[OutputItem]
    parallel_tool_calls: bool
    temperature: float
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    background: bool
    max_output_tokens: int
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    reasoning: Reasoning | None = None
    service_tier: str
    status: ResponseStatus
    text: TextConfig | None = None
    top_logprobs: int | None = None
    truncation: str
    usage: ResponseUsage | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class StoredResponse(Struct):
    """A stored response and the chat messages that produced it (instructions, history and its input),
    as vLLM keeps them (`response_store` and `msg_store`): enough for any replica to continue it."""

    response: Response
    messages: list[dict[str, Any]]


# --- stream events ----------------------------------------------------------------


class _Event(Struct, kw_only=True, tag_field="type"):
    sequence_number: int = 0


class ResponseCreated(_Event, tag="response.created"):
    response: Response


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: Response


class ResponseCompleted(_Event, tag="response.completed"):
    response: Response


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(_Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(_Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str
    name: str


class ErrorEvent(_Event, tag="error"):
    code: str | None
    message: str
    param: str | None = None


StreamEvent = (ResponseCreated | ResponseInProgress | ResponseCompleted | OutputItemAdded | OutputItemDone
               | ContentPartAdded | ContentPartDone | OutputTextDelta | OutputTextDone | ReasoningTextDelta
               | ReasoningTextDone | FunctionCallArgumentsDelta | FunctionCallArgumentsDone | ErrorEvent)


def event_type(event: StreamEvent) -> str:
    """The event's `type` (its SSE `event:` line)."""
    return type(event).__struct_config__.tag  # type: ignore[return-value]
