"""The request shapes of the differential suite (tests/vllm/test_api_differential.py).

Each shape is one HTTP request that is sent unchanged to `vllm serve` and to
kvlane; the answers must be identical. Greedy or seeded, with few tokens, so
that both are deterministic and the whole list runs in a minute or two on
2 cores. Token ids (whitespace, `</think>`) come from the model's own
tokenizer at run time, so a change of the tiny model's vocabulary does not
silently turn a shape into a different one.

The tiny model is random: it emits the hermes tool-call format or `</think>`
only when made to. Tool calls under tool_choice auto are forced with a
`structured_outputs` regex (the request still has `tools`, so the hermes
parser turns the text into `tool_calls`); tool_choice required/named use
vLLM's own structural tags, with `strict` tools and whitespace tokens banned
by logit_bias so that the arguments finish within max_tokens. Structured
outputs only start after the reasoning ends, so those shapes turn thinking
off (chat_template_kwargs enable_thinking=false).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOKENIZE, DETOKENIZE, MODELS = "/tokenize", "/detokenize", "/v1/models"
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
MAX_TOKENS = 16
TOOL_MAX_TOKENS = 100


@dataclass
class Shape:
    name: str
    path: str
    # A dict is sent as JSON; a str is sent as the raw body (invalid JSON shapes).
    body: dict[str, Any] | str | None
    method: str = "POST"
    # What is compared beyond the status code: "chat", "completion", "json" (whole body), "models", "status".
    compare: str = "chat"
    notes: str = ""
    tags: list[str] = field(default_factory=list)

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["paris", "rome", "oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}, "hours": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["zone", "hours"],
    "additionalProperties": False,
}


def tool(name: str, schema: dict, description: str, strict: bool = True) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema, "strict": strict}}


TOOLS = [tool("get_weather", WEATHER_SCHEMA, "The weather in a city."), tool("get_time", TIME_SCHEMA, "The time in a zone.")]
# Not strict: with strict tools, tool_choice auto gets vLLM's structural tag, which replaces a request's own regex.
LOOSE_TOOLS = [tool("get_weather", WEATHER_SCHEMA, "The weather in a city.", strict=False),
               tool("get_time", TIME_SCHEMA, "The time in a zone.", strict=False)]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["paris", "rome"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["city", "n"],
    "additionalProperties": False,
}
NO_THINKING = {"enable_thinking": False}
# A hermes tool call, as the regex that forces it (no whitespace inside the JSON but what the format has).
HERMES_WEATHER = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(paris|rome)"\}\}\n</tool_call>'
HERMES_TIME = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(utc|cet)", "hours": [0-9]\}\}\n</tool_call>'
GRAMMAR = 'root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'
USER = "What is the weather in Paris today, and should I bring tea?"


def whitespace_token_ids(tokenizer: Any) -> list[int]:
    """Every token that decodes to whitespace only: banned (-100) where JSON would otherwise fill up with it."""
    ids = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text and not text.strip():
            ids.append(token_id)
    return ids


def token_id(tokenizer: Any, token: str) -> int | None:
    found = tokenizer.convert_tokens_to_ids(token)
    return None if found is None or found == tokenizer.unk_token_id else found


def build_shapes(tokenizer: Any, model: str, max_model_len: int) -> list[Shape]:
    """All shapes, in the order they are sent (one at a time to each server)."""
    ban_ws = {str(i): -100 for i in whitespace_token_ids(tokenizer)}
    think_end = token_id(tokenizer, "</think>")
    # Tokens of " wat", which the greedy chat_no_thinking answer has at its 4th word.
    stop_ids = tokenizer.encode(" wat", add_special_tokens=False)
    greedy = {"model": model, "temperature": 0, "max_tokens": MAX_TOKENS}

    def chat(content: str = USER, **extra: Any) -> dict:
        return greedy | {"messages": [{"role": "user", "content": content}]} | extra

    def quiet(content: str = USER, **extra: Any) -> dict:  # thinking off: content, and structured outputs from token one
        return chat(content, chat_template_kwargs=NO_THINKING, **extra)

    def cmpl(prompt: Any = "The quick brown fox jumps over the lazy dog", **extra: Any) -> dict:
        return greedy | {"prompt": prompt} | extra

    def tools_forced(regex: str, stream: bool = False, **extra: Any) -> dict:
        return quiet(**({"tools": LOOSE_TOOLS, "tool_choice": "auto", "structured_outputs": {"regex": regex},
                         "max_tokens": TOOL_MAX_TOKENS, "stream": stream} | extra))

    def tools_guided(tool_choice: Any, stream: bool = False, **extra: Any) -> dict:
        return quiet(**({"tools": TOOLS, "tool_choice": tool_choice, "logit_bias": ban_ws, "max_tokens": TOOL_MAX_TOKENS,
                         "stream": stream} | extra))

    history = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "celsius": 21}'},
    ]
    # With this prompt and bias the greedy answer closes its reasoning after ~10 tokens (measured on the seed-0 model).
    reasoning_bias = {str(think_end): 3} if think_end is not None else {}
    split_prompt = "Hello there, friend."
    long_prompt = "tea and cats " * (max_model_len // 2 + 50)
    usage = {"include_usage": True}
    s: list[Shape] = [
        # --- chat: plain ---
        Shape("chat_basic", CHAT, chat(), notes="thinking on (qwen3 default): all reasoning"),
        Shape("chat_basic_stream", CHAT, chat(stream=True)),
        Shape("chat_no_thinking", CHAT, quiet()),
        Shape("chat_no_thinking_stream", CHAT, quiet(stream=True, stream_options=usage)),
        Shape("chat_system_developer", CHAT, greedy | {"chat_template_kwargs": NO_THINKING, "messages": [
            {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello there, friend."}]}),
        Shape("chat_developer_role", CHAT, greedy | {"chat_template_kwargs": NO_THINKING, "messages": [
            {"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hello there, friend."}]}),
        Shape("chat_multi_turn", CHAT, greedy | {"chat_template_kwargs": NO_THINKING, "messages": [
            {"role": "user", "content": "Name a drink."}, {"role": "assistant", "content": "Tea."},
            {"role": "user", "content": "And a cat name?"}]}),
        Shape("chat_text_parts", CHAT, greedy | {"chat_template_kwargs": NO_THINKING, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Tell me about"}, {"type": "text", "text": " tea and cats."}]}]}),
        Shape("chat_continue_final", CHAT, greedy | {"add_generation_prompt": False, "continue_final_message": True,
              "messages": [{"role": "user", "content": "Say a word."}, {"role": "assistant", "content": "The word is"}]}),
        Shape("chat_max_completion_tokens", CHAT, quiet(max_tokens=None, max_completion_tokens=7)),
        Shape("chat_unknown_openai_params", CHAT, quiet(store=False, metadata={"team": "a"}, service_tier="auto", user="u1",
                                                       parallel_tool_calls=True)),
        # --- chat: sampling ---
        Shape("chat_stop_string", CHAT, quiet(stop=["a"], max_tokens=32)),
        Shape("chat_stop_include", CHAT, quiet(stop=["a"], include_stop_str_in_output=True, max_tokens=32)),
        Shape("chat_stop_stream", CHAT, quiet(stop=["e", "o"], max_tokens=32, stream=True)),
        Shape("chat_stop_token_ids", CHAT, quiet(stop_token_ids=stop_ids, max_tokens=32)),
        Shape("chat_min_tokens_ignore_eos", CHAT, quiet(min_tokens=12, ignore_eos=True, max_tokens=12)),
        Shape("chat_repetition_penalty", CHAT, quiet(repetition_penalty=1.5)),
        Shape("chat_presence_frequency", CHAT, quiet(presence_penalty=1.2, frequency_penalty=0.8)),
        Shape("chat_seed_top_p_top_k_min_p", CHAT, quiet(temperature=0.8, seed=11, top_p=0.9, top_k=20, min_p=0.05)),
        Shape("chat_seed", CHAT, quiet(temperature=1.0, seed=1234)),
        Shape("chat_seed_stream", CHAT, quiet(temperature=1.0, seed=1234, stream=True)),
        Shape("chat_n3_seeded", CHAT, quiet(temperature=1.0, seed=5, n=3)),
        Shape("chat_n2_seeded_stream", CHAT, quiet(n=2, temperature=0.9, seed=21, stream=True, stream_options=usage)),
        Shape("chat_logit_bias", CHAT, quiet(logit_bias={"300": 5, "301": -100, "350": 3})),
        Shape("chat_logprobs_top3", CHAT, quiet(logprobs=True, top_logprobs=3)),
        Shape("chat_logprobs_no_top", CHAT, quiet(logprobs=True)),
        Shape("chat_logprobs_stream", CHAT, quiet(logprobs=True, top_logprobs=2, stream=True)),
        Shape("chat_logprobs_thinking", CHAT, chat(logprobs=True, top_logprobs=1)),
        Shape("chat_stream_usage_continuous", CHAT, quiet(stream=True, stream_options={"include_usage": True,
                                                                                       "continuous_usage_stats": True})),
        # --- chat: structured outputs ---
        Shape("chat_json_object", CHAT, quiet(response_format={"type": "json_object"}, logit_bias=ban_ws, max_tokens=32)),
        Shape("chat_json_schema", CHAT, quiet(response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "strict": True, "schema": ANSWER_SCHEMA}}, logit_bias=ban_ws, max_tokens=48)),
        Shape("chat_json_schema_stream", CHAT, quiet(response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "strict": True, "schema": ANSWER_SCHEMA}}, logit_bias=ban_ws, max_tokens=48, stream=True)),
        Shape("chat_structured_json", CHAT, quiet(structured_outputs={"json": ANSWER_SCHEMA}, logit_bias=ban_ws, max_tokens=48)),
        Shape("chat_structured_regex", CHAT, quiet(structured_outputs={"regex": "[a-z]{3,6} [0-9]{2}"}, max_tokens=24)),
        Shape("chat_structured_choice", CHAT, quiet(structured_outputs={"choice": ["tea", "coffee", "water"]})),
        Shape("chat_structured_grammar", CHAT, quiet(structured_outputs={"grammar": GRAMMAR})),
        # --- chat: tools ---
        Shape("chat_tools_auto_free", CHAT, quiet(tools=TOOLS, tool_choice="auto"), notes="no call: plain content"),
        Shape("chat_tools_default_choice", CHAT, quiet(tools=TOOLS), notes="tool_choice absent = auto"),
        Shape("chat_tools_auto_forced", CHAT, tools_forced(HERMES_WEATHER)),
        Shape("chat_tools_auto_forced_stream", CHAT, tools_forced(HERMES_WEATHER, stream=True)),
        Shape("chat_tools_auto_parallel", CHAT, tools_forced(HERMES_WEATHER + r"\n" + HERMES_TIME, max_tokens=160)),
        Shape("chat_tools_auto_parallel_stream", CHAT, tools_forced(HERMES_WEATHER + r"\n" + HERMES_TIME, stream=True,
                                                                    max_tokens=160)),
        Shape("chat_tools_auto_content_then_call", CHAT, tools_forced("[a-z]{2,5} " + HERMES_WEATHER)),
        Shape("chat_tools_required", CHAT, tools_guided("required", parallel_tool_calls=False)),
        Shape("chat_tools_required_stream", CHAT, tools_guided("required", stream=True, parallel_tool_calls=False)),
        Shape("chat_tools_required_parallel", CHAT, tools_guided("required"), notes="calls until max_tokens"),
        Shape("chat_tools_named", CHAT, tools_guided({"type": "function", "function": {"name": "get_time"}})),
        Shape("chat_tools_named_stream", CHAT, tools_guided({"type": "function", "function": {"name": "get_weather"}},
                                                            stream=True, stream_options=usage)),
        Shape("chat_tools_none", CHAT, quiet(tools=TOOLS, tool_choice="none")),
        Shape("chat_tools_none_regex", CHAT, tools_forced(HERMES_WEATHER, tool_choice="none"),
              notes="tool_choice none: call text stays content"),
        Shape("chat_tool_history", CHAT, greedy | {"messages": history, "tools": TOOLS, "chat_template_kwargs": NO_THINKING}),
        Shape("chat_tool_history_stream", CHAT, greedy | {"messages": history, "tools": TOOLS, "stream": True,
                                                          "chat_template_kwargs": NO_THINKING}),
        Shape("chat_unknown_role", CHAT, greedy | {"messages": [{"role": "wizard", "content": "hi there friend"}]},
              notes="vLLM accepts any role"),
        Shape("chat_tools_thinking_forced", CHAT, chat(tools=TOOLS, structured_outputs={"regex": HERMES_WEATHER}),
              notes="thinking on: the regex never starts"),
        # --- chat: reasoning ---
        Shape("chat_reasoning_split", CHAT, chat(split_prompt, logit_bias=reasoning_bias, max_tokens=24),
              notes="logit_bias on </think>: reasoning then content"),
        Shape("chat_reasoning_split_stream", CHAT, chat(split_prompt, logit_bias=reasoning_bias, max_tokens=24, stream=True)),
        Shape("chat_reasoning_history", CHAT, greedy | {"messages": [
            {"role": "user", "content": "Name a drink."},
            {"role": "assistant", "content": "<think>\nshort one\n</think>\n\nTea."},
            {"role": "user", "content": "And a cat name?"}]}),
        # --- completions ---
        Shape("cmpl_basic", COMPLETIONS, cmpl(), compare="completion"),
        Shape("cmpl_stream", COMPLETIONS, cmpl(stream=True, stream_options=usage), compare="completion"),
        Shape("cmpl_echo", COMPLETIONS, cmpl(echo=True), compare="completion"),
        Shape("cmpl_echo_logprobs", COMPLETIONS, cmpl(echo=True, logprobs=2, max_tokens=4), compare="completion"),
        Shape("cmpl_logprobs", COMPLETIONS, cmpl(logprobs=3), compare="completion"),
        Shape("cmpl_logprobs_stream", COMPLETIONS, cmpl(logprobs=1, stream=True), compare="completion"),
        Shape("cmpl_batch", COMPLETIONS, cmpl(["Tea and cats.", "The river bank is near the dog"]), compare="completion"),
        Shape("cmpl_batch_stream", COMPLETIONS, cmpl(["Tea and cats.", "The river bank is near the dog"], stream=True,
                                                     stream_options=usage), compare="completion"),
        Shape("cmpl_token_ids", COMPLETIONS, cmpl([300, 301, 302, 303, 304, 305, 306]), compare="completion"),
        Shape("cmpl_token_id_batch", COMPLETIONS, cmpl([[300, 301, 302, 303, 304], [400, 401, 402, 403, 404]]),
              compare="completion"),
        Shape("cmpl_n2_seeded", COMPLETIONS, cmpl(n=2, temperature=1.0, seed=9), compare="completion"),
        Shape("cmpl_stop", COMPLETIONS, cmpl(stop=["e"], max_tokens=32), compare="completion"),
        Shape("cmpl_sampling_extras", COMPLETIONS, cmpl(min_tokens=8, repetition_penalty=1.3, stop_token_ids=[310],
                                                        min_p=0.1, temperature=0.7, seed=3), compare="completion"),
        Shape("cmpl_logit_bias", COMPLETIONS, cmpl(logit_bias={"300": 6, "301": -100}), compare="completion"),
        Shape("cmpl_structured_regex", COMPLETIONS, cmpl(structured_outputs={"regex": "[0-9]{4}-[0-9]{2}"}),
              compare="completion"),
        Shape("cmpl_response_format_json", COMPLETIONS, cmpl(response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "schema": ANSWER_SCHEMA}}, logit_bias=ban_ws, max_tokens=48), compare="completion"),
        Shape("cmpl_unknown_openai_params", COMPLETIONS, cmpl(user="u1", store=True, metadata={"a": "b"}), compare="completion"),
        # --- tokenize / detokenize / models ---
        Shape("tokenize_prompt", TOKENIZE, {"model": model, "prompt": "Tea and cats near the river."}, compare="json"),
        Shape("tokenize_no_special", TOKENIZE, {"model": model, "prompt": "Tea and cats.", "add_special_tokens": False},
              compare="json"),
        Shape("tokenize_messages", TOKENIZE, {"model": model, "messages": [{"role": "user", "content": "Hello there."}]},
              compare="json"),
        Shape("tokenize_messages_tools", TOKENIZE, {"model": model, "messages": history, "tools": TOOLS,
                                                    "add_generation_prompt": True}, compare="json"),
        Shape("tokenize_token_strs", TOKENIZE, {"model": model, "prompt": "Tea and cats.", "return_token_strs": True},
              compare="json"),
        Shape("detokenize", DETOKENIZE, {"model": model, "tokens": [300, 301, 302, 303, 304, 305]}, compare="json"),
        Shape("models", MODELS, None, method="GET", compare="models"),
        # --- bad inputs: the status code must match ---
        Shape("err_tool_choice_without_tools", CHAT, quiet(tool_choice="required"), compare="status"),
        Shape("err_named_tool_unknown", CHAT, quiet(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
              compare="status"),
        Shape("err_top_logprobs_without_logprobs", CHAT, quiet(top_logprobs=3), compare="status"),
        Shape("err_top_logprobs_too_many", CHAT, quiet(logprobs=True, top_logprobs=25), compare="status"),
        Shape("err_n0", CHAT, quiet(n=0), compare="status"),
        Shape("err_unknown_model", CHAT, quiet(model="no-such-model"), compare="status"),
        Shape("err_invalid_json", CHAT, '{"model": "' + model + '", "messages": [', compare="status"),
        Shape("err_missing_messages", CHAT, greedy, compare="status"),
        Shape("err_too_long_prompt", CHAT, chat(long_prompt), compare="status"),
        Shape("err_max_tokens_over_context", CHAT, quiet(max_tokens=max_model_len + 10), compare="status"),
        Shape("err_image_content", CHAT, greedy | {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, compare="status"),
        Shape("err_negative_temperature", CHAT, quiet(temperature=-1), compare="status"),
        Shape("err_bad_response_format", CHAT, quiet(response_format={"type": "xml"}), compare="status"),
        Shape("err_n2_greedy", CHAT, quiet(n=2), compare="status", notes="vLLM: n must be 1 when greedy"),
        Shape("err_cmpl_logprobs_too_many", COMPLETIONS, cmpl(logprobs=25), compare="status"),
        Shape("err_cmpl_too_long_prompt", COMPLETIONS, cmpl(long_prompt), compare="status"),
        Shape("err_cmpl_unknown_model", COMPLETIONS, cmpl(model="no-such-model"), compare="status"),
        Shape("err_cmpl_missing_prompt", COMPLETIONS, greedy, compare="status"),
        Shape("err_stream_n0", CHAT, quiet(n=0, stream=True), compare="status"),
        *api_translation_shapes(model),
    ]
    for shape in s:  # quiet(max_tokens=None, ...) means "leave it out"
        if isinstance(shape.body, dict) and shape.body.get("max_tokens", 0) is None:
            del shape.body["max_tokens"]
    names = [shape.name for shape in s]
    assert len(names) == len(set(names)), "shape names must be unique"
    return s


def api_translation_shapes(model: str) -> list[Shape]:
    """The Anthropic Messages and the Responses APIs, which vLLM serves through its chat path, as kvlane does."""
    def message(content: str = USER, **extra: Any) -> dict:
        return {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": content}]} | extra

    def response(**extra: Any) -> dict:
        # vllm serve keeps no responses unless VLLM_ENABLE_RESPONSES_API_STORE is set: these ask for none.
        return {"model": model, "input": USER, "max_output_tokens": MAX_TOKENS, "temperature": 0, "store": False} | extra

    anthropic_tool = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_SCHEMA}
    response_tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                     "parameters": WEATHER_SCHEMA, "strict": True}
    no_thinking = {"effort": "none"}
    return [
        Shape("messages_basic", MESSAGES, message(), compare="messages"),
        # One token: the thinking alone. The next is text that opens with `<tool_call>`, which vLLM 0.32's Anthropic
        # stream drops (its whole answer, and its chat stream, have it); kvlane's stream keeps it.
        Shape("messages_stream", MESSAGES, message(stream=True, max_tokens=1), compare="messages",
              notes="vLLM's Anthropic stream drops text that opens with a tool-call marker"),
        Shape("messages_system", MESSAGES, message(system="You answer briefly.", max_tokens=24), compare="messages"),
        Shape("messages_system_blocks_stream", MESSAGES, message(system=[{"type": "text", "text": "You answer briefly."}],
                                                                 stream=True), compare="messages"),
        Shape("messages_stop_sequences", MESSAGES, message(stop_sequences=["e"], max_tokens=24), compare="messages"),
        Shape("messages_multi_turn", MESSAGES, message() | {"messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Rome?"}]}]}, compare="messages"),
        Shape("messages_tool_result", MESSAGES, message(tools=[anthropic_tool]) | {"messages": [
            {"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "rome"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "clear, 21 C"}]}]},
              compare="messages"),
        Shape("err_messages_missing_max_tokens", MESSAGES, {"model": model, "messages": [{"role": "user", "content": "Hi"}]},
              compare="status"),
        Shape("err_messages_unknown_model", MESSAGES, message(model="no-such-model"), compare="status"),
        Shape("responses_basic", RESPONSES, response(), compare="responses"),
        Shape("responses_stream", RESPONSES, response(stream=True), compare="responses"),
        Shape("responses_instructions", RESPONSES, response(instructions="You answer briefly.", reasoning=no_thinking),
              compare="responses"),
        Shape("responses_input_items", RESPONSES, response(reasoning=no_thinking, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Weather in Rome?"}]), compare="responses"),
        Shape("responses_function_output", RESPONSES, response(reasoning=no_thinking, tools=[response_tool], input=[
            {"role": "user", "content": "Weather in Rome?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "clear, 21 C"}]), compare="responses"),
        Shape("err_responses_unknown_previous", RESPONSES, response(previous_response_id="resp_nope"), compare="status"),
        Shape("err_responses_unknown_model", RESPONSES, response(model="no-such-model"), compare="status"),
    ]
