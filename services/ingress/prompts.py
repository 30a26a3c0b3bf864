"""Turning a validated OpenAI request into what the cluster runs (pure).

This is where the semantic checks live that a schema cannot express: the
context length, `n`, and the effective `max_tokens`.
"""

from __future__ import annotations

from msgspec import Struct

from contracts.messages import SamplingParams, WorkerRegistration
from contracts.openai_api import ChatCompletionRequest, CompletionRequest
from services.ingress.errors import ApiError
from shared.block_hash import chained_block_hashes
from shared.tokenizer import Tokenizer


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


def prepare(
    request: ChatCompletionRequest | CompletionRequest,
    model: WorkerRegistration,
    tokenizer: Tokenizer,
    max_tokens_default: int,
) -> PreparedRequest:
    if request.n != 1:
        raise ApiError(400, "only n=1 is supported", code="unsupported_parameter", param="n")
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", code="invalid_value", param="stream_options")

    if isinstance(request, ChatCompletionRequest):
        try:
            prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(request.messages))
        except ValueError as exc:  # the model's template refuses these messages (roles out of order, say)
            raise ApiError(400, f"the model's chat template rejected the messages: {exc}", code="invalid_value",
                           param="messages") from exc
        asked = request.max_completion_tokens or request.max_tokens
        tokens_param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    else:
        prompt_ids = tokenizer.encode(request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
        asked = request.max_tokens
        tokens_param = "max_tokens"

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
    )
    return PreparedRequest(
        model=request.model,
        prompt_token_ids=prompt_ids,
        block_hashes=chained_block_hashes(prompt_ids, model.block_size),
        sampling=sampling,
        stream=request.stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        priority=request.priority,
    )
