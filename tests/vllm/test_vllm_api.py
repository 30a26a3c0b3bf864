"""The vLLM engine answering `EngineRequest.api` as `vllm serve` would, on one embedded engine.

The engine runs with `--tool-call-parser hermes --reasoning-parser qwen3 --enable-auto-tool-choice`
semantics on the tiny model (Qwen's chat tokens, random weights): what a random model says is
forced, where a test needs it, with a structured-output regex.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from contracts.messages import ApiRequest, SamplingParams
from services.worker.engines.base import EngineConfigError, EngineOutput, EngineRequest, RequestRejected
from shared.config import WorkerSettings
from tests.vllm.conftest import MODEL, engine_environment, vllm_settings

pytestmark = [pytest.mark.vllm]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}]
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_CALL_REGEX = TOOL_CALL_TEXT.replace("{", r"\{").replace("}", r"\}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
async def engine(tiny_model: Path) -> AsyncIterator:
    from services.worker.engines.vllm_setup import build_vllm_engine

    with engine_environment():
        settings = vllm_settings(tiny_model, tool_call_parser="hermes", reasoning_parser="qwen3", enable_auto_tool_choice=True)
        engine, _ = build_vllm_engine(WorkerSettings(model=MODEL, engine="vllm", vllm=settings))
        await engine.start()
        yield engine
        await engine.shutdown()


def chat_prompt(tokenizer, thinking: bool = False) -> list[int]:
    """A chat prompt; without thinking it ends in a closed <think> block, so structured outputs apply at once."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    return list(tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                              enable_thinking=thinking, tokenize=True, return_dict=False))


# As the client asks for the prompt above: the parser then reads the output as the answer, not as reasoning.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def api_request(request_id: str, prompt: list[int], body: dict, *, kind: str = "chat", stream: bool = False,
                max_tokens: int = 24, resume: list[int] | None = None) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=body.get("temperature", 1.0), n=body.get("n", 1))
    api = ApiRequest(kind=kind, body=json.dumps({"model": MODEL, **body}).encode(), stream=stream)  # type: ignore[arg-type]
    return EngineRequest(request_id, prompt, sampling, resume_token_ids=resume or [], api=api)


async def collect(engine, request: EngineRequest) -> list[EngineOutput]:
    return [output async for output in engine.generate(request)]


async def pushed(engine, request: EngineRequest) -> list[EngineOutput]:
    outputs: list[EngineOutput] = []
    await engine.stream(request, outputs.append)
    return outputs


def tokens(outputs: list[EngineOutput], index: int = 0) -> list[int]:
    return [t for o in outputs if o.index == index for t in o.token_ids]


def unfinished(engine) -> int:
    return engine._running().get_num_unfinished_requests()


async def test_greedy_output_with_api_equals_the_plain_one(engine, tokenizer) -> None:
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    plain = EngineRequest("plain", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    with_api = api_request("with-api", prompt, {"temperature": 0, "max_tokens": 16, "ignore_eos": True},
                           kind="completion", max_tokens=16)
    expected, got = await collect(engine, plain), await collect(engine, with_api)
    assert tokens(got) == tokens(expected) and len(tokens(got)) == 16
    assert "".join(o.text for o in got) == "".join(o.text for o in expected)
    assert got[-1].finish_reason == "length" and all(o.finish_reason is None for o in got[:-1])


async def test_json_schema_response_format_gives_valid_json(engine, tokenizer) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    body = {**NO_THINKING, "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
    outputs = await collect(engine, api_request("json", chat_prompt(tokenizer), body, max_tokens=64))
    final = outputs[-1]
    assert final.finish_reason == "stop" and final.parsed is not None, outputs
    assert final.parsed.content, ("".join(o.text for o in outputs), final.parsed)
    assert json.loads(final.parsed.content or "")["city"] in ("Paris", "Rome")
    assert json.loads("".join(o.text for o in outputs)) == json.loads(final.parsed.content or "")


async def test_logprobs_come_per_token_with_their_ranked_tokens(engine, tokenizer) -> None:
    prompt = tokenizer.encode("Tea and cats.")
    body = {"temperature": 0, "logprobs": 3, "max_tokens": 6, "ignore_eos": True}
    outputs = await pushed(engine, api_request("logprobs", prompt, body, kind="completion", max_tokens=6))
    entries = [entry for o in outputs for entry in o.logprobs]
    assert all(len(o.logprobs) == len(o.token_ids) for o in outputs)
    assert [e.token_id for e in entries] == tokens(outputs) and len(entries) == 6
    for entry in entries:
        assert entry.logprob is not None and entry.logprob <= 0.0
        assert 3 <= len(entry.top) <= 4  # the top 3, and the sampled token where it is not among them
        # Greedy: the sampled token ranks first.
        assert entry.top[0].token_id == entry.token_id and entry.top[0].logprob == entry.logprob
        # Named as vLLM's detokenizer named it for the position (a piece of a character may be named "").
        assert entry.token == entry.top[0].token and entry.bytes == list(entry.token.encode("utf-8", errors="replace"))


async def test_chat_logprobs_without_a_request_for_them_are_left_out(engine, tokenizer) -> None:
    outputs = await collect(engine, api_request("no-logprobs", chat_prompt(tokenizer), {"temperature": 0}, max_tokens=4))
    assert all(o.logprobs == [] for o in outputs)


@pytest.mark.parametrize("how", [collect, pushed])
async def test_n_choices_each_come_indexed_and_finished(engine, tokenizer, how) -> None:
    body = {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 10, "ignore_eos": True}
    outputs = await how(engine, api_request(f"n2-{how.__name__}", tokenizer.encode("Once upon a time"), body,
                                            kind="completion", max_tokens=10))
    assert {o.index for o in outputs} == {0, 1}
    for index in (0, 1):
        choice = [o for o in outputs if o.index == index]
        assert choice[-1].finish_reason == "length" and all(o.finish_reason is None for o in choice[:-1])
        assert len(tokens(outputs, index)) == 10
    assert unfinished(engine) == 0 and engine.stats().prefilling == 0


async def test_each_chat_choice_is_parsed_by_its_own_parser(engine, tokenizer) -> None:
    body = {**NO_THINKING, "n": 2, "temperature": 1.0, "seed": 3, "ignore_eos": True, "stream": True}
    outputs = await pushed(engine, api_request("n2-chat", chat_prompt(tokenizer), body, stream=True, max_tokens=8))
    for index in (0, 1):
        choice = [o for o in outputs if o.index == index]
        assert choice[-1].finish_reason == "length" and any(o.delta is not None for o in choice)
    whole = await collect(engine, api_request("n2-chat-whole", chat_prompt(tokenizer), {**body, "stream": False},
                                              max_tokens=8))
    assert sorted(o.index for o in whole if o.parsed is not None) == [0, 1]


@pytest.mark.parametrize("body, param", [
    ({"temperature": "hot"}, "body.temperature"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
])
async def test_a_body_vllm_refuses_is_rejected_as_vllm_words_it(engine, tokenizer, body, param) -> None:
    with pytest.raises(RequestRejected) as rejected:
        await collect(engine, api_request("bad", chat_prompt(tokenizer), body))
    assert rejected.value.param == param
    assert str(rejected.value).startswith("1 validation error:") or "must be" in str(rejected.value)
    assert unfinished(engine) == 0


async def test_a_forced_tool_call_is_parsed_whole(engine, tokenizer) -> None:
    body = {**NO_THINKING, "temperature": 0, "tools": TOOLS, "structured_outputs": {"regex": TOOL_CALL_REGEX}}
    outputs = await collect(engine, api_request("tool-whole", chat_prompt(tokenizer), body, max_tokens=64))
    final = outputs[-1]
    # The tools' structural tag (hermes, tool_choice "auto") joins the regex in the grammar, which then lets a
    # random model run on after the call: only the call is checked.
    assert final.finish_reason is not None and final.parsed is not None
    (call,) = final.parsed.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert not final.parsed.content and all(o.delta is None for o in outputs)


async def test_a_forced_tool_call_is_parsed_as_it_streams(engine, tokenizer) -> None:
    body = {**NO_THINKING, "temperature": 0, "tools": TOOLS, "structured_outputs": {"regex": TOOL_CALL_REGEX},
            "stream": True}
    outputs = await pushed(engine, api_request("tool-stream", chat_prompt(tokenizer), body, stream=True, max_tokens=64))
    calls = [call for o in outputs if o.delta is not None for call in o.delta.tool_calls]
    assert [c.name for c in calls if c.name] == ["get_weather"]
    assert json.loads("".join(c.arguments or "" for c in calls)) == {"city": "Paris"}
    assert all(o.parsed is None for o in outputs) and outputs[-1].finish_reason is not None


async def test_a_resumed_request_parses_what_the_whole_run_would(engine, tokenizer) -> None:
    prompt = chat_prompt(tokenizer, thinking=True)
    body = {"temperature": 0, "ignore_eos": True}
    whole = await collect(engine, api_request("whole", prompt, body, max_tokens=20))
    done = tokens(whole)[:8]
    resumed = await collect(engine, api_request("resumed", prompt, body, max_tokens=20, resume=done))
    assert done + tokens(resumed) == tokens(whole)
    assert resumed[-1].parsed == whole[-1].parsed


async def test_a_resumed_stream_continues_the_parse(engine, tokenizer) -> None:
    prompt = chat_prompt(tokenizer, thinking=True)
    body = {"temperature": 0, "ignore_eos": True, "stream": True}
    whole = await pushed(engine, api_request("whole-stream", prompt, body, stream=True, max_tokens=20))
    done = tokens(whole)[:8]
    resumed = await pushed(engine, api_request("resumed-stream", prompt, body, stream=True, max_tokens=20, resume=done))
    assert done + tokens(resumed) == tokens(whole)
    # The parser is primed with what was streamed before: reasoning goes on as reasoning, content as content.
    def kinds(outputs: list[EngineOutput]) -> list[str]:
        return ["reasoning" if o.delta.reasoning else "content" for o in outputs if o.delta is not None]

    assert kinds(resumed) == kinds(whole)[-len(kinds(resumed)):]


@pytest.mark.parametrize("body, thinking, param", [
    # A structured output resumes (test_vllm_resume_grammar.py), but not where vLLM's grammar started partway
    # through the output (after the reasoning) nor where a logits processor cannot mirror vLLM's logprobs.
    ({"response_format": {"type": "json_object"}}, True, "response_format"),
    ({"response_format": {"type": "json_object"}, "logprobs": True}, False, "logprobs"),
    ({"n": 2}, False, "n"),
])
async def test_resuming_what_cannot_resume_is_rejected(engine, tokenizer, body, thinking, param) -> None:
    with pytest.raises(RequestRejected) as rejected:
        await collect(engine, api_request("no-resume", chat_prompt(tokenizer, thinking), body, resume=[11, 12]))
    assert rejected.value.param == param


def test_auto_tool_choice_without_a_parser_never_starts(tiny_model: Path) -> None:
    from services.worker.engines.vllm_setup import build_vllm_engine

    settings = vllm_settings(tiny_model, enable_auto_tool_choice=True)
    with pytest.raises(EngineConfigError, match="tool_call_parser"):
        build_vllm_engine(WorkerSettings(model=MODEL, engine="vllm", vllm=settings))


# --- the pure pieces, without an engine ---------------------------------------------------


class NamingTokenizer:
    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else ids
        return "".join(f"<{i}>" for i in ids)


def test_token_logprobs_follow_vllm_chat_serving() -> None:
    from vllm.logprobs import Logprob

    from services.worker.engines.vllm_api import token_logprobs

    positions = [
        {5: Logprob(-0.5, rank=1, decoded_token="é"), 9: Logprob(float("-inf"), rank=2, decoded_token=None)},
        None,  # a position vLLM gave nothing for
    ]
    first, second = token_logprobs([5, 7], positions, NamingTokenizer())
    assert (first.token, first.logprob, first.bytes, first.token_id) == ("é", -0.5, [0xC3, 0xA9], 5)
    assert [(t.token, t.logprob, t.token_id) for t in first.top] == [("é", -0.5, 5), ("<9>", -9999.0, 9)]
    assert first.top[1].bytes == list(b"<9>")
    assert (second.token, second.logprob, second.bytes, second.top) == ("<7>", None, list(b"<7>"), [])
    as_ids = token_logprobs([5], positions[:1], NamingTokenizer(), as_token_ids=True)[0]
    assert as_ids.token == "token_id:5" and as_ids.top[1].token == "token_id:9"


def test_output_delta_and_parsed_output_carry_every_piece() -> None:
    from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall

    from contracts.messages import ParsedToolCall, ToolCallDelta
    from services.worker.engines.vllm_api import output_delta, parsed_output

    message = DeltaMessage(content="", reasoning="hm", tool_calls=[
        DeltaToolCall(index=0, id="call-1", type="function", function=DeltaFunctionCall(name="f", arguments='{"a"')),
        DeltaToolCall(index=0, function=None)])
    delta = output_delta(message)
    assert (delta.content, delta.reasoning) == ("", "hm")
    assert delta.tool_calls == [ToolCallDelta(0, "call-1", "f", '{"a"'), ToolCallDelta(0)]
    parsed = parsed_output(None, "hi", [FunctionCall(id="c", name="f", arguments="{}")], 3)
    assert parsed.tool_calls == [ParsedToolCall("f", "{}", "c")] and parsed.reasoning_tokens == 3
    assert parsed_output("r", None, None, 0).tool_calls == []


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_body_without_its_prompt_parses(kind: str) -> None:
    from services.worker.engines.vllm_api import parse_api_request

    body = {"model": MODEL, "temperature": 0.5, "logprobs": True if kind == "chat" else 2, "n": 3, "seed": 1}
    request = parse_api_request(ApiRequest(kind=kind, body=json.dumps(body).encode()))  # type: ignore[arg-type]
    assert (request.temperature, request.n, request.seed) == (0.5, 3, 1)


@pytest.mark.parametrize("raw, param, wording", [
    (b"[1]", None, "must be a JSON object"),
    (b"{nope", None, "not JSON"),
    (b'{"temperature": "hot"}', "body.temperature", "1 validation error:\n  {'type': 'float_parsing'"),
    (b'{"stream_options": {"include_usage": true}}', "stream_options", "Stream options can only be defined"),
    (b'{"tools": []}', "tools", "`tools` must not be an empty array"),
])
def test_a_refused_body_is_worded_as_vllm_serve_words_it(raw: bytes, param: str | None, wording: str) -> None:
    from services.worker.engines.vllm_api import parse_api_request

    with pytest.raises(RequestRejected) as rejected:
        parse_api_request(ApiRequest(kind="chat", body=raw))
    assert rejected.value.param == param and wording in str(rejected.value)


@pytest.mark.parametrize("tool_choice, wording", [
    ("auto", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ("required", 'tool_choice="required" requires --tool-call-parser to be set'),
    ({"type": "function", "function": {"name": "get_weather"}},
     'tool_choice=function "get_weather" requires --tool-call-parser to be set'),
])
def test_a_tool_choice_without_a_tool_parser_is_refused(tool_choice, wording: str) -> None:
    from services.worker.engines.vllm_api import check_tool_choice_servable, parse_api_request

    body = json.dumps({"tools": TOOLS, "tool_choice": tool_choice}).encode()
    request = parse_api_request(ApiRequest(kind="chat", body=body))
    with pytest.raises(RequestRejected, match=wording.replace("(", r"\(").replace('"', '"')):
        check_tool_choice_servable(request, None, enable_auto_tools=False)  # type: ignore[arg-type]
    no_tools = parse_api_request(ApiRequest(kind="chat", body=b"{}"))
    check_tool_choice_servable(no_tools, None, enable_auto_tools=False)  # type: ignore[arg-type]
