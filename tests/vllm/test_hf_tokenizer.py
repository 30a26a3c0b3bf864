"""Ingress's tokenizer for a vLLM worker's model directory agrees with transformers, without importing it.

`shared.hf_tokenizer.HfTokenizer` reads tokenizer.json with the `tokenizers`
library and renders the chat template with jinja2; transformers (and torch)
stay out of the ingress process. The tiny model's files are made by
transformers, which is the reference here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.openai_api import ChatMessage
from shared.hf_tokenizer import HfTokenizer
from shared.tokenizer_spec import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> HfTokenizer:
    return HfTokenizer(str(tiny_model))


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80) | st.sampled_from(["<|im_start|>user\nHi<|im_end|>", "<tool_call>\n{}</tool_call>",
                                                    "<think>\nhm\n</think>\n\nok", "  a\n\n\tb ", "日本 ✓ é"]))
def test_encode_and_decode_agree_with_transformers(tokenizer: HfTokenizer, reference, text: str) -> None:
    expected = reference.encode(text, add_special_tokens=False)
    # The tiny model, like Qwen, has no BOS: chat and plain prompts encode alike.
    assert tokenizer.encode(text) == tokenizer.encode(text, add_special_tokens=True) == expected
    assert tokenizer.encode(text, add_special_tokens=False) == expected
    assert tokenizer.decode(expected) == reference.decode(expected, skip_special_tokens=True)


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), st.text(max_size=30)),
                      min_size=1, max_size=5))
def test_chat_template_renders_as_transformers_does(tokenizer: HfTokenizer, reference, turns) -> None:
    # "developer" is left out: vLLM turns it into "system" before the template
    # sees it (tests/vllm/test_chat_rendering.py compares with vLLM itself).
    messages = [ChatMessage(role=role, content=content) for role, content in turns]
    expected = reference.apply_chat_template([{"role": r, "content": c} for r, c in turns], tokenize=False,
                                             add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages) == expected


def test_vocab_size_counts_added_tokens(tokenizer: HfTokenizer, reference) -> None:
    assert tokenizer.vocab_size == len(reference)


def test_tool_and_think_markers_survive_decoding_and_im_end_does_not(tokenizer: HfTokenizer) -> None:
    text = '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert tokenizer.decode(tokenizer.encode(text + "<|im_end|>")) == text


def test_loading_and_encoding_import_neither_transformers_nor_torch(tiny_model: Path) -> None:
    probe = (
        "import sys\n"
        "from contracts.openai_api import ChatMessage\n"
        "from shared.tokenizer_spec import load_tokenizer\n"
        f"t = load_tokenizer('hf:{tiny_model}')\n"
        "t.encode(t.apply_chat_template([ChatMessage(role='user', content='hi')]))\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_template_that_refuses_the_messages_is_a_value_error(tmp_path: Path, tiny_model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HfTokenizer(str(tmp_path))
    assert tokenizer.apply_chat_template([ChatMessage(role="user", content="hi")]) == "x"
    with pytest.raises(ValueError, match="user first"):
        tokenizer.apply_chat_template([ChatMessage(role="assistant", content="hi")])


@pytest.mark.parametrize("missing", ["tokenizer.json", "everything"])
def test_a_directory_without_a_tokenizer_is_a_clear_error(tmp_path: Path, tiny_model: Path, missing: str) -> None:
    if missing != "everything":
        (tmp_path / "tokenizer_config.json").write_bytes((tiny_model / "tokenizer_config.json").read_bytes())
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(f"hf:{tmp_path}")


def test_the_load_benchmark_runs_and_writes_its_figures(tiny_model: Path, tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("tokenizer_load_bench", REPO / "benchmarks" / "tokenizer_load_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "tokenizer_load.json"
    assert bench.main(["--model-dir", str(tiny_model), "--rounds", "1", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["kvlane"]["torch_imported"] is False and figures["transformers"]["torch_imported"] is True
    assert figures["cpu_ratio"] > 0 and figures["rss_ratio"] > 0
