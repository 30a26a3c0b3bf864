"""HTTP types of the OpenAI API as kvlane serves it (the surface of vLLM's OpenAI-compatible server).

Requests accept unknown fields, as `vllm serve` does: the request body
(without its prompt) reaches the engine, which reads the parameters it
knows (a vLLM engine, through vLLM's own request types). Constraints live in
`Meta` annotations: they drive validation and the OpenAPI document alike.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

Temperature = Annotated[float, Meta(ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy.")]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
ModelName = Annotated[str, Meta(min_length=1, max_length=256)]
Stop = str | Annotated[list[str], Meta(max_length=4)] | None


class StreamOptions(Struct):
    include_usage: bool = False
    # vLLM extension: every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class ContentPart(Struct):
    """One part of a message's content. A text-only model takes `text` parts; any other type is a 400."""

    type: str
    text: str | None = None


# Kept for callers that build text parts by name.
TextContentPart = ContentPart


class FunctionCallParam(Struct):
    name: str
    # The arguments as the model wrote them: a JSON object, as text.
    arguments: str = ""


class ToolCallParam(Struct):
    """A tool call of an assistant message in the history."""

    function: FunctionCallParam
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(Struct):
    """A message of the conversation. Any role the model's chat template renders is accepted."""

    role: Annotated[str, Meta(min_length=1)]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant's calls of tools, and (role "tool") the call a result answers.
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    # An assistant's reasoning in the history, for templates that render it.
    reasoning: str | None = None

    def text(self) -> str:
        """The content as one text (text parts joined by newlines, as vLLM renders them for string templates)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


class FunctionDefinition(Struct, omit_defaults=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(Struct):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(Struct, kw_only=True):
    """Fields shared by chat and text completions.

    Unknown fields are accepted and left to the engine, as `vllm serve` accepts
    them: vLLM's own sampling extras (`min_tokens`, `repetition_penalty`,
    `stop_token_ids`, `structured_outputs`...) reach a vLLM engine unchanged.
    """

    model: ModelName
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    n: Annotated[int, Meta(ge=1, le=128, description="Choices to sample from the prompt, on one node.")] = 1
    stop: Stop = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # kvlane extension: a priority class, higher is more important. It orders
    # the balancer's central queue and lets the cache-manager preempt
    # lower-value running requests when KV memory is full.
    priority: Annotated[int, Meta(ge=0, le=9)] = 0
    # vLLM extension: keep generating past the end-of-sequence token.
    ignore_eos: bool = False
    # vLLM extension: constrain the output (json, regex, choice, grammar...), passed to the engine as given.
    structured_outputs: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions that shape the prompt.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    echo: bool = False
    # Special tokens (a BOS) added on top of what the template renders.
    add_special_tokens: bool = False


class CompletionRequest(_SamplingFields, kw_only=True):
    # A text, token ids, or a batch of either (one choice per prompt and `n`); a batch holds one kind.
    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[str | int | list[int]], Meta(min_length=1)]
    max_tokens: PositiveInt | None = 16
    echo: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None
    # Special tokens (a BOS) added to a text prompt.
    add_special_tokens: bool = True


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(Struct):
    reasoning_tokens: int = 0


class CompletionUsage(Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # Tokens of reasoning among the completion's (a model with a reasoning parser).
    completion_tokens_details: CompletionTokensDetails | None = None


class FunctionCall(Struct):
    name: str
    arguments: str


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class AssistantMessage(Struct, omit_defaults=True):
    content: str | None
    role: str
    # The model's reasoning, split from its answer by the model's reasoning parser.
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(Struct):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Struct):
    content: list[TokenLogprob] | None = None


StopReason = int | str | None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None
    # What stopped it: the stop string or token id (None: the end-of-sequence token, or a length limit).
    stop_reason: StopReason = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    object: Literal["chat.completion"] = "chat.completion"


class DeltaFunctionCall(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = []


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    stop_reason: StopReason = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionLogprobs(Struct):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    stop_reason: StopReason = None


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
    # As vLLM lists them: a LoRA adapter's `root` is its name and `parent` the base model it adapts; a base
    # model's own `parent` is null.
    root: str | None = None
    parent: str | None = None


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


class TokenizeRequest(Struct, kw_only=True):
    """`/tokenize`: a text (`prompt`) or a conversation (`messages`, rendered by the model's chat template)."""

    model: ModelName | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default: true for a text (its BOS added), false for a conversation (the template adds its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[Annotated[int, Meta(ge=0)]]
    model: ModelName | None = None


class DetokenizeResponse(Struct):
    prompt: str
