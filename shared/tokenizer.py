"""Tokenizers that ingress and workers share, so both count the same tokens.

`HfTokenizer` ("hf:<model dir>") is a vLLM worker's: the model directory's own
tokenizer and chat template, loaded without transformers (no torch import).

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

import datetime
import functools
import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from pathlib import Path
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
    """A Hugging Face fast tokenizer from a local model directory (a vLLM worker's).

    Ingress encodes with it exactly as the engine would, so prompt token
    counts, the context check and block hashes match what the engine sees.
    `tokenizer.json` is read by the `tokenizers` library and the chat
    template rendered with jinja2 the way transformers renders it, without
    transformers itself: importing it (and torch with it) would cost ingress
    seconds of CPU and hundreds of MB for good.
    """

    def __init__(self, directory: str) -> None:
        # Imported here: the sim path needs neither package.
        from tokenizers import Tokenizer as FastTokenizer

        path = Path(directory)
        self.directory = directory
        self.name = HF_PREFIX + directory
        self._tokenizer = FastTokenizer.from_file(str(path / "tokenizer.json"))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self._special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self._bos = self._special["bos_token"]
        self._template = _chat_template(path, config)

    def encode(self, text: str) -> list[int]:
        # A rendered chat template already starts with the BOS token; adding
        # special tokens again would double it (vLLM's server skips them for
        # chat and adds them for plain completions, as this does).
        add_special = not (self._bos and text.startswith(self._bos))
        return self._tokenizer.encode(text, add_special_tokens=add_special).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str:
        if self._template is None:
            raise ValueError(f"the tokenizer in {self.directory} has no chat template")
        from jinja2 import TemplateError

        turns = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return self._template.render(messages=turns, add_generation_prompt=True, **self._special)
        except TemplateError as exc:  # raise_exception() in the template, or a template bug
            raise ValueError(str(exc)) from exc


def _token_text(token: object) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(path: Path, config: dict):
    """The model's chat template, compiled as transformers compiles it (sandboxed, trim and lstrip blocks)."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one serves chat
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    standalone = path / "chat_template.jinja"
    if template is None and standalone.exists():
        template = standalone.read_text()
    if not template:
        return None
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return environment.from_string(template)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer a worker advertises in its registration: "sim", or "hf:<absolute model dir>"."""
    if spec == "sim":
        return SimTokenizer()
    if spec.startswith(HF_PREFIX):
        directory = spec[len(HF_PREFIX) :]
        try:
            return HfTokenizer(directory)
        except ImportError as exc:
            raise ValueError(f"tokenizer {spec!r} needs the tokenizers and jinja2 packages: {exc}") from exc
        except Exception as exc:  # a missing or malformed file, a template that does not compile
            raise ValueError(f"cannot load tokenizer from {directory}: {exc}") from exc
    raise ValueError(f"unknown tokenizer {spec!r} (known: 'sim', 'hf:<model directory>')")
