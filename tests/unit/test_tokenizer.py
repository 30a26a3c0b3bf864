"""The sim tokenizer shared by ingress and workers (shared/tokenizer.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.openai_api import ChatMessage, ContentPart, FunctionCallParam, FunctionDefinition, TextContentPart, Tool, ToolCallParam
from shared.tokenizer import (
    OUTPUT_FIRST,
    OUTPUT_WORDS,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    SimTokenizer,
    UnsupportedContent,
)
from shared.tokenizer_spec import load_tokenizer

TOKENIZER = SimTokenizer()
output_ids = st.integers(OUTPUT_FIRST, OUTPUT_FIRST + OUTPUT_WORDS - 1)


def test_output_token_range_and_vocab() -> None:
    assert TOKENIZER.output_token_range == (OUTPUT_FIRST, OUTPUT_FIRST + OUTPUT_WORDS)
    assert TOKENIZER.vocab_size == VOCAB_SIZE
    assert TOKENIZER.name == "sim"


def test_output_words_are_distinct_space_prefixed_letter_words() -> None:
    words = [TOKENIZER.token_text(i) for i in range(OUTPUT_FIRST, OUTPUT_FIRST + OUTPUT_WORDS)]
    assert len(set(words)) == OUTPUT_WORDS
    for word in words:
        assert word[0] == " " and word[1:].isalpha() and word[1:].isascii()


@given(st.lists(output_ids, max_size=40))
def test_encode_decode_output_ids_round_trip(ids: list[int]) -> None:
    assert TOKENIZER.encode(TOKENIZER.decode(ids)) == ids


@given(st.lists(output_ids, max_size=40))
def test_decode_encode_text_of_output_words(ids: list[int]) -> None:
    text = TOKENIZER.decode(ids)
    assert TOKENIZER.decode(TOKENIZER.encode(text)) == text


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_special_tokens_are_single_ids(token: str) -> None:
    [token_id] = TOKENIZER.encode(token)
    assert token_id == SPECIAL_TOKENS.index(token)
    assert TOKENIZER.decode([token_id]) == token


def test_special_tokens_inside_text() -> None:
    ids = TOKENIZER.encode("hi<|user|>there<|end|>")
    assert ids[1] == SPECIAL_TOKENS.index("<|user|>")
    assert ids[-1] == SPECIAL_TOKENS.index("<|end|>")
    assert len(ids) == 4


def test_pieces_are_gpt_style() -> None:
    # "Hello", ",", " world", "!", " 4", "2", "\n\n"
    assert len(TOKENIZER.encode("Hello, world! 42\n\n")) == 7


def test_encoding_is_stable_and_hashed_ids_decode_to_nothing() -> None:
    a = TOKENIZER.encode("Hello world")
    assert a == SimTokenizer().encode("Hello world")
    for token_id in a:
        assert token_id >= OUTPUT_FIRST + OUTPUT_WORDS
        assert TOKENIZER.token_text(token_id) == ""


@given(st.text(max_size=60))
def test_ids_are_always_in_the_vocabulary(text: str) -> None:
    for token_id in TOKENIZER.encode(text):
        assert 0 <= token_id < VOCAB_SIZE


@given(st.text(max_size=60))
def test_encode_is_deterministic_and_concatenation_splits_on_specials(text: str) -> None:
    assert TOKENIZER.encode(text) == TOKENIZER.encode(text)
    assert TOKENIZER.encode(text + "<|end|>" + text) == [
        *TOKENIZER.encode(text),
        SPECIAL_TOKENS.index("<|end|>"),
        *TOKENIZER.encode(text),
    ]


def test_decode_of_unknown_ids_is_empty() -> None:
    assert TOKENIZER.decode([-1, len(SPECIAL_TOKENS), OUTPUT_FIRST - 1, VOCAB_SIZE, 10**9]) == ""


def test_chat_template() -> None:
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi"),
        ChatMessage(role="assistant", content=" baba"),
        ChatMessage(role="user", content=[TextContentPart(type="text", text="a"), TextContentPart(type="text", text="b")]),
    ]
    assert TOKENIZER.apply_chat_template(messages) == (
        "<|system|>\nBe brief.<|end|>\n"
        "<|user|>\nHi<|end|>\n"
        "<|assistant|>\n baba<|end|>\n"
        "<|user|>\na\nb<|end|>\n"
        "<|assistant|>\n"
    )


def test_developer_role_renders_as_system() -> None:
    a = TOKENIZER.apply_chat_template([ChatMessage(role="developer", content="x")])
    b = TOKENIZER.apply_chat_template([ChatMessage(role="system", content="x")])
    assert a == b


def test_chat_template_markers_encode_as_special_tokens() -> None:
    text = TOKENIZER.apply_chat_template([ChatMessage(role="user", content="Hi")])
    ids = TOKENIZER.encode(text)
    assert ids[0] == SPECIAL_TOKENS.index("<|user|>")
    assert ids[-2:] == [SPECIAL_TOKENS.index("<|assistant|>"), TOKENIZER.encode("\n")[0]]


def assistant_turn_ids(reply_ids: list[int]) -> list[int]:
    """The ids that follow `<|assistant|>` and its newline when `reply_ids` are fed back as a turn."""
    reply = TOKENIZER.decode(reply_ids)
    text = TOKENIZER.apply_chat_template(
        [ChatMessage(role="user", content="q"), ChatMessage(role="assistant", content=reply)]
    )
    encoded = TOKENIZER.encode(text)
    start = encoded.index(SPECIAL_TOKENS.index("<|assistant|>")) + 1
    end = encoded.index(SPECIAL_TOKENS.index("<|end|>"), start)
    return encoded[start:end]


@given(st.lists(output_ids, min_size=2, max_size=20))
def test_assistant_turn_fed_back_keeps_all_but_the_first_generated_id(ids: list[int]) -> None:
    assert assistant_turn_ids(ids)[-(len(ids) - 1) :] == ids[1:]


def test_assistant_turn_fed_back_keeps_the_generated_ids() -> None:
    """Module doc: an assistant turn fed back tokenizes to the very ids the engine produced."""
    ids = [OUTPUT_FIRST, OUTPUT_FIRST + 1, OUTPUT_FIRST + 2]
    newline = TOKENIZER.encode("\n")
    assert assistant_turn_ids(ids) == [*newline, *ids]


def test_output_word_after_other_text() -> None:
    assert TOKENIZER.encode(" baba") == [OUTPUT_FIRST]
    assert TOKENIZER.encode("x baba")[1:] == [OUTPUT_FIRST]
    assert TOKENIZER.encode("x, baba")[2:] == [OUTPUT_FIRST]


def test_plain_chat_ids_did_not_move_when_tool_markers_came() -> None:
    assert SPECIAL_TOKENS[:7] == ("<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    assert SPECIAL_TOKENS[7:] == ("<|tools|>", "<|tool|>", "<tool_call>", "</tool_call>")
    assert len(SPECIAL_TOKENS) <= OUTPUT_FIRST


WEATHER = Tool(function=FunctionDefinition(name="weather", description="Weather in a city",
                                           parameters={"type": "object", "properties": {"city": {"type": "string"}}}))


def test_tools_calls_and_results_render_in_the_sim_format() -> None:
    messages = [
        ChatMessage(role="user", content="Rain in Oslo?"),
        ChatMessage(role="assistant", content=None, tool_calls=[
            ToolCallParam(id="c1", function=FunctionCallParam(name="weather", arguments='{"city": "Oslo"}')),
            ToolCallParam(id="c2", function=FunctionCallParam(name="weather", arguments="not json")),
        ]),
        ChatMessage(role="tool", tool_call_id="c1", content="rain"),
    ]
    tool_line = ('{"type": "function", "function": {"name": "weather", "description": "Weather in a city", '
                 '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}')
    assert TOKENIZER.apply_chat_template(messages, tools=[WEATHER]) == (
        f"<|tools|>\n{tool_line}\n<|end|>\n"
        "<|user|>\nRain in Oslo?<|end|>\n"
        '<|assistant|>\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
        '<tool_call>{"name": "weather", "arguments": {}}</tool_call><|end|>\n'
        "<|tool|>\nrain<|end|>\n"
        "<|assistant|>\n"
    )


def test_tool_markers_encode_as_single_special_ids() -> None:
    text = TOKENIZER.apply_chat_template(
        [ChatMessage(role="assistant", tool_calls=[ToolCallParam(function=FunctionCallParam(name="f"))]),
         ChatMessage(role="tool", content="x")], tools=[WEATHER])
    ids = TOKENIZER.encode(text)
    for marker in ("<|tools|>", "<|tool|>", "<tool_call>", "</tool_call>"):
        assert ids.count(SPECIAL_TOKENS.index(marker)) == 1
    assert TOKENIZER.decode([SPECIAL_TOKENS.index("<tool_call>")]) == "<tool_call>"


def test_no_tools_no_calls_renders_as_before() -> None:
    messages = [ChatMessage(role="user", content="Hi")]
    assert TOKENIZER.apply_chat_template(messages, tools=None) == TOKENIZER.apply_chat_template(messages, tools=[])
    assert TOKENIZER.apply_chat_template(messages, chat_template_kwargs={"enable_thinking": False},
                                         documents=[{"title": "t", "text": "x"}]) == "<|user|>\nHi<|end|>\n<|assistant|>\n"


def test_without_generation_prompt_and_continuing_the_final_message() -> None:
    messages = [ChatMessage(role="user", content="Hi"), ChatMessage(role="assistant", content=" baba")]
    assert TOKENIZER.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|user|>\nHi<|end|>\n<|assistant|>\n baba<|end|>\n")
    continued = TOKENIZER.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert continued == "<|user|>\nHi<|end|>\n<|assistant|>\n baba"
    with pytest.raises(ValueError, match="continue_final_message"):
        TOKENIZER.apply_chat_template(messages, continue_final_message=True)


def test_non_text_content_is_refused_naming_the_part() -> None:
    message = ChatMessage(role="user", content=[ContentPart(type="text", text="look"), ContentPart(type="image_url")])
    with pytest.raises(UnsupportedContent) as refused:
        TOKENIZER.apply_chat_template([ChatMessage(role="system", content="s"), message])
    assert refused.value.param == "messages[1].content[1]"
    assert isinstance(refused.value, ValueError)


def test_load_tokenizer() -> None:
    assert isinstance(load_tokenizer("sim"), SimTokenizer)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        load_tokenizer("gpt2")
