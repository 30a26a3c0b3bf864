"""What the sim "model" answers when a request constrains its output (pure).

The plain sim writes free words; a request that asks for a tool call or a
structured output gets a *script* instead: the exact tokens of an answer
that honours it, which the scheduler emits one per position before the
request stops. The script is a function of the request's body, its prompt
and its stream key (seed and prompt), so a request resumed on another node
continues the very same script.

* tool_choice "required" or a named tool: one call of that tool (the first
  tool for "required"), with arguments valid for its `parameters` schema;
* tool_choice "auto" (or tools without a tool_choice): a call of the first
  tool when the conversation's last turn is the user's, free text when it is
  a tool's result (the sim template's `<|tool|>` turn after the last
  `<|user|>`), as a model answers once it has what it asked a tool for;
* response_format json_schema / structured_outputs.json: an instance of the
  schema; json_object: a small object; structured_outputs.choice: one choice.

A call is written as the sim's template renders one: `<tool_call>` (a
special token), `{"name": ..., "arguments": {...}}` in character tokens,
`</tool_call>`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from msgspec import Struct

from services.worker.engines.base import RequestRejected
from services.worker.sim.schema_instance import SchemaUnsupported, schema_instance
from services.worker.sim.tool_parser import CALL_END, CALL_START
from shared.tokenizer import SPECIAL_TOKENS, SimTokenizer

USER_TURN = SPECIAL_TOKENS.index("<|user|>")
TOOL_TURN = SPECIAL_TOKENS.index("<|tool|>")
# What json_object asks for: any object; the sim writes one of this shape.
_SMALL_OBJECT = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 1}}, "required": ["answer"]}


class ApiAsks(Struct):
    """The parameters of a request body the sim engine must look at (every other one it may ignore)."""

    n: int = 1
    logprobs: Any = None
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None


def last_turn_is_tool_result(prompt_token_ids: Sequence[int]) -> bool:
    """Whether a `<|tool|>` turn follows the prompt's last `<|user|>` turn (the sim template's markers)."""
    for token_id in reversed(prompt_token_ids):
        if token_id == TOOL_TURN:
            return True
        if token_id == USER_TURN:
            return False
    return False


def called_tool(asks: ApiAsks, kind: str, prompt_token_ids: Sequence[int]) -> dict[str, Any] | None:
    """The `function` of the tool the sim calls for this request, if it calls one."""
    if kind != "chat" or not asks.tools:
        return None
    choice = asks.tool_choice
    functions = [tool.get("function") or {} for tool in asks.tools]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        return next((f for f in functions if f.get("name") == name), None)
    if choice == "required":
        return functions[0]
    if choice in (None, "auto") and not last_turn_is_tool_result(prompt_token_ids):
        return functions[0]
    return None


def scripted_output(asks: ApiAsks, kind: str, prompt_token_ids: Sequence[int], key: int) -> list[int]:
    """The tokens the sim answers this request with; [] when it writes free words.

    `key`: the choice's stream key (seed and prompt), from which every draw is made."""
    rng = random.Random(key)
    function = called_tool(asks, kind, prompt_token_ids)
    if function is not None:
        arguments = _instance(function.get("parameters") or {"type": "object"}, rng, "tools")
        if not isinstance(arguments, dict):
            raise RequestRejected("the sim engine writes tool arguments as a JSON object; the tool's parameters "
                                  "schema must describe one", param="tools")
        call = json.dumps({"name": function.get("name", ""), "arguments": arguments})
        return [CALL_START, *SimTokenizer.char_ids(call), CALL_END]
    text = _structured_text(asks, rng)
    return [] if text is None else SimTokenizer.char_ids(text)


def _structured_text(asks: ApiAsks, rng: random.Random) -> str | None:
    response_format = asks.response_format or {}
    kind = response_format.get("type", "text")
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        return json.dumps(_instance({} if schema is None else schema, rng, "response_format"))
    if kind == "json_object":
        return json.dumps(_instance(_SMALL_OBJECT, rng, "response_format"))
    if kind != "text":
        raise RequestRejected(f"response_format of type {kind!r} is not supported by the sim engine "
                              "(it honours json_schema, json_object and text)", param="response_format")
    outputs = asks.structured_outputs
    if not outputs:
        return None
    for unsupported in ("regex", "grammar", "structural_tag"):
        if outputs.get(unsupported) is not None:
            raise RequestRejected(f"structured_outputs.{unsupported} is not supported by the sim engine (it honours "
                                  "json, json_object and choice)", param="structured_outputs")
    if outputs.get("json") is not None:
        schema = outputs["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise RequestRejected(f"structured_outputs.json is not JSON: {exc}", param="structured_outputs") from None
        return json.dumps(_instance(schema, rng, "structured_outputs"))
    if outputs.get("json_object"):
        return json.dumps(_instance(_SMALL_OBJECT, rng, "structured_outputs"))
    choices = outputs.get("choice")
    if choices is not None:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise RequestRejected("structured_outputs.choice must be a list of non-empty strings", param="structured_outputs")
        chosen = rng.choice(choices)
        try:
            SimTokenizer.char_ids(chosen)
        except ValueError:
            raise RequestRejected("the sim engine writes printable ASCII only; a choice has other characters",
                                  param="structured_outputs") from None
        return chosen
    return None


def _instance(schema: Any, rng: random.Random, param: str) -> Any:
    try:
        return schema_instance(schema, rng)
    except SchemaUnsupported as exc:
        raise RequestRejected(f"{exc} (the sim engine writes JSON for a subset of JSON Schema)", param=param) from None
