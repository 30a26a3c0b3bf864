"""`/tokenize` and `/detokenize`: the model's own tokenizer and chat template, as vLLM's server exposes them.

Served by the ingress itself (it holds every served model's tokenizer): no
worker is asked, and the ids are those the cluster would route and run.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from contracts.openai_api import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from services.ingress.completions import Completions
from services.ingress.errors import ApiError, from_decode_error
from services.ingress.prompts import check_tools, render_chat

_ENCODER = msgspec.json.Encoder()
_TOKENIZE = msgspec.json.Decoder(TokenizeRequest)
_DETOKENIZE = msgspec.json.Decoder(DetokenizeRequest)


def _decode(decoder: msgspec.json.Decoder, payload: bytes):
    try:
        return decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from exc


class Tokenization:
    def __init__(self, completions: Completions) -> None:
        self._completions = completions

    async def tokenize(self, payload: bytes, headers: Mapping[str, str] | None = None) -> bytes:
        request = _decode(_TOKENIZE, payload)
        await self._completions.authenticate(headers, request.model)
        model, tokenizer = await self._completions.resolve(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise ApiError(400, "give either `prompt` or `messages`", code="invalid_value", param="prompt")
        if request.messages is not None:
            chat = ChatCompletionRequest(
                model=model.model, messages=request.messages, tools=request.tools,
                add_generation_prompt=request.add_generation_prompt, continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs,
            )
            check_tools(chat)
            ids = render_chat(chat, tokenizer, bool(request.add_special_tokens))
        else:
            assert request.prompt is not None
            ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens is not False)
        strs = tokenizer.token_strings(ids) if request.return_token_strs else None
        return _ENCODER.encode(TokenizeResponse(len(ids), model.max_model_len, ids, strs))

    async def detokenize(self, payload: bytes, headers: Mapping[str, str] | None = None) -> bytes:
        request = _decode(_DETOKENIZE, payload)
        await self._completions.authenticate(headers, request.model)
        _, tokenizer = await self._completions.resolve(request.model)
        if any(t >= tokenizer.vocab_size for t in request.tokens):
            bad = next(t for t in request.tokens if t >= tokenizer.vocab_size)
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{tokenizer.vocab_size - 1})",
                           code="invalid_value", param="tokens")
        return _ENCODER.encode(DetokenizeResponse(tokenizer.decode(request.tokens, skip_special_tokens=False)))
