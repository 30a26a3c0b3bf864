"""The tokenizer of a Hugging Face model directory (a vLLM worker's), and its chat template rendered as vLLM renders it.

`HfTokenizer` ("hf:<model dir>") loads the model directory's own tokenizer
and chat template without transformers (no torch import). Its
`apply_chat_template` renders a chat request into the very text `vllm serve`
renders for it: the same messages, tools and template arguments reach the
template as vLLM's renderer (vllm/renderers) and transformers pass them.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from contracts.openai_api import ChatMessage, Tool, ToolCallParam
from shared.tokenizer import CONTINUE_AND_GENERATE, HF_PREFIX, message_texts, tool_call_arguments, tool_dict



# transformers' `apply_chat_template` parameters: vLLM lets them through whether
# or not the template reads them (`_get_hf_base_chat_template_params`), and
# transformers consumes them itself; the other kwargs reach the template.
_APPLY_CHAT_TEMPLATE_PARAMS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers marks the final message with this to find where to cut the render.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_BILLING_HEADER = "x-anthropic-billing-header"


def _drop_billing_header(texts: list[str]) -> list[str]:
    """vLLM's `_strip_claude_code_billing_header`: a system text's per-request header line would defeat the prefix cache."""
    kept = []
    for text in texts:
        if not text.startswith(_BILLING_HEADER):
            kept.append(text)
        elif rest := text.partition("\n")[2]:
            kept.append(rest)
    return kept


def conversation(messages: Sequence[ChatMessage], content_format: str) -> list[dict[str, Any]]:
    """The messages as vLLM's `parse_chat_messages` (then `_postprocess_messages`) passes them to the template.

    `content_format` "string": content is the text parts joined by newlines;
    "openai": a list of `{"type": "text", "text": ...}` parts.
    """
    turns = []
    for index, message in enumerate(messages):
        role = message.role
        texts = message_texts(message, index)
        if role == "system":
            texts = _drop_billing_header(texts)
        turn: dict[str, Any] = {"role": role}
        if content_format == "openai":
            turn["content"] = [{"type": "text", "text": text} for text in texts]
        else:  # empty texts are dropped before the join
            turn["content"] = "\n".join(text for text in texts if text)
        if role == "assistant":
            # An empty list is dropped so that templates take the plain assistant path.
            if message.tool_calls:
                turn["tool_calls"] = [_tool_call(call) for call in message.tool_calls]
            if message.reasoning is not None:
                turn["reasoning"] = turn["reasoning_content"] = message.reasoning
        elif role == "tool":
            if message.tool_call_id is not None:
                turn["tool_call_id"] = message.tool_call_id
            # Most templates read a tool result as a string, whatever the content format.
            if isinstance(turn["content"], list):
                turn["content"] = "\n".join(texts)
        if message.name is not None:
            turn["name"] = message.name
        if role == "developer":
            turn["tools"] = None
        turns.append(turn)
    return turns


def _tool_call(call: ToolCallParam) -> dict[str, Any]:
    # The key order of the OpenAI types vLLM validates the message with, for templates that dump a call whole.
    rendered: dict[str, Any] = {} if call.id is None else {"id": call.id}
    rendered["function"] = {"arguments": tool_call_arguments(call.function.arguments), "name": call.function.name}
    rendered["type"] = call.type
    return rendered


def _developer_as_system(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's `_convert_developer_to_system` then `_consolidate_system_messages`, for templates that never name "developer"."""
    converted = []
    for turn in turns:
        if turn["role"] == "developer":
            turn = {key: value for key, value in turn.items() if key != "tools"} | {"role": "system"}
        converted.append(turn)
    system_texts = []
    others = []
    merge = False
    for position, turn in enumerate(converted):
        if turn["role"] != "system":
            others.append(turn)
            continue
        merge = merge or position > 0 or bool(system_texts)
        content = turn.get("content", "")
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content if isinstance(part, dict) and "text" in part)
        if content:
            system_texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


def _unset(value: object) -> bool:
    # vLLM's `merge_kwargs` drops these from a request's values.
    return value is None or (isinstance(value, str) and value == "auto")


class HfTokenizer:
    """A Hugging Face fast tokenizer from a local model directory (a vLLM worker's).

    Ingress encodes with it exactly as the engine would, so prompt token
    counts, the context check and block hashes match what the engine sees.
    `tokenizer.json` is read by the `tokenizers` library and the chat
    template rendered with jinja2 the way vLLM's server renders it (through
    transformers), without transformers itself: importing it (and torch with
    it) would cost ingress seconds of CPU and hundreds of MB for good.
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
        self._special = _special_tokens(config)
        self._bos = self._special.get("bos_token")
        self._templates = _chat_templates(path, config)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        # Unsaid, a rendered chat template that starts with the BOS token must
        # not get a second one, and a plain prompt gets it (vLLM's server
        # encodes chat prompts without special tokens, completions with them).
        if add_special_tokens is None:
            add_special_tokens = not (self._bos and text.startswith(self._bos))
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [self._tokenizer.id_to_token(t) or "" for t in token_ids]

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
        """The prompt text `vllm serve` renders for these messages (vLLM 0.32, "auto" content format).

        `chat_template_kwargs` are the request's, plus what vLLM's
        `build_chat_params` derives from `reasoning_effort` (`enable_thinking`,
        `reasoning_effort` itself). A template's refusal is a ValueError, a
        non-text content part an `UnsupportedContent`.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError(CONTINUE_AND_GENERATE)
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        user_kwargs = dict(chat_template_kwargs or {})
        if user_kwargs.get("chat_template") is not None:
            raise ValueError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                             "Refused request with untrusted chat template.")
        # vLLM's OnlineRenderer.preprocess_chat and ChatParams: the request's
        # tools are a default the request's kwargs may override, its top-level
        # fields override the kwargs, and None or "auto" values are unset.
        derived = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "documents": documents}
        user_kwargs |= {key: value for key, value in derived.items() if not _unset(value)}
        kwargs: dict[str, Any] = {} if tools is None else {"tools": [tool_dict(tool) for tool in tools]}
        kwargs |= {key: value for key, value in user_kwargs.items() if not _unset(value)}
        tool_schemas = kwargs.pop("tools", None)
        template = self._template_for(tool_schemas)
        turns = conversation(messages, template.content_format)
        if any(turn["role"] == "developer" for turn in turns) and not template.names_developer:
            turns = _developer_as_system(turns)
        # Only the kwargs the template reads reach it (vLLM's `resolve_chat_template_kwargs`).
        accepted = template.variables | _APPLY_CHAT_TEMPLATE_PARAMS
        kwargs = {key: value for key, value in kwargs.items() if key in accepted}
        return _render(template, turns, tool_schemas, kwargs, self._special)

    def _template_for(self, tools: object) -> _ChatTemplate:
        """transformers' `get_chat_template`: of named templates, "tool_use" serves requests with tools."""
        if not self._templates:
            raise ValueError(f"the tokenizer in {self.directory} has no chat template")
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise ValueError(f"the tokenizer in {self.directory} has several chat templates and none named 'default'")


def _render(template: _ChatTemplate, turns: list[dict[str, Any]], tools: object, kwargs: dict[str, Any],
            special: dict[str, str]) -> str:
    """transformers' `apply_chat_template` and `render_jinja_template`, for one conversation and tokenize=False."""
    documents = kwargs.pop("documents", None)
    add_generation_prompt = kwargs.pop("add_generation_prompt", False)
    continue_final_message = kwargs.pop("continue_final_message", False)
    for name in _APPLY_CHAT_TEMPLATE_PARAMS:
        kwargs.pop(name, None)
    if continue_final_message and add_generation_prompt:
        raise ValueError(CONTINUE_AND_GENERATE)
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):  # type: ignore[attr-defined]
        raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                         "and a docstring suitable for auto-conversion to a schema.")
    if documents is not None and not all(isinstance(document, dict) for document in documents):
        raise ValueError("Documents should be a list of dicts with 'title' and 'text' keys!")
    final_text = None
    if continue_final_message:
        final_text = _mark_final_message(turns, template.source)
    try:
        rendered = template.compiled.render(messages=turns, tools=tools, documents=documents,
                                            add_generation_prompt=add_generation_prompt, **(special | kwargs))
    except Exception as exc:  # raise_exception() in the template, or a template bug: vLLM answers 400 either way
        raise ValueError(str(exc)) from exc
    if final_text is None:
        return rendered
    if final_text.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template!")
    tag_at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[tag_at : tag_at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:tag_at]
    # The template trimmed the message's trailing space, and the tag's with it.
    return rendered[:tag_at].rstrip()


def _mark_final_message(turns: list[dict[str, Any]], source: str) -> str:
    """Tags the final message's text (in place) as transformers does; returns the text to continue."""
    final = turns[-1] = dict(turns[-1])
    content = final.get("content")
    if content is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
    if "content" not in source:
        raise ValueError('continue_final_message is set to "content" but this is not an accepted field in the chat_template')
    if isinstance(content, list):
        parts = final["content"] = [dict(part) for part in content]
        for part in reversed(parts):
            if "text" in part:
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but we could not find any text to continue in the final message!")
    final["content"] = content + _CONTINUE_TAG
    return content


def _token_text(token: object) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _special_tokens(config: dict) -> dict[str, str]:
    """transformers' `special_tokens_map` (v5): the named special tokens that are set, which templates may read."""
    names = list(_NAMED_SPECIAL_TOKENS)
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):  # model-specific named tokens (image_token...)
        names += [name for name in extra if name not in names]
    special = {}
    for name in names:
        text = _token_text(config.get(name, extra.get(name) if isinstance(extra, dict) else None))
        if text is not None:
            special[name] = text
    return special


class _ChatTemplate:
    """A chat template compiled as transformers compiles it, with what vLLM reads off its source."""

    def __init__(self, source: str) -> None:
        self.source = source
        environment = _environment()
        self.compiled = environment.from_string(source)
        parsed = environment.parse(source)
        import jinja2.meta

        # vLLM's `_resolve_chat_template_kwargs`.
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(parsed))
        # vLLM's `_detect_developer_role_support`.
        self.names_developer = '"developer"' in source or "'developer'" in source
        # vLLM's `_detect_content_format`: a template that loops over a message's content takes OpenAI parts.
        self.content_format = "openai" if _loops_over_content(parsed) else "string"


def _chat_templates(path: Path, config: dict) -> dict[str, _ChatTemplate]:
    """The model's chat templates by name ("default" for a single one)."""
    template = config.get("chat_template")
    sources: dict[str, str] = {}
    if isinstance(template, list):
        sources = {t["name"]: t["template"] for t in template if isinstance(t, dict) and t.get("template")}
    elif isinstance(template, dict):
        sources = {name: text for name, text in template.items() if text}
    elif template:
        sources = {"default": template}
    standalone = path / "chat_template.jinja"
    if not sources and standalone.exists():
        sources = {"default": standalone.read_text()}
    return {name: _ChatTemplate(source) for name, source in sources.items()}


def _environment():
    """jinja2 set up as transformers' `_compile_jinja_template` sets it up."""
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # `{% generation %}` marks assistant text for transformers' masks; rendering keeps the body as is.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return environment


# vLLM's `_detect_content_format` (vllm/renderers/hf.py), ported: does the
# template iterate over `message['content']` (or a variable bound to it)?


def _is_var(node, name: str) -> bool:
    import jinja2.nodes

    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node, name: str, key: str) -> bool:
    import jinja2.nodes

    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node, name: str, key: str | None = None) -> bool:
    import jinja2.nodes

    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _names_bound_to(root, name: str) -> list[str]:
    import jinja2.nodes

    names = [name]
    pending = [name]
    while pending:
        current = pending.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current) and isinstance(assign.target, jinja2.nodes.Name):
                names.append(assign.target.name)
                if assign.target.name != current:
                    pending.append(assign.target.name)
    return names


def _message_loop_names(root) -> list[str]:
    import jinja2.nodes

    message_lists = _names_bound_to(root, "messages")
    found = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, name) for name in message_lists) and isinstance(loop.target, jinja2.nodes.Name):
            found.append(loop.target.name)
    return found


def _loops_over_content(root) -> bool:
    import jinja2.nodes

    try:
        message_names = _message_loop_names(root)
        content_params_by_loop: dict[int, set[str]] = {}
        loops_in_macros: set[int] = set()
        for macro in root.find_all(jinja2.nodes.Macro):
            param_names = {arg.name for arg in macro.args}
            content_params: set[str] = set()
            for call in root.find_all(jinja2.nodes.Call):
                if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                    continue
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(_is_var_or_elems(arg, m, "content") for m in message_names):
                        content_params.add(macro.args[i].name)
                for keyword in call.kwargs:
                    if (isinstance(keyword, jinja2.nodes.Keyword) and keyword.key in param_names
                            and any(_is_var_or_elems(keyword.value, m, "content") for m in message_names)):
                        content_params.add(keyword.key)
            for loop in macro.find_all(jinja2.nodes.For):
                loops_in_macros.add(id(loop))
                if content_params:
                    content_params_by_loop[id(loop)] = content_params
        for loop in root.find_all(jinja2.nodes.For):
            if any(_is_var_or_elems(loop.iter, m, "content") for m in message_names):
                return True
            params = content_params_by_loop.get(id(loop))
            if isinstance(loop.iter, jinja2.nodes.Name) and params is not None and loop.iter.name in params:
                return True
            if id(loop) not in loops_in_macros and isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content":
                return True
    except Exception:  # vLLM falls back to "string" when it cannot read the template
        return False
    return False


