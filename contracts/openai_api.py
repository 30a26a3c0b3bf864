"""HTTP types of the OpenAI API subset kvlane serves.

Requests forbid unknown fields, as the OpenAI API does, so a typo in a
parameter name is a clear 400 rather than a silently ignored setting.
Constraints live in `Meta` annotations: they drive validation and the
OpenAPI document alike.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

Temperature = Annotated[float, Meta(ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy.")]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
ModelName = Annotated[str, Meta(min_length=1, max_length=256)]
Stop = str | Annotated[list[str], Meta(max_length=4)] | None


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class TextContentPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingFields(Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by chat and text completions."""

    model: ModelName
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    n: Annotated[int, Meta(ge=1, description="Only n=1 is supported; more is a 400.")] = 1
    stop: Stop = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    # kvlane extension: a priority class, higher is more important. It orders
    # the balancer's central queue and lets the cache-manager preempt
    # lower-value running requests when KV memory is full.
    priority: Annotated[int, Meta(ge=0, le=9)] = 0
    # vLLM extension: keep generating past the end-of-sequence token.
    ignore_eos: bool = False


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: Literal[False] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[int], Meta(min_length=1)]
    max_tokens: PositiveInt = 16
    echo: Literal[False] = False
    logprobs: None = None


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class CompletionUsage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(Struct):
    content: str
    role: Literal["assistant"] = "assistant"


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    object: Literal["chat.completion"] = "chat.completion"


class ChatDelta(Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(Struct):
    """A text completion; streamed chunks have the same shape."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None
    object: Literal["text_completion"] = "text_completion"


class Degraded(Struct):
    """What kvlane changed to keep serving under overload."""

    reason: Literal["overload"]
    # The answer was generated under this cap instead of the one asked for.
    max_tokens: int
    requested_max_tokens: int


class KvlaneNotes(Struct, omit_defaults=True):
    """kvlane's extension of a response (the `kvlane` field), present only when there is something to say."""

    degraded: Degraded | None = None


# A response, or a stream's closing chunk, with kvlane's notes.
class NotedChatCompletion(ChatCompletion, kw_only=True):
    kvlane: KvlaneNotes


class NotedChatCompletionChunk(ChatCompletionChunk, kw_only=True):
    kvlane: KvlaneNotes


class NotedCompletion(Completion, kw_only=True):
    kvlane: KvlaneNotes


class Model(Struct):
    id: str
    created: int
    owned_by: str = "kvlane"
    max_model_len: int | None = None
    object: Literal["model"] = "model"


class ModelList(Struct):
    data: list[Model]
    object: Literal["list"] = "list"


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorDetail


class HealthStatus(Struct):
    status: Literal["ok", "not_ready"]
    workers: int = 0
    models: list[str] = []
    # What /ready is waiting for: "nats", "workers", "balancer", "tokenizer:<model>".
    missing: list[str] = []
    # What does not answer but is not waited for, as requests are served less well without it:
    # "cache-manager" (routes go on without KV leases).
    degraded: list[str] = []
