"""Turning a validated OpenAI request into what the cluster runs (pure).

This is where the semantic checks live that a schema cannot express: the
context length, the tools a `tool_choice` names, and the effective
`max_tokens`. What only the engine can judge (a structured-output schema,
vLLM's own sampling extras) is the engine's to refuse: the request reaches it
with its body (`ApiRequest`).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from contracts.messages import ApiRequest, SamplingParams, WorkerRegistration
from contracts.model_files import AdapterRef
from contracts.openai_api import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from services.ingress.errors import ApiError
from shared.kv.block_hash import adapter_root, chained_block_hashes
from shared.tokenizer import Tokenizer, UnsupportedContent

# The request body's prompt fields: they ride as token ids, not in the body the engine reads.
_PROMPT_FIELDS = ("messages", "prompt")
# What a request may hold and still be plain text as sampled: `SamplingParams` carries it, or the ingress alone
# acts on it (the prompt's rendering, echo), or it is accepted and ignored. The sim engine needs the body of a
# request that holds anything else; a vLLM engine always reads it (its own defaults and checks apply to each).
_PLAIN_FIELDS = frozenset({
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty", "user", "priority", "ignore_eos", "echo",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents", "add_special_tokens",
    "store", "metadata", "service_tier", "include_reasoning", "reasoning_effort",
})
_RAW_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ENCODER = msgspec.json.Encoder()


class PreparedRequest(Struct, frozen=True):
    model: str
    prompt_token_ids: list[int]
    block_hashes: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    priority: int = 0
    # Who asks (the API key's tenant; empty without auth).
    tenant: str = ""
    # The tenant's weight in fair sharing (its key's, or `ingress.tenant_weights`').
    tenant_weight: float = 1.0
    # The API request, for the engine (structured outputs, logprobs, tools...); None: plain sampled text.
    api: ApiRequest | None = None
    # Text that leads the answer (`echo`: the prompt, or the last message it continues).
    echo_text: str = ""
    # The role of the answer's message (chat).
    role: str = "assistant"
    # The LoRA adapter the request asked for as its `model` (`model` is then its base); None: the base model.
    adapter: AdapterRef | None = None


def api_body(payload: bytes, always: bool = True) -> bytes | None:
    """The request body without its prompt, its other values as sent (not decoded, not re-encoded); None for a
    plain request unless `always` (a vLLM engine's model: its engine reads every body)."""
    fields = _RAW_FIELDS.decode(payload)
    if not always and fields.keys() <= _PLAIN_FIELDS:
        return None
    for name in _PROMPT_FIELDS:
        fields.pop(name, None)
    return _ENCODER.encode(fields)


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: one, or a batch (strings, or token-id lists) answered together."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise ApiError(400, "a prompt of the batch is empty", code="invalid_value", param="prompt")
        return list(prompt)  # type: ignore[arg-type]
    raise ApiError(400, "prompt must be a string, a list of token ids, or a batch of either, not a mix",
                   code="invalid_value", param="prompt")


def check_tools(request: ChatCompletionRequest) -> None:
    """What vLLM's server checks of `tools` and `tool_choice` (the same messages, the same 400s)."""
    if request.tools is not None and not request.tools:
        raise ApiError(400, "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
                       code="invalid_value", param="tools")
    choice = request.tool_choice
    if choice is None or choice == "none":
        return
    if request.tools is None:
        raise ApiError(400, "When using `tool_choice`, `tools` must be set.", code="invalid_value", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and not any(t.function.name == choice.function.name for t in request.tools):
        raise ApiError(400, "The tool specified in `tool_choice` does not match any of the specified `tools`",
                       code="invalid_value", param="tool_choice")


def _check_chat(request: ChatCompletionRequest, model: WorkerRegistration) -> None:
    check_tools(request)
    if request.continue_final_message and request.add_generation_prompt:
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                       code="invalid_value", param="continue_final_message")
    if request.top_logprobs and not request.logprobs:
        raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true.", code="invalid_value",
                       param="top_logprobs")
    auto = request.tool_choice == "auto" or (request.tool_choice is None and request.tools)
    if auto and not model.tool_call_parser:
        raise ApiError(400, f'"auto" tool choice requires a tool-call parser, and model `{model.model}` names none '
                       "(its workers' --tool-call-parser)", code="invalid_value", param="tool_choice")


def chat_template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    """The template's extra arguments as vLLM's server builds them (`reasoning_effort` switches thinking)."""
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = request.reasoning_effort != "none"
    if request.reasoning_effort is not None:
        kwargs["reasoning_effort"] = request.reasoning_effort
    return kwargs


def chat_prompt_text(request: ChatCompletionRequest, tokenizer: Tokenizer) -> str:
    """The conversation as the model's chat template renders it, with the request's tools and template arguments
    (`ValueError` where the template refuses it, `UnsupportedContent` for parts a text-only model cannot read)."""
    return tokenizer.apply_chat_template(
        request.messages,
        tools=request.tools,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template_kwargs=chat_template_kwargs(request),
        documents=request.documents,
    )


def render_chat(request: ChatCompletionRequest, tokenizer: Tokenizer, add_special_tokens: bool = False) -> list[int]:
    """The conversation's token ids: rendered by the model's chat template, encoded without special tokens
    beyond the template's own (as vLLM encodes a chat prompt, unless asked to add them)."""
    try:
        text = chat_prompt_text(request, tokenizer)
    except UnsupportedContent as exc:
        raise ApiError(400, str(exc), code="invalid_value", param=exc.param) from exc
    except ValueError as exc:  # the model's template refuses these messages (roles out of order, say)
        raise ApiError(400, f"the model's chat template rejected the messages: {exc}", code="invalid_value",
                       param="messages") from exc
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def prepare(
    request: ChatCompletionRequest | CompletionRequest,
    model: WorkerRegistration,
    tokenizer: Tokenizer,
    max_tokens_default: int,
    body: bytes | None = None,
    prompt: str | list[int] | None = None,
    adapter: AdapterRef | None = None,
) -> PreparedRequest:
    """The request as the cluster runs it on `model`'s workers. `body`: the request's JSON without its prompt
    (`api_body`), which the engine reads; `prompt`: the one prompt of a completion request this runs (a batch
    runs each); `adapter`: the LoRA adapter the request names as its model."""
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", code="invalid_value", param="stream_options")

    echo_text = ""
    role = "assistant"
    if isinstance(request, ChatCompletionRequest):
        _check_chat(request, model)
        prompt_ids = render_chat(request, tokenizer, request.add_special_tokens)
        asked = request.max_completion_tokens or request.max_tokens
        tokens_param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        last = request.messages[-1]
        # Who answers: the assistant, or (a continued or completed turn) the last message's role, as vLLM says.
        role = "assistant" if request.add_generation_prompt else last.role
        if request.echo and last.role == role:
            echo_text = last.text()
        kind = "chat"
    else:
        if request.suffix is not None:
            raise ApiError(400, "suffix is not currently supported", code="invalid_value", param="suffix")
        if prompt is None:
            prompts = completion_prompts(request)
            if len(prompts) != 1:
                raise ApiError(400, "a batch of prompts runs one prompt at a time", code="invalid_value", param="prompt")
            prompt = prompts[0]
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens) if isinstance(prompt, str) else list(prompt)
        asked = request.max_tokens
        tokens_param = "max_tokens"
        if request.echo:
            echo_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
        kind = "completion"

    context = model.max_model_len
    # min and max scan in C; the offending id is looked for only when there is one.
    if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= tokenizer.vocab_size):
        bad_id = next(t for t in prompt_ids if not 0 <= t < tokenizer.vocab_size)
        raise ApiError(400, f"token id {bad_id} is outside the vocabulary (0..{tokenizer.vocab_size - 1})",
                       code="invalid_value", param="prompt")
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty after tokenization", code="invalid_value", param="prompt")
    if len(prompt_ids) >= context:
        raise ApiError(
            400,
            f"This model's maximum context length is {context} tokens. However, your prompt has "
            f"{len(prompt_ids)} tokens, leaving no room for the completion.",
            code="context_length_exceeded",
            param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
        )
    room = context - len(prompt_ids)
    if asked is None:
        max_tokens = min(max_tokens_default, room)
    elif asked > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{len(prompt_ids) + asked} tokens ({len(prompt_ids)} in the prompt, {asked} for the completion).",
            code="context_length_exceeded",
            param=tokens_param,
        )
    else:
        max_tokens = asked

    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=-1 if request.top_k is None else request.top_k,
        seed=request.seed,
        stop=stop,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        ignore_eos=request.ignore_eos,
        n=request.n,
    )
    return PreparedRequest(
        model=model.model,
        prompt_token_ids=prompt_ids,
        block_hashes=chained_block_hashes(prompt_ids, model.block_size, None if adapter is None else adapter_root(adapter.name)),
        sampling=sampling,
        stream=request.stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        priority=request.priority,
        api=None if body is None else ApiRequest(kind, body, request.stream),  # type: ignore[arg-type]
        echo_text=echo_text,
        role=role,
        adapter=adapter,
    )
