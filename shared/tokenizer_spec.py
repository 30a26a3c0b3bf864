"""A worker's tokenizer from the spec its registration advertises.

Apart from `shared.tokenizer` because the Hugging Face tokenizer builds on that module's message helpers.
"""

from __future__ import annotations

from shared.tokenizer import HF_PREFIX, SimTokenizer, Tokenizer


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer a worker advertises in its registration: "sim", or "hf:<absolute model dir>"."""
    if spec == "sim":
        return SimTokenizer()
    if spec.startswith(HF_PREFIX):
        directory = spec[len(HF_PREFIX) :]
        try:
            from shared.hf_tokenizer import HfTokenizer  # the sim path needs neither tokenizers nor jinja2

            return HfTokenizer(directory)
        except ImportError as exc:
            raise ValueError(f"tokenizer {spec!r} needs the tokenizers and jinja2 packages: {exc}") from exc
        except Exception as exc:  # a missing or malformed file, a template that does not compile
            raise ValueError(f"cannot load tokenizer from {directory}: {exc}") from exc
    raise ValueError(f"unknown tokenizer {spec!r} (known: 'sim', 'hf:<model directory>')")
