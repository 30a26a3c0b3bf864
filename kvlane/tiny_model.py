"""A tiny random-weight Llama with its own tokenizer, made locally in seconds.

Nothing may be downloaded at run time, yet tests and `kvlane up --engine
vllm` need a real model directory that vLLM loads like any other. This
builds one: a byte-level BPE tokenizer (vocab ~1k) trained on a generated
corpus, wrapped as `PreTrainedTokenizerFast` with a chat template, and a
`LlamaForCausalLM` (hidden 128, 2 layers, 2 heads, 1 KV head, head_dim 64)
with seeded random weights saved as safetensors. The same seed writes the
same files, byte for byte.

The weights are float32 on purpose: a random model's logits are close
together, and bf16 rounding would turn near-ties into run-to-run
differences that make greedy outputs incomparable.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import tempfile
from pathlib import Path

VOCAB_SIZE = 1024
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# The template starts with the BOS token, as Llama-style templates do, so a
# chat prompt must be encoded without adding special tokens a second time.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ 'system' if message['role'] == 'developer' else message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
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
    """A `PreTrainedTokenizerFast` trained here; the BOS is added by its post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, *CHAT_MARKERS]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus(seed), trainer=trainer)
    bos_id = core.token_to_id(BOS)
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(CHAT_MARKERS),
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
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
    target = Path(directory).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = build_tokenizer(seed)
        model = build_model(tokenizer, seed)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def ensure_tiny_model(directory: str | Path, seed: int = 0) -> Path:
    """The tiny model in `directory`, built only if it is not there yet."""
    target = Path(directory).expanduser().resolve()
    if not (target / "config.json").exists():
        make_tiny_model(target, seed)
    return target


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "kvlane" / "tiny-llama"


def fingerprint(directory: str | Path) -> str:
    """sha256 over every file's name and bytes: equal for equal model directories."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
