"""The tokenizer a vLLM worker serves when `worker.vllm.chat_template` overrides the model's chat template.

kvlane's ingress renders chat requests itself, with the chat template of the
tokenizer the worker advertises (`hf:<directory>`, shared/tokenizer.py). To
serve a model with another template, as `vllm serve --chat-template` does,
the worker advertises a "served tokenizer directory" instead of the model's:
a copy of the model directory's tokenizer files (those
`shared.model_store.read_tokenizer_files` picks) with the override written as
`chat_template.jinja` and the `chat_template` key dropped from
`tokenizer_config.json`, so the override is the only template there. That
directory is what the worker publishes on the bus too, so an ingress on
another host renders with the override as well.

The directory is named by a hash of its content, under
$XDG_CACHE_HOME/kvlane/served-tokenizers (~/.cache/...): the same model and
override give the same directory (and the same object on the bus) on every
start, and the model directory is never written to.

`chat_template_source`, `served_files` and `served_directory_name` are pure
(but for reading the template's file); `served_tokenizer` writes the
directory. All raise `EngineConfigError` with a one-line message, which
stops the worker at start.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from services.worker.engines.base import EngineConfigError
from shared.model_store import REQUIRED_FILE, ModelFilesError, content_revision, read_tokenizer_files
from shared.tokenizer import HF_PREFIX

SETTING = "worker.vllm.chat_template"
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# vLLM's test for "this is a template, not a file name" (vllm/renderers/chat_utils.py `_load_chat_template`).
JINJA_CHARS = "{}\n"


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def vllm_builtin_templates_dir() -> Path | None:
    """vLLM's own templates (`template_chatml.jinja`...), found without importing vLLM; None without vLLM."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "transformers_utils" / "chat_templates"


def chat_template_source(value: str, builtin_dir: Path | None = None) -> tuple[str, str]:
    """The template `value` stands for, and where it came from (for messages), decided as vLLM decides.

    As `vllm serve --chat-template`: the file `value` names if it can be
    read; else, if `value` has none of "{", "}" or a newline, it is a file
    name that must be found (beside the worker, or among vLLM's built-in
    templates); else it is the template itself.
    """
    try:
        with open(value, "rb") as f:
            data = f.read()
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte, which no path has
        error = exc
    else:
        return _decoded(data, value), f"{SETTING} file {value}"
    if isinstance(error, OSError) and not any(c in value for c in JINJA_CHARS):
        expanded = Path(value).expanduser()  # a config file's "~/..." has no shell to expand it
        builtin = builtin_dir if builtin_dir is not None else vllm_builtin_templates_dir()
        tried = [Path(value).absolute()] + ([expanded] if expanded != Path(value) else [])
        tried += [builtin / value] if builtin is not None else []
        tried = list(dict.fromkeys(tried))
        for candidate in tried[1:]:
            try:
                return _decoded(candidate.read_bytes(), str(candidate)), f"{SETTING} file {candidate}"
            except OSError:
                continue
        reason = error.strerror or _one_line(error)
        raise EngineConfigError(f"{SETTING}: {value!r} looks like a file path, but it cannot be read ({reason}); "
                                f"tried {', '.join(str(path) for path in tried)}")
    return value, f"{SETTING} (inline template)"


def _decoded(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EngineConfigError(f"{SETTING}: {path} is not UTF-8 text: {exc}") from None


def check_compiles(source: str, origin: str) -> None:
    """`EngineConfigError` unless `source` compiles as the ingress compiles a chat template."""
    if not source.strip():
        raise EngineConfigError(f"{origin} is empty")
    from shared.hf_tokenizer import _ChatTemplate  # how HfTokenizer compiles (jinja2, as transformers sets it up)

    try:
        _ChatTemplate(source)
    except ImportError as exc:
        raise EngineConfigError(f"{origin}: checking a chat template needs jinja2: {exc}") from None
    except Exception as exc:  # jinja2.TemplateSyntaxError above all
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line else ""
        raise EngineConfigError(f"{origin} does not compile{where}: {_one_line(exc)}") from None


def served_files(model_files: Mapping[str, bytes], template: str) -> dict[str, bytes]:
    """The model's tokenizer files with `template` as their only chat template."""
    files = dict(model_files)
    files[TEMPLATE_FILE] = template.encode("utf-8")
    if CONFIG_FILE in files:
        try:
            config = json.loads(files[CONFIG_FILE])
        except (ValueError, UnicodeDecodeError) as exc:
            raise EngineConfigError(f"{SETTING}: the model's {CONFIG_FILE} is not JSON: {_one_line(exc)}") from None
        # The key wins over chat_template.jinja in HfTokenizer (and transformers): it must go.
        if isinstance(config, dict) and "chat_template" in config:
            del config["chat_template"]
            files[CONFIG_FILE] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return files


def served_directory_name(files: Mapping[str, bytes]) -> str:
    """The served directory's name: the files' revision, as they are published on the bus."""
    return content_revision(files)


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvlane" / "served-tokenizers"


def write_served_directory(files: Mapping[str, bytes], root: str | Path) -> Path:
    """`files` as the directory `<root>/<their revision>`, written unless it holds them already.

    Written beside and renamed, as `launch.tiny_model` writes models: a
    reader (an ingress on this host, another worker starting with the same
    override) sees the whole set or nothing.
    """
    target = Path(root).expanduser().absolute() / served_directory_name(files)
    if _holds(target, files):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for name, content in files.items():
            (staging / name).write_bytes(content)
        if target.exists():  # not what it should hold (a partial copy by hand?): replaced
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
            target.rename(stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            if not _holds(target, files):  # another worker wrote the same files meanwhile
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _holds(directory: Path, files: Mapping[str, bytes]) -> bool:
    try:
        return (directory / REQUIRED_FILE).is_file() and read_tokenizer_files(directory) == dict(files)
    except (OSError, ModelFilesError):
        return False


def served_tokenizer(tokenizer: str, chat_template: str, root: str | Path | None = None) -> str:
    """The tokenizer spec a worker advertises: `tokenizer` ("hf:<model dir>") itself without an override,
    else "hf:<served directory>" for the model's tokenizer files rendering with `chat_template`."""
    if not chat_template:
        return tokenizer
    if not tokenizer.startswith(HF_PREFIX):
        raise EngineConfigError(f"{SETTING} needs a tokenizer from a model directory, not {tokenizer!r}")
    source, origin = chat_template_source(chat_template)
    check_compiles(source, origin)
    model_dir = tokenizer[len(HF_PREFIX):]
    try:
        model_files = read_tokenizer_files(model_dir)
    except (OSError, ModelFilesError) as exc:
        raise EngineConfigError(f"{SETTING}: cannot read the model's tokenizer files: {_one_line(exc)}") from None
    target_root = Path(root) if root is not None else default_root()
    try:
        directory = write_served_directory(served_files(model_files, source), target_root)
    except OSError as exc:
        raise EngineConfigError(f"{SETTING}: cannot write the served tokenizer under {target_root}: {_one_line(exc)}") from None
    return HF_PREFIX + str(directory)
