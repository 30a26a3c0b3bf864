"""Turning OpenAI requests into prepared cluster requests (services/ingress/prompts.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.messages import SamplingParams, WorkerRegistration
import json

import msgspec

from contracts.openai_api import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    StreamOptions,
    TextContentPart,
    Tool,
)
from services.ingress.errors import ApiError
from services.ingress.prompts import api_body, completion_prompts, prepare
from shared.kv.block_hash import chained_block_hashes
from shared.tokenizer import SimTokenizer

TOKENIZER = SimTokenizer()
DEFAULT_MAX = 512


def registration(max_model_len: int = 4096, block_size: int = 4) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id="w1",
        role="aggregated",
        model="kvlane-sim",
        engine="sim",
        inbox="kvlane.v1.worker.w1",
        block_size=block_size,
        max_model_len=max_model_len,
        tokenizer="sim",
        started_at=0.0,
    )


def chat(*messages: tuple[str, str], **kwargs: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="kvlane-sim", messages=[ChatMessage(role=r, content=c) for r, c in messages], **kwargs
    )


def completion(prompt: str | list[int] = "Hello there", **kwargs: object) -> CompletionRequest:
    return CompletionRequest(model="kvlane-sim", prompt=prompt, **kwargs)


def chat_prompt_len(request: ChatCompletionRequest) -> int:
    return len(TOKENIZER.encode(TOKENIZER.apply_chat_template(request.messages)))


# --- chat -------------------------------------------------------------------------


def test_chat_prompt_is_the_templated_conversation() -> None:
    request = chat(("system", "Be brief."), ("user", "Hi there"))
    prepared = prepare(request, registration(), TOKENIZER, DEFAULT_MAX)
    expected = TOKENIZER.encode("<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\n")
    assert prepared.prompt_token_ids == expected
    assert prepared.model == "kvlane-sim"
    assert prepared.stream is False
    assert prepared.include_usage is False


def test_chat_content_parts_are_joined() -> None:
    # By newlines, as vLLM joins the text parts for a template that takes string content.
    parts = [TextContentPart(type="text", text="Hi "), TextContentPart(type="text", text="there")]
    a = ChatCompletionRequest(model="kvlane-sim", messages=[ChatMessage(role="user", content=parts)])
    b = chat(("user", "Hi \nthere"))
    reg = registration()
    assert prepare(a, reg, TOKENIZER, DEFAULT_MAX).prompt_token_ids == prepare(b, reg, TOKENIZER, DEFAULT_MAX).prompt_token_ids


def test_sampling_defaults() -> None:
    prepared = prepare(chat(("user", "hi")), registration(), TOKENIZER, DEFAULT_MAX)
    assert prepared.sampling == SamplingParams(max_tokens=DEFAULT_MAX)


def test_sampling_values_are_carried_over() -> None:
    request = chat(
        ("user", "hi"),
        temperature=0.0,
        top_p=0.5,
        top_k=40,
        seed=3,
        presence_penalty=1.5,
        frequency_penalty=-0.5,
        max_tokens=10,
    )
    s = prepare(request, registration(), TOKENIZER, DEFAULT_MAX).sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.0, 0.5, 40, 3)
    assert (s.presence_penalty, s.frequency_penalty, s.max_tokens) == (1.5, -0.5, 10)


# --- max_tokens and the context -------------------------------------------------------


def test_default_max_tokens_is_the_default_when_there_is_room() -> None:
    prepared = prepare(chat(("user", "hi")), registration(max_model_len=4096), TOKENIZER, 100)
    assert prepared.sampling.max_tokens == 100


def test_default_max_tokens_is_capped_by_the_room_left() -> None:
    request = chat(("user", "hi"))
    n = chat_prompt_len(request)
    prepared = prepare(request, registration(max_model_len=n + 5), TOKENIZER, 100)
    assert prepared.sampling.max_tokens == 5


def test_max_tokens_equal_to_the_room_is_accepted() -> None:
    request = chat(("user", "hi"), max_tokens=5)
    n = chat_prompt_len(request)
    assert prepare(request, registration(max_model_len=n + 5), TOKENIZER, 100).sampling.max_tokens == 5


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_above_the_room(param: str) -> None:
    request = chat(("user", "hi"), **{param: 6})
    n = chat_prompt_len(request)
    with pytest.raises(ApiError) as info:
        prepare(request, registration(max_model_len=n + 5), TOKENIZER, 100)
    err = info.value
    assert err.status == 400
    assert err.code == "context_length_exceeded"
    assert err.param == param
    assert f"maximum context length is {n + 5} tokens" in err.message
    assert f"you requested {n + 6} tokens" in err.message


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    request = chat(("user", "hi"), max_tokens=50, max_completion_tokens=7)
    assert prepare(request, registration(), TOKENIZER, DEFAULT_MAX).sampling.max_tokens == 7


@pytest.mark.parametrize("extra", [0, 3])
def test_chat_prompt_filling_the_context(extra: int) -> None:
    request = chat(("user", "a long enough message for the test"))
    n = chat_prompt_len(request)
    with pytest.raises(ApiError) as info:
        prepare(request, registration(max_model_len=n - extra), TOKENIZER, DEFAULT_MAX)
    assert info.value.status == 400
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "messages"


def test_completion_prompt_longer_than_the_context() -> None:
    with pytest.raises(ApiError) as info:
        prepare(completion(list(range(100, 120))), registration(max_model_len=10), TOKENIZER, DEFAULT_MAX)
    assert (info.value.status, info.value.code, info.value.param) == (400, "context_length_exceeded", "prompt")


@given(prompt_len=st.integers(1, 60), context=st.integers(1, 120), asked=st.none() | st.integers(1, 100))
def test_max_tokens_never_exceeds_the_room(prompt_len: int, context: int, asked: int | None) -> None:
    # Chat: `asked=None` means "the default, capped by the room".
    words = ("baba " * 60).split()
    content = " ".join(words[:prompt_len])
    request = chat(("user", content), max_tokens=asked)
    n = chat_prompt_len(request)
    try:
        prepared = prepare(request, registration(max_model_len=context), TOKENIZER, DEFAULT_MAX)
    except ApiError as err:
        assert err.status == 400 and err.code == "context_length_exceeded"
        assert n >= context or (asked is not None and n + asked > context)
    else:
        assert n < context
        assert n + prepared.sampling.max_tokens <= context
        if asked is None:
            assert prepared.sampling.max_tokens == min(DEFAULT_MAX, context - n)
        else:
            assert prepared.sampling.max_tokens == asked


# --- unsupported combinations ------------------------------------------------------


def test_n_is_carried_to_the_sampling() -> None:
    assert prepare(chat(("user", "hi"), n=3), registration(), TOKENIZER, DEFAULT_MAX).sampling.n == 3


def test_stream_options_without_stream() -> None:
    request = chat(("user", "hi"), stream_options=StreamOptions(include_usage=True))
    with pytest.raises(ApiError) as info:
        prepare(request, registration(), TOKENIZER, DEFAULT_MAX)
    assert (info.value.status, info.value.param) == (400, "stream_options")


def test_stream_with_usage() -> None:
    request = chat(("user", "hi"), stream=True, stream_options=StreamOptions(include_usage=True))
    prepared = prepare(request, registration(), TOKENIZER, DEFAULT_MAX)
    assert prepared.stream is True
    assert prepared.include_usage is True
    request = chat(("user", "hi"), stream=True, stream_options=StreamOptions(include_usage=False))
    assert prepare(request, registration(), TOKENIZER, DEFAULT_MAX).include_usage is False
    assert prepare(chat(("user", "hi"), stream=True), registration(), TOKENIZER, DEFAULT_MAX).include_usage is False


# --- stop ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, []), ("END", ["END"]), (["a", "b"], ["a", "b"]), ([], [])],
)
def test_stop_string_or_list(stop: object, expected: list[str]) -> None:
    prepared = prepare(chat(("user", "hi"), stop=stop), registration(), TOKENIZER, DEFAULT_MAX)
    assert prepared.sampling.stop == expected


# --- block hashes -----------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_hashes_cover_full_blocks(block_size: int) -> None:
    request = chat(("user", "The quick brown fox jumps over the lazy dog " * 3))
    prepared = prepare(request, registration(block_size=block_size), TOKENIZER, DEFAULT_MAX)
    ids = prepared.prompt_token_ids
    assert len(prepared.block_hashes) == len(ids) // block_size
    assert prepared.block_hashes == chained_block_hashes(ids, block_size)


def test_shared_prefix_gives_shared_leading_block_hashes() -> None:
    reg = registration(block_size=4)
    first = prepare(chat(("system", "You are a helpful assistant."), ("user", "one")), reg, TOKENIZER, DEFAULT_MAX)
    second = prepare(chat(("system", "You are a helpful assistant."), ("user", "two two")), reg, TOKENIZER, DEFAULT_MAX)
    assert first.block_hashes[:2] == second.block_hashes[:2]


# --- completions -----------------------------------------------------------------------


def test_completion_text_prompt() -> None:
    prepared = prepare(completion("Hello there"), registration(), TOKENIZER, DEFAULT_MAX)
    assert prepared.prompt_token_ids == TOKENIZER.encode("Hello there")
    assert prepared.sampling.max_tokens == 16  # the OpenAI default for completions


def test_completion_token_id_prompt_is_used_as_is() -> None:
    ids = [5, 17, 4200, 31999, 17, 18, 19, 20, 21]
    prepared = prepare(completion(ids, max_tokens=3), registration(block_size=4), TOKENIZER, DEFAULT_MAX)
    assert prepared.prompt_token_ids == ids
    assert prepared.sampling.max_tokens == 3
    assert len(prepared.block_hashes) == 2


def test_completion_max_tokens_above_room() -> None:
    with pytest.raises(ApiError) as info:
        prepare(completion([1, 2, 3], max_tokens=8), registration(max_model_len=10), TOKENIZER, DEFAULT_MAX)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_completion_token_ids_out_of_range_are_a_400(bad: int) -> None:
    with pytest.raises(ApiError) as info:
        # Four ids fill one block, so the bad id is hashed.
        prepare(completion([1, bad, 3, 4]), registration(block_size=4), TOKENIZER, DEFAULT_MAX)
    assert info.value.status == 400
    assert info.value.param == "prompt"


# --- tools, the engine's body, batches ----------------------------------------------------

TOOL = Tool(FunctionDefinition("get_weather", "Weather of a city", {"type": "object", "properties": {"city": {"type": "string"}}}))


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tools": []}, "tools", "`tools` must not be an empty array"),
        ({"tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
        ({"tools": [TOOL], "tool_choice": NamedToolChoice(NamedFunction("nope"))}, "tool_choice", "does not match any"),
        ({"tools": [TOOL], "tool_choice": "auto"}, "tool_choice", "requires a tool-call parser"),
        ({"tools": [TOOL]}, "tool_choice", "requires a tool-call parser"),
        ({"top_logprobs": 2}, "top_logprobs", "`logprobs` must be set to true"),
        ({"continue_final_message": True}, "continue_final_message", "Cannot set both"),
    ],
)
def test_tool_and_logprob_misuse_is_a_400_naming_the_parameter(fields: dict, param: str, message: str) -> None:
    with pytest.raises(ApiError) as info:
        prepare(chat(("user", "hi"), **fields), registration(), TOKENIZER, DEFAULT_MAX)
    assert (info.value.status, info.value.param) == (400, param)
    assert message in info.value.message


def test_tools_with_a_parser_or_tool_choice_none_are_rendered() -> None:
    parsing = msgspec.structs.replace(registration(), tool_call_parser="hermes")
    with_tools = prepare(chat(("user", "hi"), tools=[TOOL]), parsing, TOKENIZER, DEFAULT_MAX)
    without = prepare(chat(("user", "hi")), parsing, TOKENIZER, DEFAULT_MAX)
    assert with_tools.prompt_token_ids != without.prompt_token_ids
    none = prepare(chat(("user", "hi"), tools=[TOOL], tool_choice="none"), registration(), TOKENIZER, DEFAULT_MAX)
    assert none.prompt_token_ids == with_tools.prompt_token_ids


def test_image_content_is_a_400_naming_the_part() -> None:
    request = ChatCompletionRequest(model="kvlane-sim", messages=[ChatMessage(role="user", content=[
        ContentPart(type="text", text="what is this?"), ContentPart(type="image_url")])])
    with pytest.raises(ApiError) as info:
        prepare(request, registration(), TOKENIZER, DEFAULT_MAX)
    assert (info.value.status, info.value.param) == (400, "messages[0].content[1]")


def test_the_engine_body_is_the_request_without_its_prompt() -> None:
    payload = b'{"model": "m", "messages": [{"role": "user", "content": "secret"}], "n": 2, "min_tokens": 3, "x": {"a": [1]}}'
    body = json.loads(api_body(payload))
    assert body == {"model": "m", "n": 2, "min_tokens": 3, "x": {"a": [1]}}
    prepared = prepare(chat(("user", "hi")), registration(), TOKENIZER, DEFAULT_MAX, api_body(payload))
    assert prepared.api is not None and prepared.api.kind == "chat" and json.loads(prepared.api.body) == body


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("a", ["a"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_completion_prompts_of_a_batch(prompt: object, expected: list) -> None:
    assert completion_prompts(completion(prompt)) == expected


@pytest.mark.parametrize("prompt", [["a", [1]], [1, "a"], ["a", ""]])
def test_a_mixed_or_empty_batch_is_a_400(prompt: list) -> None:
    with pytest.raises(ApiError) as info:
        completion_prompts(completion(prompt))
    assert info.value.param == "prompt"


def test_completion_echo_and_suffix() -> None:
    assert prepare(completion("Hello there", echo=True), registration(), TOKENIZER, DEFAULT_MAX).echo_text == "Hello there"
    with pytest.raises(ApiError) as info:
        prepare(completion("x", suffix="y"), registration(), TOKENIZER, DEFAULT_MAX)
    assert info.value.param == "suffix"


def test_chat_echo_continues_the_last_message_of_the_answering_role() -> None:
    request = chat(("user", "hi"), ("assistant", "Once"), echo=True, add_generation_prompt=False, continue_final_message=True)
    prepared = prepare(request, registration(), TOKENIZER, DEFAULT_MAX)
    assert (prepared.role, prepared.echo_text) == ("assistant", "Once")
    assert prepare(chat(("user", "hi"), echo=True), registration(), TOKENIZER, DEFAULT_MAX).echo_text == ""


def test_a_plain_request_needs_no_body_on_the_sim_engine() -> None:
    plain = b'{"model": "m", "messages": [], "max_tokens": 3, "temperature": 0, "store": true, "stream": false}'
    assert api_body(plain, always=False) is None
    assert json.loads(api_body(plain)) == {"model": "m", "max_tokens": 3, "temperature": 0, "store": True, "stream": False}
    for extra in ('"tools": []', '"logprobs": true', '"n": 2', '"min_tokens": 2', '"frobnicate": 1'):
        asked = plain[:-1] + b", " + extra.encode() + b"}"
        assert api_body(asked, always=False) is not None, extra
