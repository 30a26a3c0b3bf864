"""The sim engine's OpenAI surface: character tokens, scripted answers, its tool-call parser, logprobs, `n`."""

from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.messages import ApiRequest, SamplingParams
from services.worker.engines.base import EngineRequest, RequestRejected
from services.worker.engines.sim import SimEngine
from services.worker.sim import SimRequest, SimScheduler, get_profile
from services.worker.sim.logprobs import token_logprob
from services.worker.sim.responder import ApiAsks, last_turn_is_tool_result, scripted_output
from services.worker.sim.schema_instance import SchemaUnsupported, conforms, schema_instance
from services.worker.sim.tool_parser import CALL_END, CALL_START, SimToolParser
from shared.config import SimSettings
from shared.tokenizer import CHAR_FIRST, CHARS, OUTPUT_FIRST, OUTPUT_WORDS, VOCAB_SIZE, SimTokenizer

TOKENIZER = SimTokenizer()
WORDS = (OUTPUT_FIRST, OUTPUT_FIRST + OUTPUT_WORDS)


# --- character tokens ---------------------------------------------------------------


def test_character_tokens_follow_the_old_vocabulary_and_decode_to_their_character() -> None:
    assert CHAR_FIRST == 32000 and VOCAB_SIZE == 32000 + 96
    assert TOKENIZER.char_ids("\n") == [32000] and TOKENIZER.char_ids(" ") == [32001] and TOKENIZER.char_ids("~") == [32095]
    text = '{"a": [1, 2.5, "x\\n"]}\n'
    assert TOKENIZER.decode(TOKENIZER.char_ids(text)) == text
    assert TOKENIZER.token_strings(TOKENIZER.char_ids("ab")) == ["a", "b"]
    assert "".join(CHARS[1:]) == "".join(chr(c) for c in range(32, 127))
    with pytest.raises(ValueError):
        TOKENIZER.char_ids("é")


def test_prompts_never_encode_to_character_tokens() -> None:
    ids = TOKENIZER.encode('<|user|>\n{"a": 1} and some words !?<|end|>\n')
    assert all(t < CHAR_FIRST for t in ids)


# --- JSON schema instances -------------------------------------------------------------

LEAVES = st.one_of(
    st.builds(lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
              st.integers(0, 5), st.integers(0, 20)),
    st.just({"type": "string"}),
    st.sampled_from([{"type": "string", "format": f} for f in ("date-time", "date", "email", "uuid")]),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span}, st.integers(-50, 50), st.integers(0, 9)),
    st.builds(lambda lo, span: {"type": "number", "exclusiveMinimum": lo, "exclusiveMaximum": lo + span},
              st.floats(-1e6, 1e6), st.floats(0.001, 100)),
    st.just({"type": "integer"}),
    st.just({"type": "number", "minimum": 0}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.just({"type": ["string", "null"]}),
    st.builds(lambda values: {"enum": values}, st.lists(st.one_of(st.text(max_size=5), st.integers(), st.booleans()), min_size=1, max_size=4)),
    st.builds(lambda value: {"const": value}, st.one_of(st.text(max_size=5), st.integers(), st.none())),
    st.just({"title": "anything", "description": "no constraint"}),
)


def _composites(children):
    names = st.text("abcdefgh_", min_size=1, max_size=6)
    objects = st.builds(
        lambda props, data: {"type": "object", "properties": props,
                             "required": data.draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else [],
                             "additionalProperties": False},
        st.dictionaries(names, children, max_size=4), st.data())
    arrays = st.builds(lambda items, lo, span: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + span},
                       children, st.integers(0, 3), st.integers(0, 3))
    unions = st.builds(lambda branches: {"anyOf": branches}, st.lists(children, min_size=1, max_size=3))
    exclusive = st.builds(lambda branches: {"oneOf": branches},
                          st.lists(st.sampled_from([{"type": "string"}, {"type": "boolean"}, {"type": "null"},
                                                    {"type": "array", "items": {"type": "integer"}}]),
                                   min_size=1, max_size=4, unique_by=json.dumps))
    return st.one_of(objects, arrays, unions, exclusive)


SCHEMAS = st.recursive(LEAVES, _composites, max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**64 - 1))
def test_an_instance_is_valid_for_its_schema_and_a_function_of_the_seed(schema: dict, seed: int) -> None:
    instance = schema_instance(schema, random.Random(seed))
    jsonschema.validate(instance, schema, cls=jsonschema.Draft202012Validator)
    assert conforms(instance, schema)
    assert schema_instance(schema, random.Random(seed)) == instance
    # The JSON the sim writes is printable ASCII: every character has a token.
    TOKENIZER.char_ids(json.dumps(instance))


def test_references_into_the_schema_are_followed() -> None:
    schema = {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
              "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 2}
    instance = schema_instance(schema, random.Random(1))
    jsonschema.validate(instance, schema)
    assert len(instance) >= 2


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "a+"},
    {"allOf": [{"type": "string"}]},
    {"type": "object", "properties": {"a": {"not": {"type": "null"}}}, "required": ["a"]},
    {"type": "integer", "minimum": 3, "maximum": 2},
    {"type": "array", "items": [{"type": "string"}]},
    {"$ref": "https://example.com/schema"},
    {"type": "string", "format": "hostname"},
])
def test_keywords_the_sim_cannot_satisfy_are_refused(schema: dict) -> None:
    with pytest.raises(SchemaUnsupported):
        schema_instance(schema, random.Random(0))


# --- scripted answers --------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
USER_TURN = TOKENIZER.encode("<|user|>\nweather?<|end|>\n<|assistant|>\n")
TOOL_TURN = USER_TURN + TOKENIZER.encode('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><|end|>\n'
                                         "<|tool|>\nsunny<|end|>\n<|assistant|>\n")


def _call(script: list[int]) -> dict:
    assert script[0] == CALL_START and script[-1] == CALL_END
    return json.loads(TOKENIZER.decode(script[1:-1]))


def test_a_required_or_named_tool_choice_is_one_call_with_valid_arguments() -> None:
    required = _call(scripted_output(ApiAsks(tools=TOOLS, tool_choice="required"), "chat", USER_TURN, 5))
    assert required["name"] == "get_weather"
    jsonschema.validate(required["arguments"], TOOLS[0]["function"]["parameters"])
    named = ApiAsks(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert _call(scripted_output(named, "chat", TOOL_TURN, 5)) == {"name": "get_time", "arguments": {}}


def test_auto_calls_the_first_tool_after_a_user_turn_and_answers_in_words_after_a_tool_result() -> None:
    assert not last_turn_is_tool_result(USER_TURN) and last_turn_is_tool_result(TOOL_TURN)
    for choice in (None, "auto"):
        assert _call(scripted_output(ApiAsks(tools=TOOLS, tool_choice=choice), "chat", USER_TURN, 5))["name"] == "get_weather"
        assert scripted_output(ApiAsks(tools=TOOLS, tool_choice=choice), "chat", TOOL_TURN, 5) == []
    assert scripted_output(ApiAsks(tools=TOOLS, tool_choice="none"), "chat", USER_TURN, 5) == []


def test_structured_outputs() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for asks in (ApiAsks(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
                 ApiAsks(structured_outputs={"json": schema}), ApiAsks(structured_outputs={"json": json.dumps(schema)})):
        jsonschema.validate(json.loads(TOKENIZER.decode(scripted_output(asks, "chat", USER_TURN, 9))), schema)
    assert isinstance(json.loads(TOKENIZER.decode(scripted_output(ApiAsks(response_format={"type": "json_object"}), "chat", USER_TURN, 9))), dict)
    assert TOKENIZER.decode(scripted_output(ApiAsks(structured_outputs={"choice": ["yes", "no"]}), "completion", [1], 9)) in ("yes", "no")
    assert scripted_output(ApiAsks(response_format={"type": "text"}), "chat", USER_TURN, 9) == []


@pytest.mark.parametrize(("asks", "param"), [
    (ApiAsks(structured_outputs={"regex": "a+"}), "structured_outputs"),
    (ApiAsks(structured_outputs={"grammar": "root ::= x"}), "structured_outputs"),
    (ApiAsks(response_format={"type": "structural_tag"}), "response_format"),
    (ApiAsks(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "x"}}}), "response_format"),
    (ApiAsks(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "x"}}, "required": ["a"]}}}], tool_choice="required"), "tools"),
])
def test_what_the_sim_cannot_write_is_refused_naming_the_parameter(asks: ApiAsks, param: str) -> None:
    with pytest.raises(RequestRejected) as caught:
        scripted_output(asks, "chat", USER_TURN, 1)
    assert caught.value.param == param


# --- the scheduler runs scripts -------------------------------------------------------------


def _scheduler() -> SimScheduler:
    return SimScheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_batched_tokens=64,
                        profile=get_profile("tiny-cpu"), output_token_range=WORDS)


def _run(scheduler: SimScheduler, *requests: SimRequest) -> dict[str, list[int]]:
    emitted: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        scheduler.add(r)
    while scheduler.has_work():
        for request_id, token in scheduler.step().emitted:
            emitted[request_id].append(token)
    return emitted


def test_a_script_is_emitted_then_stops_and_max_tokens_cuts_it() -> None:
    script = TOKENIZER.char_ids('{"a": 1}')
    out = _run(_scheduler(), SimRequest("s", [1, 2, 3], 50, 0, script=script), SimRequest("cut", [1, 2, 3], 4, 0, script=script),
               SimRequest("free", [1, 2, 3], 5, 0))
    assert out["s"] == script and out["cut"] == script[:4]
    assert out["free"] == _run(_scheduler(), SimRequest("free", [1, 2, 3], 5, 0))["free"]


def test_a_resumed_script_continues_where_it_was() -> None:
    script = TOKENIZER.char_ids('{"name": "x"}')
    whole = _run(_scheduler(), SimRequest("r", [4, 5], 50, 3, script=script))["r"]
    rest = _run(_scheduler(), SimRequest("r", [4, 5], 50, 3, resume_output=whole[:6], script=script))["r"]
    assert whole[:6] + rest == whole == script
    with pytest.raises(ValueError, match="past the end"):
        _scheduler().add(SimRequest("r", [4, 5], 50, 3, resume_output=script, script=script))


# --- the kvlane_sim parser -------------------------------------------------------------------

WORD = OUTPUT_FIRST + 7


def _calls(*calls: str) -> list[int]:
    tokens = [WORD]
    for call in calls:
        tokens += [CALL_START, *TOKENIZER.char_ids(call), CALL_END, WORD]
    return tokens


PARSER_CASES = [
    [WORD, WORD + 1],
    _calls('{"name": "f", "arguments": {"a": 1}}'),
    _calls('{"name": "f", "arguments": {}}', '{"name": "g", "arguments": {"b": [true]}}'),
    _calls("not json"),
    [WORD, CALL_START, *TOKENIZER.char_ids('{"name": "f"')],  # cut off by max_tokens
    [CALL_START, *TOKENIZER.char_ids('{"name": "f"}'), CALL_END],
]


@given(case=st.sampled_from(PARSER_CASES), cuts=st.lists(st.integers(0, 80), max_size=6))
def test_streamed_deltas_reassemble_into_the_whole_parse(case: list[int], cuts: list[int]) -> None:
    whole = SimToolParser(TOKENIZER.token_text, 11)
    whole.feed(case, finished=True)
    parsed = whole.parsed()
    streamed = SimToolParser(TOKENIZER.token_text, 11)
    bounds = sorted({0, len(case), *(c for c in cuts if c < len(case))})
    deltas = [streamed.feed(case[a:b], finished=b == len(case)) for a, b in zip(bounds, bounds[1:])]
    content = "".join(d.content or "" for d in deltas if d is not None)
    calls = [c for d in deltas if d is not None for c in d.tool_calls]
    assert content == (parsed.content or "")
    assert [(c.index, c.id, c.name, c.arguments) for c in calls] == [
        (i, p.id, p.name, p.arguments) for i, p in enumerate(parsed.tool_calls)]
    assert streamed.parsed() == parsed


def test_the_parser_reads_calls_and_leaves_the_rest_as_content() -> None:
    parser = SimToolParser(TOKENIZER.token_text, 11)
    parser.feed(_calls('{"name": "f", "arguments": {"a": 1}}'), finished=True)
    parsed = parser.parsed()
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", {"a": 1})]
    assert parsed.content == TOKENIZER.token_text(WORD) * 2
    assert parsed.tool_calls[0].id.startswith("chatcmpl-tool-") and len(parsed.tool_calls[0].id) == 14 + 32
    only_text = SimToolParser(TOKENIZER.token_text, 11)
    only_text.feed(PARSER_CASES[3], finished=True)
    assert only_text.parsed().tool_calls == [] and "<tool_call>not json</tool_call>" in only_text.parsed().content


# --- logprobs ------------------------------------------------------------------------------------


@given(key=st.integers(0, 2**64 - 1), position=st.integers(0, 10_000), token=st.integers(0, VOCAB_SIZE - 1),
       ranked=st.integers(0, 21))
def test_logprobs_are_a_function_of_the_stream_and_ranked_below_the_sampled_token(key: int, position: int, token: int, ranked: int) -> None:
    entry = token_logprob(key, position, token, ranked, WORDS, TOKENIZER.token_text)
    assert entry == token_logprob(key, position, token, ranked, WORDS, TOKENIZER.token_text)
    assert entry.token == TOKENIZER.token_text(token) and entry.token_id == token
    assert entry.bytes == list(entry.token.encode())
    assert entry.logprob is not None and entry.logprob <= 0
    assert len(entry.top) == ranked
    if ranked:
        assert entry.top[0].token_id == token and entry.top[0].logprob == entry.logprob
        assert all(a.logprob > b.logprob for a, b in zip(entry.top, entry.top[1:]))
        assert len({t.token_id for t in entry.top}) == ranked


# --- the engine ------------------------------------------------------------------------------------


def _request(body: dict, kind: str = "chat", stream: bool = True, n: int = 1, max_tokens: int = 120,
             resumed: list[int] | None = None, prompt: list[int] = USER_TURN) -> EngineRequest:
    return EngineRequest("r", prompt, SamplingParams(max_tokens=max_tokens, n=n, seed=4), resumed or [],
                         api=ApiRequest(kind, json.dumps(body).encode(), stream))  # type: ignore[arg-type]


async def _outputs(request: EngineRequest, settings: SimSettings | None = None) -> list:
    engine = SimEngine(settings or SimSettings(speed=1000.0), TOKENIZER)
    await engine.start()
    try:
        return [o async for o in engine.generate(request)]
    finally:
        await engine.shutdown()


def _reassembled(outputs: list) -> tuple[str, list]:
    content = "".join(o.delta.content or "" for o in outputs if o.delta is not None)
    calls = [(c.id, c.name, c.arguments) for o in outputs if o.delta is not None for c in o.delta.tool_calls]
    return content, calls


@pytest.mark.parametrize("body", [
    {"tools": TOOLS},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": TOOLS[0]["function"]["parameters"]}}},
    {"logprobs": True, "top_logprobs": 3},
])
@pytest.mark.parametrize("stream", [True, False])
def test_a_resumed_request_answers_as_an_uninterrupted_one(body: dict, stream: bool) -> None:
    whole = asyncio.run(_outputs(_request(body, stream=stream)))
    tokens = [t for o in whole for t in o.token_ids]
    cut = len(tokens) // 2
    rest = asyncio.run(_outputs(_request(body, stream=stream, resumed=tokens[:cut])))
    assert tokens[:cut] + [t for o in rest for t in o.token_ids] == tokens
    assert whole[-1].finish_reason == rest[-1].finish_reason
    if stream:
        first = _reassembled(whole[:cut])
        second = _reassembled(rest)
        assert (first[0] + second[0], first[1] + second[1]) == _reassembled(whole)
    else:
        assert rest[-1].parsed == whole[-1].parsed
    assert [lp for o in whole for lp in o.logprobs][cut:] == [lp for o in rest for lp in o.logprobs]


def test_n_choices_each_run_their_own_stream_and_finish() -> None:
    outputs = asyncio.run(_outputs(_request({"logprobs": 2}, kind="completion", n=3, max_tokens=6)))
    texts = {i: "".join(o.text for o in outputs if o.index == i) for i in range(3)}
    assert len(set(texts.values())) == 3
    assert sorted(o.index for o in outputs if o.finish_reason) == [0, 1, 2]
    assert all(o.finish_reason == "length" for o in outputs if o.finish_reason)
    assert all(len(o.logprobs) == 1 and len(o.logprobs[0].top) == 3 for o in outputs)
    # Choice 0 is what n = 1 answers.
    single = asyncio.run(_outputs(_request({"logprobs": 2}, kind="completion", max_tokens=6)))
    assert "".join(o.text for o in single) == texts[0]


def test_a_scripted_answer_stops_and_a_short_max_tokens_cuts_it() -> None:
    body = {"tools": TOOLS, "tool_choice": "required"}
    done = asyncio.run(_outputs(_request(body, stream=False)))
    assert done[-1].finish_reason == "stop" and done[-1].parsed.tool_calls[0].name == "get_weather"
    cut = asyncio.run(_outputs(_request(body, stream=False, max_tokens=5)))
    assert cut[-1].finish_reason == "length" and cut[-1].parsed.tool_calls == []


def test_a_plain_chat_is_parsed_into_content_with_the_same_words() -> None:
    parsed = asyncio.run(_outputs(_request({}, max_tokens=8)))
    plain = asyncio.run(_outputs(_request({}, max_tokens=8), SimSettings(speed=1000.0, tool_call_parser="")))
    assert [o.token_ids for o in parsed] == [o.token_ids for o in plain]
    assert _reassembled(parsed) == ("".join(o.text for o in plain), [])
    assert all(o.delta is None for o in plain)


def test_tool_choices_need_the_parser() -> None:
    engine = SimEngine(SimSettings(tool_call_parser=""), TOKENIZER)
    with pytest.raises(RequestRejected) as caught:
        engine.check(_request({"tools": TOOLS, "tool_choice": "required"}))
    assert caught.value.param == "tool_choice"
    engine.check(_request({"response_format": {"type": "json_object"}}))


@pytest.mark.parametrize(("body", "param"), [
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"min_tokens": 3}, "min_tokens"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_what_needs_a_distribution_is_still_refused(body: dict, param: str) -> None:
    with pytest.raises(RequestRejected) as caught:
        SimEngine(SimSettings(), TOKENIZER).check(_request(body))
    assert caught.value.param == param


def test_n_above_one_is_not_resumed() -> None:
    with pytest.raises(RequestRejected) as caught:
        SimEngine(SimSettings(), TOKENIZER).check(_request({}, n=2, resumed=[WORD]))
    assert caught.value.param == "n"


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_string_cuts_the_parsed_content_as_it_cuts_the_text(stream: bool) -> None:
    free = asyncio.run(_outputs(_request({}, max_tokens=6)))
    words = "".join(o.text for o in free).split()
    request = _request({}, stream=stream, max_tokens=6)
    request = EngineRequest("r", request.prompt_token_ids, SamplingParams(max_tokens=6, seed=4, stop=[words[2]]),
                            api=request.api)
    stopped = asyncio.run(_outputs(request))
    text = "".join(o.text for o in stopped)
    assert text.split() == words[:2] and stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == words[2]
    assert (_reassembled(stopped)[0] if stream else stopped[-1].parsed.content) == text
