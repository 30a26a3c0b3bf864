"""A tiny random-weight Llama with its own tokenizer, made locally in seconds.

Nothing may be downloaded at run time, yet tests and `kvlane up --engine
vllm` need a real model directory that vLLM loads like any other. This
builds one: a byte-level BPE tokenizer (vocab ~1k) trained on a generated
corpus, wrapped as `PreTrainedTokenizerFast` with Qwen's chat tokens and a
Qwen3-style chat template (tools, tool calls, tool results, reasoning), and a
`LlamaForCausalLM` (hidden 128, 2 layers, 2 heads, 1 KV head, head_dim 64)
with seeded random weights saved as safetensors. The same seed writes the
same files, byte for byte.

The weights are float32 on purpose: a random model's logits are close
together, and bf16 rounding would turn near-ties into run-to-run
differences that make greedy outputs incomparable.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 1024
# Qwen2.5/Qwen3's special tokens: no BOS at all (chat and plain prompts are
# encoded as they are), `<|im_end|>` ends an assistant turn and so is the EOS.
PAD = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
EOS = IM_END
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
# Added but not special, as in Qwen's tokenizer: they survive decoding with
# skip_special_tokens, which vLLM's `hermes` tool parser and `qwen3`
# reasoning parser rely on (they look these up in the vocabulary).
TOOL_AND_THINK_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
CHAT_MARKERS = (IM_START, IM_END, *TOOL_AND_THINK_TOKENS)
# A compact Qwen3 template: tools as a system block of JSON lines inside
# <tools></tools>, assistant tool calls as <tool_call> JSON, tool results as
# <tool_response> blocks in a user turn, reasoning as <think> blocks kept for
# the turns after the last user query, and `enable_thinking=false` closing an
# empty <think> block in the generation prompt.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n\
</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == 'user' and message.content is string \
and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning_content = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if not loop.first or content %}{{- '\\n' }}{%- endif %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic English-ish text with digits and punctuation, for BPE training."""
    rng = random.Random(seed)
    onsets = "b c d f g h j k l m n p r s t v w z br ch dr st tr th sh".split()
    vowels = "a e i o u ai ea oo".split()
    codas = ["", "", "n", "r", "s", "t", "ng", "ck"]
    words = sorted({rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(900)})
    common = "the a of and to in is it that you for on with as was are this be at or".split()
    text = []
    for _ in range(lines):
        sentence = [rng.choice(common if rng.random() < 0.35 else words) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.2:
            sentence.append(str(rng.randint(0, 9999)))
        text.append(" ".join(sentence).capitalize() + rng.choice([".", "!", "?", ",", ":"]))
    return text


def build_tokenizer(seed: int = 0):
    """A `PreTrainedTokenizerFast` trained here, with Qwen's chat tokens and no BOS."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus(seed), trainer=trainer)
    core.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_AND_THINK_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        # As Qwen's config has it: the BOS id is <|endoftext|>, never added to a prompt.
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        # Wider than the default 0.02 so that logits spread and greedy
        # decoding does not sit on near-ties.
        initializer_range=0.2,
        torch_dtype="float32",
        **MODEL_SHAPE,
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        model = LlamaForCausalLM(config).to(torch.float32)
    return model


def make_tiny_model(directory: str | Path, seed: int = 0) -> Path:
    """Write the tiny model into `directory` (replacing what is there) and return its absolute path.

    Written to a sibling temporary directory first and renamed, so a reader
    (another worker starting at the same moment) never sees half a model.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with staged_directory(directory) as (staging, target):
        tokenizer = build_tokenizer(seed)
        model = build_model(tokenizer, seed)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
    return target


@contextlib.contextmanager
def staged_directory(directory: str | Path) -> Iterator[tuple[Path, Path]]:
    """(a sibling temporary directory to write into, `directory` as an absolute path); on a clean exit the
    temporary directory replaces `directory`, on an error it is removed. A reader never sees half the files."""
    target = Path(directory).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging, target
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def ensure_tiny_model(directory: str | Path, seed: int = 0) -> Path:
    """The tiny model in `directory`, built only if it is not there yet."""
    target = Path(directory).expanduser().resolve()
    if not (target / "config.json").exists():
        make_tiny_model(target, seed)
    return target


# Raised when what `make_tiny_model` writes changes (its template, its tokens), so a cached older model is not reused.
TINY_MODEL_FORMAT = 2


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "kvlane" / f"tiny-llama-v{TINY_MODEL_FORMAT}"


def fingerprint(directory: str | Path) -> str:
    """sha256 over every file's name and bytes: equal for equal model directories."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
