"""Ingress renders a chat request into the very prompt `vllm serve` renders for it.

vLLM's own `OnlineRenderer` (what `vllm serve` runs between a request and
the engine) renders the OpenAI request on the tiny model; kvlane's
`HfTokenizer` renders the same request as ingress does (the arguments
`services/ingress/prompts.py` passes). The text and the token ids must be
equal, for the tiny model's Qwen3-style template and for a template that
takes OpenAI content parts and dumps what it is given.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.openai_api import ChatCompletionRequest as KvlaneChatRequest
from contracts.openai_api import ChatMessage, ContentPart
from services.ingress.prompts import chat_prompt_text
from shared.hf_tokenizer import HfTokenizer
from shared.tokenizer import UnsupportedContent

# A template that loops over message content (vLLM then passes OpenAI parts),
# names the "developer" role (no conversion to "system") and dumps every
# message, tool, document and extra variable, so any difference shows.
DUMPING_TEMPLATE = """\
{%- for message in messages %}[{{ message.role }}]
{%- if message.content is string %}{{ message.content }}
{%- else %}{% for part in message.content %}<{{ part.type }}>{{ part.text }}{% endfor %}{% endif %}
{{- message | tojson }}
{% endfor %}
{%- set names_the_role = 'developer' %}
{%- for tool in tools or [] %}tool={{ tool | tojson }}
{% endfor %}
{%- for document in documents or [] %}doc={{ document | tojson }}
{% endfor %}
{%- if reasoning_effort is defined %}effort={{ reasoning_effort }}
{% endif %}
{%- if enable_thinking is defined %}thinking={{ enable_thinking }}
{% endif %}
{%- if custom_flag is defined %}flag={{ custom_flag }}
{% endif %}
{{- eos_token }}{{ bos_token is defined }}
{%- if add_generation_prompt %}[assistant]{% endif %}"""


def vllm_renderer(model_dir: Path):
    """vLLM's renderer as `vllm serve --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3` builds it."""
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config

    model_config = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=4096)
    renderer = renderer_from_config(VllmConfig(model_config=model_config))
    return OnlineRenderer(model_config, renderer, request_logger=None, chat_template=None,
                          chat_template_content_format="auto", enable_auto_tools=True, tool_parser="hermes",
                          reasoning_parser="qwen3")


class Rendering:
    """One model directory rendered by vLLM and by kvlane."""

    def __init__(self, model_dir: Path) -> None:
        self.vllm = vllm_renderer(model_dir)
        self.kvlane = HfTokenizer(str(model_dir))

    def by_vllm(self, body: dict[str, Any]) -> tuple[str, list[int]]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        from vllm.exceptions import VLLMValidationError

        try:  # vllm serve answers 400 for these
            parsed = ChatCompletionRequest(**body)
        except VLLMValidationError as exc:
            raise ValueError(str(exc)) from exc
        result = asyncio.run(self.vllm.render_chat(parsed))
        if not isinstance(result, tuple):
            raise ValueError(result.error.message)
        _, [engine_input] = result
        return engine_input["prompt"], list(engine_input["prompt_token_ids"])

    def by_kvlane(self, body: dict[str, Any]) -> tuple[str, list[int]]:
        text = chat_prompt_text(msgspec.convert(body, KvlaneChatRequest), self.kvlane)
        return text, self.kvlane.encode(text, add_special_tokens=False)

    def assert_same(self, body: dict[str, Any]) -> str:
        expected = self.by_vllm(body)
        assert self.by_kvlane(body) == expected
        return expected[0]


@pytest.fixture(scope="module")
def qwen_style(tiny_model: Path) -> Rendering:
    return Rendering(tiny_model)


@pytest.fixture(scope="module")
def dumping(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Rendering:
    directory = tmp_path_factory.mktemp("dumping") / "tiny"
    shutil.copytree(tiny_model, directory)
    (directory / "chat_template.jinja").write_text(DUMPING_TEMPLATE)
    return Rendering(directory)


def request(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": list(messages), **fields}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def call(name: str, arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
STRICT = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}, "strict": True}}
BARE = {"type": "function", "function": {"name": "ping"}}
NOT_STRICT = {"type": "function", "function": {"name": "pong", "description": "", "strict": False}}

TOOL_ROUND = [
    {"role": "system", "content": "You help with weather."},
    user("Weather in Oslo and Bergen?"),
    {"role": "assistant", "content": None, "reasoning": "Two cities, two calls.",
     "tool_calls": [call("get_weather", '{"city": "Oslo"}', "c1"), call("get_weather", '{"city": "Bergen"}', "c2")]},
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "sun"}, {"type": "text", "text": "12C"}]},
]

CASES = {
    "plain": request(user("Hello there")),
    "system and user": request({"role": "system", "content": "Be brief."}, user("Hi")),
    "developer becomes system": request({"role": "developer", "content": "Be terse."}, user("Hi")),
    "developer merged with system": request({"role": "system", "content": "S1"}, user("a"),
                                            {"role": "developer", "content": "D1"}, user("b")),
    "multi-part content": request(user([{"type": "text", "text": "first"}, {"type": "text", "text": "second"}])),
    "empty and missing content": request(user(""), {"role": "assistant", "content": None}, user("again")),
    "name": request({"role": "user", "content": "hi", "name": "ann"}),
    "tools": request({"role": "system", "content": "Sys"}, user("Weather?"), tools=[WEATHER, STRICT, BARE, NOT_STRICT]),
    "tools without system": request(user("Weather?"), tools=[WEATHER], tool_choice="auto"),
    "tools with tool_choice none": request(user("Weather?"), tools=[WEATHER], tool_choice="none"),
    "tool calls then results": request(*TOOL_ROUND, tools=[WEATHER]),
    "tool call arguments that are not an object": request(
        user("x"), {"role": "assistant", "content": "Trying.", "tool_calls": [
            call("a", "not json", "c1"), call("b", "[1, 2]", "c2"), call("c", "", "c3"), call("d", '{"n": 1.5e3}', "c4")]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}, tools=[WEATHER]),
    "empty tool_calls": request(user("x"), {"role": "assistant", "content": "plain", "tool_calls": []}, user("y")),
    "reasoning in history": request(user("q1"), {"role": "assistant", "content": "a1", "reasoning": "thought one"},
                                    user("q2"), {"role": "assistant", "content": "a2", "reasoning": "thought two"}),
    "think tags in content": request(user("q"), {"role": "assistant", "content": "<think>\nhm\n</think>\n\nok"},
                                     add_generation_prompt=False),
    "enable_thinking off": request(user("Hi"), chat_template_kwargs={"enable_thinking": False}),
    "enable_thinking on": request(user("Hi"), chat_template_kwargs={"enable_thinking": True}),
    "reasoning_effort none": request(user("Hi"), reasoning_effort="none"),
    "reasoning_effort low": request(user("Hi"), reasoning_effort="low"),
    "unused and unset kwargs": request(user("Hi"), chat_template_kwargs={"custom_flag": 3, "unused": "x",
                                                                         "enable_thinking": None}),
    "no generation prompt": request(user("Hi"), {"role": "assistant", "content": "Hello"}, add_generation_prompt=False),
    "continue final message": request(user("Count"), {"role": "assistant", "content": "One, two, "},
                                      add_generation_prompt=False, continue_final_message=True),
    "continue final message with trailing newline": request(
        user("Count"), {"role": "assistant", "content": "One\n"}, add_generation_prompt=False, continue_final_message=True),
    "documents": request(user("Summarize"), documents=[{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]),
    "other roles": request({"role": "critic", "content": "meh"}, user("Hi")),
    "billing header": request({"role": "system", "content": "x-anthropic-billing-header: cch=1\nReal system"}, user("Hi")),
}


@pytest.mark.parametrize("body", CASES.values(), ids=CASES.keys())
def test_qwen_style_template_renders_as_vllm_serve(qwen_style: Rendering, body: dict[str, Any]) -> None:
    qwen_style.assert_same(body)


@pytest.mark.parametrize("body", CASES.values(), ids=CASES.keys())
def test_dumping_template_gets_what_vllm_serve_gives(dumping: Rendering, body: dict[str, Any]) -> None:
    dumping.assert_same(body)


def test_the_cases_exercise_the_qwen_template(qwen_style: Rendering) -> None:
    tools = qwen_style.assert_same(CASES["tool calls then results"])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Current weather' in tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in tools
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\nsun\n12C\n</tool_response><|im_end|>" in tools
    assert "<think>\nTwo cities, two calls.\n</think>" in tools
    assert qwen_style.assert_same(CASES["enable_thinking off"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen_style.assert_same(CASES["developer becomes system"]).startswith("<|im_start|>system\nBe terse.<|im_end|>")
    assert qwen_style.assert_same(CASES["continue final message"]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nOne, two, ")


def test_the_dumping_template_takes_openai_parts_and_developer(dumping: Rendering) -> None:
    text = dumping.assert_same(CASES["multi-part content"])
    assert "<text>first<text>second" in text
    assert dumping.assert_same(CASES["developer becomes system"]).startswith("[developer]")
    assert "flag=3" in dumping.assert_same(CASES["unused and unset kwargs"])
    assert "effort=low" in dumping.assert_same(CASES["reasoning_effort low"])


@pytest.mark.parametrize("body", [
    request(user("x"), add_generation_prompt=True, continue_final_message=True),
    request(user("x"), documents=[{"title": "a", "text": "b"}], chat_template_kwargs={"chat_template": "{{ 1 }}"}),
], ids=["continue and generate", "template in kwargs"])
def test_requests_vllm_refuses_are_refused(qwen_style: Rendering, body: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        qwen_style.by_vllm(body)
    with pytest.raises(ValueError):
        qwen_style.by_kvlane(body)


def test_an_image_is_refused_naming_the_part(qwen_style: Rendering) -> None:
    body = request(user([{"type": "text", "text": "What is this?"},
                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]))
    # vllm serve answers 400 ("<model> is not a multimodal model", no param); ingress names the part.
    with pytest.raises(ValueError, match="is not a multimodal model"):
        qwen_style.by_vllm(body)
    with pytest.raises(UnsupportedContent) as refused:
        qwen_style.by_kvlane(body)
    assert refused.value.param == "messages[0].content[1]"


def test_a_template_error_is_a_value_error_as_vllm_makes_it_a_400(dumping: Rendering) -> None:
    # The dumping template reads `part.text` of a string part: fine; an undefined method call is not.
    broken = HfTokenizer.__new__(HfTokenizer)
    broken.__dict__.update(dumping.kvlane.__dict__)
    from shared.hf_tokenizer import _ChatTemplate

    broken._templates = {"default": _ChatTemplate("{{ messages[0].content.nope() }}")}
    with pytest.raises(ValueError, match="nope"):
        broken.apply_chat_template([ChatMessage(role="user", content=[ContentPart(type="text", text="x")])])


def test_hermes_and_qwen3_parsers_work_on_the_tiny_tokenizer(qwen_style: Rendering) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    tokenizer = qwen_style.vllm.renderer.get_tokenizer()
    vocab = tokenizer.get_vocab()
    for marker in ("<tool_call>", "</tool_call>", "<think>", "</think>"):
        assert marker in vocab
    body = request(user("Weather?"), tools=[WEATHER])
    hermes = ToolParserManager.get_tool_parser("hermes")(tokenizer, ChatCompletionRequest(**body).tools)
    generated = qwen_style.kvlane.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
                                         "<|im_end|>")
    # vLLM detokenizes with skip_special_tokens: the markers must survive it.
    output = tokenizer.decode(generated, skip_special_tokens=True)
    extracted = hermes.extract_tool_calls(output, ChatCompletionRequest(**body))
    assert extracted.tools_called and extracted.tool_calls[0].function.name == "get_weather"
    qwen3 = ReasoningParserManager.get_reasoning_parser("qwen3")(tokenizer)
    reasoning, content = qwen3.extract_reasoning("<think>\nhm\n</think>\n\nok", ChatCompletionRequest(**body))
    assert (reasoning.strip(), content.strip()) == ("hm", "ok")


def test_the_eos_is_what_ends_an_assistant_turn(qwen_style: Rendering, tiny_model: Path) -> None:
    import json

    config = json.loads((tiny_model / "generation_config.json").read_text())
    im_end = qwen_style.kvlane.encode("<|im_end|>")
    assert [config["eos_token_id"]] == im_end
    turn = qwen_style.assert_same(request(user("q"), {"role": "assistant", "content": "a"}, add_generation_prompt=False))
    assert turn.endswith("a<|im_end|>\n")


ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
TEXT = st.text(alphabet=st.sampled_from(list("ab xy\n.<>{}\"")), max_size=12)
PARTS = st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT), min_size=1, max_size=3)
CONTENT = TEXT | PARTS | st.none()


@st.composite
def messages(draw) -> list[dict[str, Any]]:
    turns = []
    for index in range(draw(st.integers(1, 6))):
        role = draw(ROLES)
        # Only an assistant's content may be missing (vLLM's message types require the others').
        turn: dict[str, Any] = {"role": role, "content": draw(CONTENT if role == "assistant" else TEXT | PARTS)}
        if role == "assistant" and draw(st.booleans()):
            turn["tool_calls"] = [call("get_weather", draw(st.sampled_from(['{"city": "x"}', "", "{", "7"])), f"c{index}")]
        if role == "assistant" and draw(st.booleans()):
            turn["reasoning"] = draw(TEXT)
        if role == "tool":
            turn["tool_call_id"] = f"c{index}"
        turns.append(turn)
    return turns


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=messages(), tools=st.sampled_from([None, [WEATHER], [BARE, STRICT]]), generate=st.booleans(),
       thinking=st.sampled_from([None, True, False]))
def test_any_conversation_renders_as_vllm_serve(qwen_style: Rendering, dumping: Rendering, turns, tools, generate,
                                                thinking) -> None:
    body = request(*turns, add_generation_prompt=generate)
    if tools is not None:
        body["tools"] = tools
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    for rendering in (qwen_style, dumping):
        rendering.assert_same(body)
