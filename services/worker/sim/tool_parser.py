"""The sim model's tool-call parser, `kvlane_sim` (pure).

The sim writes a tool call as its `<tool_call>` special token, the JSON
`{"name": ..., "arguments": {...}}` in character tokens, and `</tool_call>`
(the format its chat template renders earlier calls in). The parser reads the
markers as token ids, so text between them is never mistaken for content.
Streamed, each output's delta is its content outside calls, and a call as a
whole (id, name, arguments) in the output where its closing marker arrives;
parsed whole, the same calls and the same content. What is not a well-formed
call (bad JSON, no closing marker by the end) is content, markers and all,
as vLLM's hermes parser leaves it.

A call's id is a function of the choice's stream key and the call's place,
so a request resumed elsewhere names its calls as an uninterrupted run does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from contracts.messages import OutputDelta, ParsedOutput, ParsedToolCall, ToolCallDelta
from services.worker.sim.tokens import MASK64, splitmix64
from shared.tokenizer import SPECIAL_TOKENS

TOOL_CALL_PARSER = "kvlane_sim"
CALL_START = SPECIAL_TOKENS.index("<tool_call>")
CALL_END = SPECIAL_TOKENS.index("</tool_call>")
# Keeps call ids apart from the token and logprob streams drawn from the same key.
_CALL_ID_SALT = 0x7A3C_11D5_0B9E_64F1


def tool_call_id(key: int, index: int) -> str:
    """vLLM's id form (`chatcmpl-tool-` and 32 hex digits), drawn from the stream key."""
    first = splitmix64((key ^ _CALL_ID_SALT) + 2 * index & MASK64)
    second = splitmix64((key ^ _CALL_ID_SALT) + 2 * index + 1 & MASK64)
    return f"chatcmpl-tool-{first:016x}{second:016x}"


def call_of(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of the text between a call's markers; None if it is not a call."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


class SimToolParser:
    """One choice's parser: feed it the choice's tokens in order; it keeps a call open until its closing marker."""

    def __init__(self, text_of: Callable[[int], str], key: int) -> None:
        self._text_of = text_of
        self._key = key
        self._open: list[int] | None = None  # the tokens of a call whose closing marker has not come
        self._calls = 0
        self._content: list[str] = []
        self._tool_calls: list[ParsedToolCall] = []

    def feed(self, token_ids: Sequence[int], finished: bool = False, text: str | None = None) -> OutputDelta | None:
        """What these tokens add; None when they add nothing yet (inside a call).

        `text`: what the engine released for one token, when that is not the token's own text (a stop string
        cut it, or released text held back before it); content outside calls is that text."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        released = [text] if text is not None and len(token_ids) == 1 else [None] * len(token_ids)
        for token_id, piece in zip(token_ids, released, strict=True):
            if self._open is None:
                if token_id == CALL_START:
                    self._open = []
                    if piece is not None:  # text held back before the marker comes out with it
                        content.append(piece.removesuffix(SPECIAL_TOKENS[CALL_START]))
                else:
                    content.append(self._text_of(token_id) if piece is None else piece)
            elif token_id == CALL_START:  # a call that never closed before the next began: it was text
                content.append(self._unclosed())
                self._open = []
            elif token_id == CALL_END:
                inside = "".join(self._text_of(t) for t in self._open)
                call = call_of(inside)
                if call is None:
                    content.append(SPECIAL_TOKENS[CALL_START] + inside + SPECIAL_TOKENS[CALL_END])
                else:
                    call_id = tool_call_id(self._key, self._calls)
                    calls.append(ToolCallDelta(self._calls, call_id, *call))
                    self._tool_calls.append(ParsedToolCall(*call, id=call_id))
                    self._calls += 1
                self._open = None
            else:
                self._open.append(token_id)
        if finished and self._open is not None:
            content.append(self._unclosed())
            self._open = None
        text = "".join(content)
        self._content.append(text)
        if not text and not calls:
            return None
        return OutputDelta(content=text or None, tool_calls=calls)

    def parsed(self) -> ParsedOutput:
        """Everything fed so far, parsed whole (feed the last tokens with `finished` first)."""
        content = "".join(self._content)
        if self._tool_calls:
            return ParsedOutput(content=content or None, tool_calls=list(self._tool_calls))
        return ParsedOutput(content=content)

    def _unclosed(self) -> str:
        assert self._open is not None
        return SPECIAL_TOKENS[CALL_START] + "".join(self._text_of(t) for t in self._open)
