"""Tokenizers that ingress and workers share, so both count the same tokens.

`HfTokenizer` ("hf:<model dir>", `shared/hf_tokenizer.py`) is a vLLM worker's:
the model directory's own tokenizer and chat template, rendered as `vllm serve`
renders them, loaded without transformers (no torch import).

`SimTokenizer` is the sim engine's built-in tokenizer. It needs no files:
* text splits GPT-style into pieces (a word with its leading space, a digit,
  a punctuation mark, a run of white space) and chat markers such as
  `<|user|>` (and the tool markers `<|tools|>`, `<|tool|>`, `<tool_call>`,
  `</tool_call>`) are single special tokens;
* the sim model's output vocabulary is a fixed list of pronounceable words
  (ids `OUTPUT_FIRST` .. `OUTPUT_FIRST + OUTPUT_WORDS - 1`), each decoding
  to " word"; a piece that is one of those words encodes back to its id, so
  an assistant turn fed back in a conversation tokenizes to the very ids the
  engine produced (multi-turn prefix caching works as on a real model);
* any other piece maps to a stable hashed id in the rest of the vocabulary;
* after those come character tokens, one per printable ASCII character and
  the newline (ids `CHAR_FIRST` ..): what the sim emits when it must write exact
  text (JSON for a schema, a tool call's arguments). Prompts never encode to
  them, so every earlier id stays what it was.
Decoding is exact for special, output and character tokens; hashed ids decode to "".
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from contracts.openai_api import ChatMessage, Tool


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    # add_special_tokens: as vLLM's `add_special_tokens` request field (chat: False, completions: True);
    # None: add them unless the text already starts with the BOS token.
    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]: ...

    # skip_special_tokens: False keeps markers such as the chat template's (`/detokenize` keeps them, as vLLM does).
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's own string in the vocabulary (`/tokenize`'s `token_strs`)."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: list | None = None,
    ) -> str: ...


class UnsupportedContent(ValueError):
    """A content part a text-only model cannot take (an image, audio...); `param` names it for the 400."""

    def __init__(self, param: str, part_type: str) -> None:
        super().__init__(f"{param}: content of type {part_type!r} is not supported by this text-only model; "
                         f"only text parts are")
        self.param = param
        self.part_type = part_type


# Part types whose `text` vLLM renders as text (vllm.renderers.chat_utils.MM_PARSER_MAP/TEXT_PART_TYPES);
# "refusal" and "thinking" carry their text under other keys that ContentPart does not keep.
TEXT_PART_TYPES = ("text", "input_text", "output_text")


def message_texts(message: ChatMessage, index: int) -> list[str]:
    """The message's text parts, as vLLM's parser keeps them: a part without text is skipped, a non-text part refused."""
    content = message.content
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts = []
    for position, part in enumerate(content):
        if part.type not in TEXT_PART_TYPES:
            raise UnsupportedContent(f"messages[{index}].content[{position}]", part.type)
        if part.text is not None:
            texts.append(part.text)
    return texts


# Ids 0..6 are the plain chat's, pinned by tests and sim profiles; the tool
# markers came later and take the free ids 7..10, so no id shifts.
SPECIAL_TOKENS = (
    "<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
    "<|tools|>", "<|tool|>", "<tool_call>", "</tool_call>",
)
OUTPUT_FIRST = 16
OUTPUT_WORDS = 4096
_HASHED_FIRST = OUTPUT_FIRST + OUTPUT_WORDS
# Hashed pieces keep the range they had before character tokens came (ids are pinned by tests and prefix hashes).
_HASHED_END = 32000
CHAR_FIRST = _HASHED_END
CHARS = "\n" + "".join(chr(code) for code in range(0x20, 0x7F))
VOCAB_SIZE = CHAR_FIRST + len(CHARS)
_CHAR_IDS = {char: CHAR_FIRST + i for i, char in enumerate(CHARS)}

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
# `\s+(?!\S)` leaves the last space of a run to the word after it, so "\n baba"
# splits into "\n" and " baba" (an output word), as GPT-2's pre-tokenizer does.
_PIECE_RE = re.compile(r" ?[A-Za-z]+| ?\d| ?[^\sA-Za-z\d]|\s+(?!\S)|\s+")


def _output_words() -> tuple[str, ...]:
    onsets = "b c d f g h j k l m n p r s t v w z br ch dr st tr".split()
    vowels = "a e i o u ai ea".split()
    syllables = [o + v for o, v in itertools.product(onsets, vowels)]
    words = (" " + a + b for a, b in itertools.product(syllables, syllables))
    return tuple(itertools.islice(words, OUTPUT_WORDS))


@functools.lru_cache(maxsize=1 << 16)
def _hashed_id(piece: str) -> int:
    digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
    return _HASHED_FIRST + int.from_bytes(digest, "little") % (_HASHED_END - _HASHED_FIRST)


class SimTokenizer:
    name = "sim"
    vocab_size = VOCAB_SIZE
    output_token_range = (OUTPUT_FIRST, OUTPUT_FIRST + OUTPUT_WORDS)

    def __init__(self) -> None:
        self._words = _output_words()
        self._word_ids = {word: OUTPUT_FIRST + i for i, word in enumerate(self._words)}
        self._special_ids = {token: i for i, token in enumerate(SPECIAL_TOKENS)}

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        # The sim model adds no special tokens of its own (no BOS), so the flag changes nothing.
        ids: list[int] = []
        for part in _SPECIAL_RE.split(text):
            special = self._special_ids.get(part)
            if special is not None:
                ids.append(special)
                continue
            for piece in _PIECE_RE.findall(part):
                word = self._word_ids.get(piece)
                ids.append(word if word is not None else _hashed_id(piece))
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # The sim's markers are its output too (a chat's turns), so they are never skipped.
        return "".join(self.token_text(t) for t in token_ids)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [self.token_text(t) for t in token_ids]

    def token_text(self, token_id: int) -> str:
        if OUTPUT_FIRST <= token_id < OUTPUT_FIRST + OUTPUT_WORDS:
            return self._words[token_id - OUTPUT_FIRST]
        if 0 <= token_id < len(SPECIAL_TOKENS):
            return SPECIAL_TOKENS[token_id]
        if CHAR_FIRST <= token_id < VOCAB_SIZE:
            return CHARS[token_id - CHAR_FIRST]
        return ""

    def special_id(self, token: str) -> int:
        """The id of a special token such as `<tool_call>` (KeyError for any other text)."""
        return self._special_ids[token]

    @staticmethod
    def char_ids(text: str) -> list[int]:
        """`text` as character tokens, one per character; ValueError if one is neither printable ASCII nor a newline."""
        try:
            return [_CHAR_IDS[char] for char in text]
        except KeyError as exc:
            raise ValueError(f"no character token for {exc.args[0]!r}") from None

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: list | None = None,
    ) -> str:
        """`<|role|>\\n...<|end|>\\n` turns; tools as a `<|tools|>` block of JSON lines, calls as `<tool_call>` JSON."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(CONTINUE_AND_GENERATE)
        turns = []
        if tools:
            lines = "".join(json.dumps(tool_dict(tool)) + "\n" for tool in tools)
            turns.append(f"<|tools|>\n{lines}<|end|>\n")
        for index, message in enumerate(messages):
            body = "\n".join(message_texts(message, index))
            if message.role == "assistant":
                body += "".join(
                    "<tool_call>" + json.dumps({"name": call.function.name, "arguments": tool_call_arguments(call.function.arguments)})
                    + "</tool_call>"
                    for call in message.tool_calls or ()
                )
            turns.append(f"<|{_template_role(message.role)}|>\n{body}<|end|>\n")
        if continue_final_message and turns:
            turns[-1] = turns[-1].removesuffix("<|end|>\n")
        if add_generation_prompt:
            turns.append("<|assistant|>\n")
        return "".join(turns)


def _template_role(role: str) -> str:
    return "system" if role == "developer" else role


HF_PREFIX = "hf:"
CONTINUE_AND_GENERATE = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


def tool_dict(tool: Tool) -> dict[str, Any]:
    """A tool as vLLM's `ChatCompletionToolsParam.model_dump()` gives it to the template.

    `description` and `parameters` stay as None; `strict` (and vLLM's
    `defer_loading`, here and on the tool) are dropped when None by vLLM's serializers.
    """
    function = tool.function
    definition: dict[str, Any] = {"name": function.name, "description": function.description,
                                  "parameters": function.parameters}
    if function.strict is not None:
        definition["strict"] = function.strict
    return {"type": tool.type, "function": definition}


def tool_call_arguments(arguments: str) -> dict:
    """Arguments as vLLM's `_postprocess_messages` hands them on: a JSON object's dict, else {}."""
    if not arguments:
        return {}
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
