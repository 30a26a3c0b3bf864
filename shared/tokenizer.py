"""Tokenizers that ingress and workers share, so both count the same tokens.

`HfTokenizer` ("hf:<model dir>") is a vLLM worker's: the model directory's own
tokenizer and chat template, loaded with transformers.

`SimTokenizer` is the sim engine's built-in tokenizer. It needs no files:
* text splits GPT-style into pieces (a word with its leading space, a digit,
  a punctuation mark, a run of white space) and chat markers such as
  `<|user|>` are single special tokens;
* the sim model's output vocabulary is a fixed list of pronounceable words
  (ids `OUTPUT_FIRST` .. `OUTPUT_FIRST + OUTPUT_WORDS - 1`), each decoding
  to " word"; a piece that is one of those words encodes back to its id, so
  an assistant turn fed back in a conversation tokenizes to the very ids the
  engine produced (multi-turn prefix caching works as on a real model);
* any other piece maps to a stable hashed id in the rest of the vocabulary.
Decoding is exact for special and output tokens; hashed ids decode to "".
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from collections.abc import Sequence
from typing import Protocol

from contracts.openai_api import ChatMessage


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str: ...


SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
OUTPUT_FIRST = 16
OUTPUT_WORDS = 4096
VOCAB_SIZE = 32000
_HASHED_FIRST = OUTPUT_FIRST + OUTPUT_WORDS

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
    return _HASHED_FIRST + int.from_bytes(digest, "little") % (VOCAB_SIZE - _HASHED_FIRST)


class SimTokenizer:
    name = "sim"
    vocab_size = VOCAB_SIZE
    output_token_range = (OUTPUT_FIRST, OUTPUT_FIRST + OUTPUT_WORDS)

    def __init__(self) -> None:
        self._words = _output_words()
        self._word_ids = {word: OUTPUT_FIRST + i for i, word in enumerate(self._words)}
        self._special_ids = {token: i for i, token in enumerate(SPECIAL_TOKENS)}

    def encode(self, text: str) -> list[int]:
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

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self.token_text(t) for t in token_ids)

    def token_text(self, token_id: int) -> str:
        if OUTPUT_FIRST <= token_id < OUTPUT_FIRST + OUTPUT_WORDS:
            return self._words[token_id - OUTPUT_FIRST]
        if 0 <= token_id < len(SPECIAL_TOKENS):
            return SPECIAL_TOKENS[token_id]
        return ""

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str:
        turns = "".join(f"<|{_template_role(m.role)}|>\n{m.text()}<|end|>\n" for m in messages)
        return turns + "<|assistant|>\n"


def _template_role(role: str) -> str:
    return "system" if role == "developer" else role


HF_PREFIX = "hf:"


class HfTokenizer:
    """A Hugging Face tokenizer loaded from a local model directory (a vLLM worker's).

    Ingress encodes with it exactly as the engine would, so prompt token
    counts, the context check and block hashes match what the engine sees.
    """

    def __init__(self, directory: str) -> None:
        # Imported here: the sim path (and ingress serving only sim workers)
        # must not need transformers installed.
        from transformers import AutoTokenizer

        self.directory = directory
        self.name = HF_PREFIX + directory
        self._tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.vocab_size = len(self._tokenizer)
        self._bos = self._tokenizer.bos_token

    def encode(self, text: str) -> list[int]:
        # A rendered chat template already starts with the BOS token; adding
        # special tokens again would double it (vLLM's server skips them for
        # chat and adds them for plain completions, as this does).
        add_special = not (self._bos and text.startswith(self._bos))
        return self._tokenizer.encode(text, add_special_tokens=add_special)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str:
        turns = [{"role": m.role, "content": m.text()} for m in messages]
        return self._tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer a worker advertises in its registration: "sim", or "hf:<absolute model dir>"."""
    if spec == "sim":
        return SimTokenizer()
    if spec.startswith(HF_PREFIX):
        directory = spec[len(HF_PREFIX) :]
        try:
            return HfTokenizer(directory)
        except ImportError as exc:
            raise ValueError(f"tokenizer {spec!r} needs the transformers package: {exc}") from exc
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load tokenizer from {directory}: {exc}") from exc
    raise ValueError(f"unknown tokenizer {spec!r} (known: 'sim', 'hf:<model directory>')")
