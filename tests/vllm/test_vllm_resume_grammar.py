"""Resuming a structured output partway through its grammar, on the embedded vLLM engine.

A request resumed with `resume_token_ids = T[:k]` (what a dead worker streamed of the whole output T) runs
`prompt + T[:k]` as its prompt; its grammar must then be where T[:k] left it, not at its start. The engine core's
resumed-grammar logits processor (vllm_resumed_grammar.py) does that with vLLM's own compiled grammar: greedy,
the resumed request generates exactly T[k:].

The engine runs with `--tool-call-parser hermes --reasoning-parser qwen3 --enable-auto-tool-choice` semantics on
the tiny model (Qwen's chat tokens, random weights), as in test_vllm_api.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from contracts.messages import ApiRequest, SamplingParams
from services.worker.engines.base import EngineOutput, EngineRequest, RequestRejected
from shared.config import WorkerSettings
from tests.vllm.conftest import MODEL, engine_environment, vllm_settings

pytestmark = [pytest.mark.vllm]

jsonschema = pytest.importorskip("jsonschema")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"]}}}]
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Saint-Étienne"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
TOOL_CALL_REGEX = TOOL_CALL_TEXT.replace("{", r"\{").replace("}", r"\}")
MAX_TOKENS = 300
# A random model may go on after a tool call where the grammar lets it: stop after the first (</tool_call> is one
# token, so no resumed prefix ends inside it).
ONE_CALL = {"stop": ["</tool_call>"], "include_stop_str_in_output": True}


async def started_engine(tiny_model: Path, monkeypatch: pytest.MonkeyPatch | None = None,
                         with_processor: bool = True):
    from services.worker.engines import vllm_engine
    from services.worker.engines.vllm_setup import build_vllm_engine

    settings = vllm_settings(tiny_model, tool_call_parser="hermes", reasoning_parser="qwen3", enable_auto_tool_choice=True)
    engine, _ = build_vllm_engine(WorkerSettings(model=MODEL, engine="vllm", vllm=settings))
    if not with_processor:
        assert monkeypatch is not None
        monkeypatch.setattr(vllm_engine, "resumed_grammar_loadable", lambda args: False)
    await engine.start()
    return engine


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
async def engine(tiny_model: Path) -> AsyncIterator:
    with engine_environment():
        engine = await started_engine(tiny_model)
        yield engine
        await engine.shutdown()


def chat_prompt(tokenizer) -> list[int]:
    """A chat prompt ending in a closed <think> block: structured outputs apply from the first token."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    return list(tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                              enable_thinking=False, tokenize=True, return_dict=False))


def api_request(request_id: str, prompt: list[int], body: dict, *, stream: bool = False,
                resume: list[int] | None = None) -> EngineRequest:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=body.get("temperature", 1.0))
    api = ApiRequest(kind="chat", body=json.dumps({"model": MODEL, **body}).encode(), stream=stream)
    return EngineRequest(request_id, prompt, sampling, resume_token_ids=resume or [], api=api)


async def collect(engine, request: EngineRequest) -> list[EngineOutput]:
    return [output async for output in engine.generate(request)]


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def split_points(tokenizer, whole: list[int]) -> dict[str, int]:
    """Where to cut the whole output: inside a JSON string, right after a structural character, and others."""
    points: dict[str, int] = {}
    for k in range(1, len(whole)):
        text = tokenizer.decode(whole[:k])
        stripped = text.rstrip()
        if text.count('"') % 2 == 1 and not text.endswith('"'):
            points.setdefault("inside a string", k)
        if stripped and stripped[-1] in "{[:," and text == stripped:
            points.setdefault(f"after {stripped[-1]!r}", k)
    points.setdefault("first token", 1)
    points.setdefault("last token", len(whole) - 1)
    points.setdefault("middle", len(whole) // 2)
    return points


async def check_resumes(engine, tokenizer, name: str, body: dict, *, stream: bool = False,
                        finished: str | None = "stop") -> tuple[list[EngineOutput], dict[str, list[EngineOutput]]]:
    """The whole greedy run, and a resumed run for each split point: each generates exactly the rest."""
    prompt = chat_prompt(tokenizer)
    whole_outputs = await collect(engine, api_request(f"{name}-whole", prompt, body, stream=stream))
    whole = tokens(whole_outputs)
    if finished is not None:
        assert whole_outputs[-1].finish_reason == finished, (tokenizer.decode(whole), whole_outputs[-1])
    points = split_points(tokenizer, whole)
    assert len(whole) >= 4 and "inside a string" in points and any(p.startswith("after") for p in points), \
        (tokenizer.decode(whole), points)
    resumed: dict[str, list[EngineOutput]] = {}
    for where, k in points.items():
        outputs = await collect(engine, api_request(f"{name}-{k}", prompt, body, stream=stream, resume=whole[:k]))
        assert whole[:k] + tokens(outputs) == whole, (where, k, tokenizer.decode(whole[:k]),
                                                      tokenizer.decode(tokens(outputs)), tokenizer.decode(whole[k:]))
        assert outputs[-1].finish_reason == whole_outputs[-1].finish_reason
        resumed[where] = outputs
    return whole_outputs, resumed


async def test_the_processor_is_loaded_and_leaves_plain_requests_alone(engine) -> None:
    from services.worker.engines.vllm_resumed_grammar import RESUMED_GRAMMAR, RESUMED_GRAMMAR_PROCESSOR

    assert engine._api.resumes_grammar
    assert RESUMED_GRAMMAR_PROCESSOR in engine._running().vllm_config.model_config.logits_processors
    body = {**NO_THINKING, "temperature": 0, "response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "w", "schema": SCHEMA}}}
    plain = engine._submission(api_request("plain-submission", [1, 2, 3], body))
    assert plain.sampling.structured_outputs is not None and RESUMED_GRAMMAR not in (plain.sampling.extra_args or {})
    resumed = engine._submission(api_request("resumed-submission", [1, 2, 3], body, resume=[4, 5]))
    assert resumed.sampling.structured_outputs is None
    entry = resumed.sampling.extra_args[RESUMED_GRAMMAR]
    assert entry["type"] == "JSON" and json.loads(entry["spec"]) == SCHEMA and entry["resumed"] == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_a_json_schema_resumes_where_it_left_off(engine, tokenizer, stream: bool) -> None:
    body = {**NO_THINKING, "temperature": 0, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}
    whole_outputs, resumed = await check_resumes(engine, tokenizer, f"schema-{stream}", body, stream=stream)
    text = "".join(o.text for o in whole_outputs)
    jsonschema.validate(json.loads(text), SCHEMA)
    for where, outputs in resumed.items():
        k = len(tokens(whole_outputs)) - len(tokens(outputs))
        # What the client got: the resumed tokens' text, then this run's.
        whole_text = tokenizer.decode(tokens(whole_outputs)[:k]) + "".join(o.text for o in outputs)
        jsonschema.validate(json.loads(whole_text), SCHEMA)
        if not stream:
            assert outputs[-1].parsed == whole_outputs[-1].parsed, where


def first_call(text: str) -> dict:
    """The first hermes tool call in `text`, as JSON."""
    assert "<tool_call>" in text and "</tool_call>" in text, text
    return json.loads(text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0])


def calls(outputs: list[EngineOutput]) -> list[tuple[str, str]]:
    """The parsed tool calls, without their ids (random per run)."""
    parsed = outputs[-1].parsed
    assert parsed is not None
    return [(call.name, call.arguments) for call in parsed.tool_calls]


async def check_tool_call_resumes(engine, tokenizer, name: str, body: dict) -> None:
    # The tools are strict: their arguments follow their schema. The grammar lets a random model go on after the
    # call (another call, or text): the run stops after the first.
    whole_outputs, resumed = await check_resumes(engine, tokenizer, name, {**body, **ONE_CALL})
    whole = tokens(whole_outputs)
    call = first_call("".join(o.text for o in whole_outputs))
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], TOOLS[0]["function"]["parameters"])
    assert calls(whole_outputs)[0] == ("get_weather", json.dumps(call["arguments"], ensure_ascii=False))
    for where, outputs in resumed.items():
        k = len(whole) - len(tokens(outputs))
        assert first_call(tokenizer.decode(whole[:k]) + "".join(o.text for o in outputs)) == call, where
        assert calls(outputs) == calls(whole_outputs), where


async def test_required_tool_choice_resumes(engine, tokenizer) -> None:
    await check_tool_call_resumes(engine, tokenizer, "required",
                                  {**NO_THINKING, "temperature": 0, "tools": TOOLS, "tool_choice": "required"})


async def test_a_named_tool_choice_resumes(engine, tokenizer) -> None:
    body = {**NO_THINKING, "temperature": 0, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    await check_tool_call_resumes(engine, tokenizer, "named", body)


async def test_auto_tool_choice_with_its_structural_tag_resumes(engine, tokenizer) -> None:
    # hermes adds its structural tag for tools with tool_choice "auto"; vLLM lets a regex join it, which forces
    # the random model into the call (and lets it run on after it: it stops after the call).
    body = {**NO_THINKING, **ONE_CALL, "temperature": 0, "tools": TOOLS,
            "structured_outputs": {"regex": TOOL_CALL_REGEX}}
    whole_outputs, resumed = await check_resumes(engine, tokenizer, "auto", body)
    assert calls(whole_outputs) == [("get_weather", '{"city": "Paris", "days": 3}')]
    for where, outputs in resumed.items():
        assert calls(outputs) == calls(whole_outputs), where
        assert outputs[-1].parsed.content == whole_outputs[-1].parsed.content, where


@pytest.mark.parametrize("body, param", [
    ({"logprobs": True}, "logprobs"),
    ({"min_tokens": 30}, "min_tokens"),
])
async def test_what_the_processor_cannot_mirror_is_still_refused(engine, tokenizer, body, param) -> None:
    body = {**NO_THINKING, **body, "response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "w", "schema": SCHEMA}}}
    with pytest.raises(RequestRejected) as rejected:
        await collect(engine, api_request("refused", chat_prompt(tokenizer), body, resume=[11, 12]))
    assert rejected.value.param == param
    assert engine._running().get_num_unfinished_requests() == 0


async def test_reasoning_that_had_not_ended_is_refused(engine, tokenizer) -> None:
    messages = [{"role": "user", "content": "Think first."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=True,
                                                tokenize=True, return_dict=False))
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}
    with pytest.raises(RequestRejected, match="reasoning had not ended"):
        await collect(engine, api_request("thinking", prompt, body, resume=[11, 12]))


async def test_unresumed_requests_are_unaffected_by_the_processor(engine, tokenizer, tiny_model: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = chat_prompt(tokenizer)
    bodies = {
        "schema": {**NO_THINKING, "temperature": 0,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
        "required": {**NO_THINKING, "temperature": 0, "tools": TOOLS, "tool_choice": "required"},
        "auto": {**NO_THINKING, "temperature": 0, "tools": TOOLS, "structured_outputs": {"regex": TOOL_CALL_REGEX}},
        "free": {**NO_THINKING, "temperature": 0, "ignore_eos": True},
        "sampled": {**NO_THINKING, "temperature": 0.8, "seed": 5, "ignore_eos": True},
    }
    with_processor = {name: tokens(await collect(engine, api_request(f"with-{name}", prompt, body)))
                      for name, body in bodies.items()}
    other = await started_engine(tiny_model, monkeypatch, with_processor=False)
    try:
        assert not other._api.resumes_grammar
        assert not other._running().vllm_config.model_config.logits_processors
        without = {name: tokens(await collect(other, api_request(f"without-{name}", prompt, body)))
                   for name, body in bodies.items()}
        # Without the processor, resuming a structured output is refused as before.
        with pytest.raises(RequestRejected, match="structured outputs"):
            await collect(other, api_request("no-processor", prompt, bodies["schema"], resume=[11, 12]))
    finally:
        await other.shutdown()
    assert with_processor == without
    assert all(len(ids) >= 4 for ids in without.values()), without


# --- the processor's batch bookkeeping, without running the model ----------------------------


def test_the_processor_follows_the_batch(engine, tokenizer) -> None:
    import torch
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    from services.worker.engines.vllm_resumed_grammar import (
        RESUMED_GRAMMAR,
        ResumedGrammarLogitsProcessor,
        resumed_grammar_entry,
    )

    vllm_config = engine._running().vllm_config
    processor = ResumedGrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    vocab = vllm_config.model_config.get_vocab_size()
    spec = json.dumps(SCHEMA)

    def params(resumed: int) -> VllmSamplingParams:
        entry = resumed_grammar_entry(StructuredOutputOptions.JSON, spec, resumed)
        return VllmSamplingParams(extra_args={RESUMED_GRAMMAR: entry})

    def allowed_after(done: list[int]) -> torch.Tensor:
        """What vLLM's own grammar allows after `done`."""
        grammar = processor._xgrammar().compile_grammar(StructuredOutputOptions.JSON, spec)
        assert grammar.accept_tokens("reference", done)
        bitmask = processor._xgrammar().allocate_token_bitmask(1)
        grammar.fill_bitmask(bitmask, 0)
        logits = torch.zeros(1, vocab)
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask)
        return torch.isfinite(logits[0])

    def allowed(logits: torch.Tensor, row: int) -> torch.Tensor:
        return torch.isfinite(logits[row])

    prompt = [1, 2, 3]
    first, second = tokenizer.encode('{"city": "Pa'), tokenizer.encode('{"city":')
    outputs: list[list[int]] = [[], [], []]
    processor.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[
        (0, VllmSamplingParams(), prompt, outputs[0]),
        (1, params(len(first)), prompt + first, outputs[1]),
        (2, params(len(second)), prompt + second, outputs[2]),
    ]))
    logits = processor.apply(torch.zeros(3, vocab))
    assert torch.all(logits[0] == 0)  # a request without the entry is left alone
    assert torch.equal(allowed(logits, 1), allowed_after(first))
    assert torch.equal(allowed(logits, 2), allowed_after(second))
    assert not torch.equal(allowed_after(first), allowed_after(second))

    # The model generates: the processor reads the running output lists it was handed.
    (ris,) = tokenizer.encode("ris", add_special_tokens=False)[:1]
    outputs[1].append(ris)
    processor.update_state(None)
    logits = processor.apply(torch.zeros(3, vocab))
    assert torch.equal(allowed(logits, 1), allowed_after(first + [ris]))

    # Swapped in the batch, then one of them gone: the grammars move with their requests.
    processor.update_state(BatchUpdate(batch_size=3, removed=[], added=[],
                                       moved=[(1, 2, MoveDirectionality.SWAP)]))
    logits = processor.apply(torch.zeros(3, vocab))
    assert torch.equal(allowed(logits, 2), allowed_after(first + [ris]))
    assert torch.equal(allowed(logits, 1), allowed_after(second))
    processor.update_state(BatchUpdate(batch_size=2, removed=[2], added=[], moved=[]))
    logits = processor.apply(torch.zeros(2, vocab))
    assert torch.equal(allowed(logits, 1), allowed_after(second)) and torch.all(logits[0] == 0)
    processor.update_state(BatchUpdate(batch_size=1, removed=[], added=[],
                                       moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    logits = processor.apply(torch.zeros(1, vocab))
    assert torch.equal(allowed(logits, 0), allowed_after(second))

    # Resumed tokens the grammar refuses: only the stop tokens are left (vLLM would end the request).
    processor.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[
        (0, VllmSamplingParams(extra_args={RESUMED_GRAMMAR: resumed_grammar_entry(
            StructuredOutputOptions.JSON, spec, 1)}), prompt + tokenizer.encode("x"), []),
    ]))
    logits = processor.apply(torch.zeros(1, vocab))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    processor.update_state(BatchUpdate(batch_size=0, removed=[0], added=[], moved=[]))
    plain = torch.zeros(1, vocab)
    assert processor.apply(plain) is plain and not processor._states
