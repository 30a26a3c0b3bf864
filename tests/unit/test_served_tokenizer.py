"""`worker.vllm.chat_template` (services/worker/served_tokenizer.py): the tokenizer directory a worker serves
with the override, rendered by the ingress's `HfTokenizer`, and the start-up errors of a bad template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from contracts.openai_api import ChatMessage, FunctionDefinition, Tool
from services.worker import main as worker_main
from services.worker.engines.base import EngineConfigError, EngineFacts
from services.worker.served_tokenizer import (
    chat_template_source,
    served_files,
    served_tokenizer,
    vllm_builtin_templates_dir,
)
from shared.config import VllmSettings, WorkerSettings
from shared.model_store import read_tokenizer_files
from shared.hf_tokenizer import HfTokenizer

OVERRIDE = (
    "{% for message in messages %}[{{ message['role'] | upper }}] {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
CHAT = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="What is the pa of chan?")]
EXPECTED = "[SYSTEM] Be brief.\n[USER] What is the pa of chan?\n[ASSISTANT]"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        from launch.tiny_model import make_tiny_model
    except ImportError as exc:  # pragma: no cover - transformers is a dev dependency
        pytest.skip(f"the tiny model needs transformers: {exc}")
    try:
        return make_tiny_model(tmp_path_factory.mktemp("served-tokenizer") / "model")
    except ImportError as exc:  # pragma: no cover
        pytest.skip(f"the tiny model needs transformers and torch: {exc}")


def snapshot(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}


def served_dir(spec: str) -> Path:
    assert spec.startswith("hf:")
    return Path(spec[3:])


def test_an_inline_override_renders_through_the_ingress_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    before = snapshot(model_dir)
    original = HfTokenizer(str(model_dir))
    spec = served_tokenizer(f"hf:{model_dir}", OVERRIDE, root=tmp_path / "served")
    directory = served_dir(spec)
    assert directory.parent == tmp_path / "served" and directory.is_absolute()
    served = HfTokenizer(str(directory))
    assert served.name == spec
    assert served.apply_chat_template(CHAT) == EXPECTED
    # The model's own template renders otherwise; the vocabulary is the model's.
    assert original.apply_chat_template(CHAT) != EXPECTED
    assert served.encode(EXPECTED) == original.encode(EXPECTED)
    assert served.vocab_size == original.vocab_size
    # The files read_tokenizer_files picks, nothing else (no weights), the override as chat_template.jinja.
    assert set(snapshot(directory)) == set(read_tokenizer_files(model_dir))
    assert (directory / "chat_template.jinja").read_text() == OVERRIDE
    # The model directory is untouched.
    assert snapshot(model_dir) == before
    assert HfTokenizer(str(model_dir)).apply_chat_template(CHAT) == original.apply_chat_template(CHAT)


def test_a_file_path_gives_the_same_directory_as_the_same_text_inline(model_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "served"
    template = tmp_path / "templates" / "mine.jinja"
    template.parent.mkdir()
    template.write_text(OVERRIDE)
    by_path = served_tokenizer(f"hf:{model_dir}", str(template), root=root)
    assert HfTokenizer(str(served_dir(by_path))).apply_chat_template(CHAT) == EXPECTED
    assert served_tokenizer(f"hf:{model_dir}", OVERRIDE, root=root) == by_path
    # A relative path is the worker's working directory's, as vLLM opens it.
    monkeypatch.chdir(tmp_path)
    assert served_tokenizer(f"hf:{model_dir}", "templates/mine.jinja", root=root) == by_path


def test_the_same_override_gives_the_same_directory_twice(model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "served"
    first = served_tokenizer(f"hf:{model_dir}", OVERRIDE, root=root)
    stamp = {path.name: path.stat().st_mtime_ns for path in served_dir(first).iterdir()}
    assert served_tokenizer(f"hf:{model_dir}", OVERRIDE, root=root) == first
    # Found as it was, not written again.
    assert {path.name: path.stat().st_mtime_ns for path in served_dir(first).iterdir()} == stamp
    assert [path.name for path in root.iterdir()] == [served_dir(first).name]
    # Another override, another directory; a damaged directory is written anew.
    other = served_tokenizer(f"hf:{model_dir}", OVERRIDE + "!", root=root)
    assert other != first
    (served_dir(first) / "chat_template.jinja").write_text("damaged")
    assert served_tokenizer(f"hf:{model_dir}", OVERRIDE, root=root) == first
    assert (served_dir(first) / "chat_template.jinja").read_text() == OVERRIDE
    assert sorted(path.name for path in root.iterdir()) == sorted([served_dir(first).name, served_dir(other).name])


@pytest.mark.parametrize("in_config", [
    "{{ 'the config template' }}",
    [{"name": "default", "template": "{{ 'default' }}"}, {"name": "tool_use", "template": "{{ 'tools' }}"}],
])
def test_a_template_in_the_tokenizer_config_gives_way(model_dir: Path, tmp_path: Path, in_config: object) -> None:
    directory = tmp_path / "model"
    shutil.copytree(model_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": in_config}))
    assert HfTokenizer(str(directory)).apply_chat_template(CHAT) != EXPECTED
    served = served_dir(served_tokenizer(f"hf:{directory}", OVERRIDE, root=tmp_path / "served"))
    assert json.loads((served / "tokenizer_config.json").read_text()) == config
    tokenizer = HfTokenizer(str(served))
    assert tokenizer.apply_chat_template(CHAT) == EXPECTED
    tools = [Tool(function=FunctionDefinition(name="f", parameters={"type": "object"}))]
    assert tokenizer.apply_chat_template(CHAT, tools=tools) == EXPECTED  # the override serves requests with tools too


def test_served_files_leave_a_config_without_a_template_as_it_is() -> None:
    files = {"tokenizer.json": b"{}", "tokenizer_config.json": b'{"b": 1,  "a": 2}', "chat_template.jinja": b"old"}
    served = served_files(files, "new")
    assert served == {**files, "chat_template.jinja": b"new"}
    assert files["chat_template.jinja"] == b"old"


@pytest.mark.parametrize(("value", "message"), [
    ("templates/missing.jinja", r"worker\.vllm\.chat_template: 'templates/missing\.jinja' looks like a file path, but it cannot be read"),
    ("{% if messages %}never closed", r"worker\.vllm\.chat_template \(inline template\) does not compile"),
    ("{{ messages[0]['content'] ", r"does not compile"),
    ("  \n ", r"is empty"),
])
def test_a_bad_template_fails_clearly(model_dir: Path, tmp_path: Path, value: str, message: str) -> None:
    with pytest.raises(EngineConfigError, match=message) as error:
        served_tokenizer(f"hf:{model_dir}", value, root=tmp_path / "served")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "served").exists()


def test_a_template_file_that_does_not_compile_is_named(model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "broken.jinja"
    template.write_text("line one\n{% for message in messages %}\n{{ message.content }}\n")
    with pytest.raises(EngineConfigError, match=rf"worker\.vllm\.chat_template file {template} does not compile") as error:
        served_tokenizer(f"hf:{model_dir}", str(template), root=tmp_path / "served")
    assert "\n" not in str(error.value)


def test_without_an_override_nothing_changes(tmp_path: Path) -> None:
    assert served_tokenizer("hf:/models/m", "", root=tmp_path / "served") == "hf:/models/m"
    assert served_tokenizer("sim", "", root=tmp_path / "served") == "sim"
    assert not (tmp_path / "served").exists()


def test_a_builtin_vllm_template_is_found_by_name(tmp_path: Path) -> None:
    builtin = tmp_path / "builtin"
    builtin.mkdir()
    (builtin / "template_x.jinja").write_text("{{ 'x' }}")
    assert chat_template_source("template_x.jinja", builtin)[0] == "{{ 'x' }}"
    installed = vllm_builtin_templates_dir()
    if installed is None or not (installed / "template_chatml.jinja").is_file():
        pytest.skip("vLLM's built-in templates are not installed")
    assert chat_template_source("template_chatml.jinja")[0] == (installed / "template_chatml.jinja").read_text()


def test_path_or_text_is_decided_as_vllm_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chat_utils = pytest.importorskip("vllm.renderers.chat_utils", reason="needs vllm")
    template = tmp_path / "t.jinja"
    template.write_text("{{ 'from the file' }}")
    monkeypatch.chdir(tmp_path)
    for value in (str(template), "t.jinja", "{{ 'inline' }}", "plain words\n", "{{ 'a' }}\n{{ 'b' }}"):
        assert chat_template_source(value)[0] == chat_utils._load_chat_template(value)
    for value in ("missing.jinja", "no/such/dir/x.jinja"):
        with pytest.raises(Exception):
            chat_utils._load_chat_template(value)
        with pytest.raises(EngineConfigError):
            chat_template_source(value)


def test_the_worker_advertises_the_served_tokenizer(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`build_engine` of a vLLM worker with the setting (the engine itself stubbed: nothing of vLLM is imported)."""
    from services.worker.engines import vllm_setup

    engine = object()
    monkeypatch.setattr(vllm_setup, "build_vllm_engine",
                        lambda settings: (engine, EngineFacts("m", 32, 4096, f"hf:{model_dir}")))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def settings(chat_template: str) -> WorkerSettings:
        return msgspec.structs.replace(WorkerSettings(engine="vllm"), vllm=VllmSettings(chat_template=chat_template))

    built, facts = worker_main.build_engine(settings(""))
    assert built is engine and facts.tokenizer == f"hf:{model_dir}"
    _, facts = worker_main.build_engine(settings(OVERRIDE))
    directory = served_dir(facts.tokenizer)
    assert directory.parent == tmp_path / "cache" / "kvlane" / "served-tokenizers"
    assert HfTokenizer(str(directory)).apply_chat_template(CHAT) == EXPECTED
    with pytest.raises(EngineConfigError, match="looks like a file path"):
        worker_main.build_engine(settings("/no/such/template.jinja"))


def test_a_template_file_that_is_not_text_fails_clearly(tmp_path: Path) -> None:
    template = tmp_path / "latin1.jinja"
    template.write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    with pytest.raises(EngineConfigError, match=rf"{template} is not UTF-8 text"):
        chat_template_source(str(template))
