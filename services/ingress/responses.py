"""The OpenAI Responses API (`/v1/responses`), served as `vllm serve` serves it for a chat model without harmony.

vLLM renders `instructions` and `input` (after the stored conversation of a
`previous_response_id`) as chat messages through the chat template, runs
them, and turns the output into output items
(`vllm/entrypoints/openai/responses/`). kvlane builds the same chat
messages and runs them on its own chat path (`Completions.start(CHAT, ...)`),
so limits, auth, routing and every chat validation apply unchanged.

The translation is pure: `chat_request` (request and stored conversation →
chat completion body), `output_of`/`ResponseDraft.response` (chat
completion → response), `ResponseStream` (chat chunks → stream events).
`Responses` is the shell the transports call; stored responses live in
Redis (`ResponseStore`), so any replica continues any conversation.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from contracts.openai_api import ChatCompletion, ChatCompletionChunk, ChatDelta, CompletionUsage, DeltaToolCall
from contracts.responses_api import (
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    IncompleteDetails,
    InputContent,
    InputItem,
    InputTokensDetails,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    Response,
    ResponseCompleted,
    ResponseCreated,
    ResponseInProgress,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    StoredResponse,
    StreamEvent,
    event_type,
)
from services.ingress.completions import CHAT, Answer, Completions, TranslatedAnswer
from services.ingress.errors import ApiError, from_decode_error
from services.ingress.render import named_sse
from services.ingress.response_store import ResponseStore

log = structlog.get_logger("kvlane.ingress")
_ENCODER = msgspec.json.Encoder()
_REQUEST = msgspec.json.Decoder(ResponsesRequest)
_COMPLETION = msgspec.json.Decoder(ChatCompletion)
_CHUNK = msgspec.json.Decoder(ChatCompletionChunk)


# Statuses of a last input item that ask the model to continue it rather than answer it (vLLM's partial completion).
_PARTIAL = ("in_progress", "incomplete")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _random_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- request: Responses → chat completion ------------------------------------------


def check_request(request: ResponsesRequest) -> None:
    """What vLLM refuses before it renders anything (the same messages)."""
    if request.prompt is not None:
        raise ApiError(400, "prompt template is not supported", code="invalid_value", param="prompt")
    if request.background:
        # vLLM runs background requests in its own process's memory; kvlane has no replica-independent runner for them.
        raise ApiError(400, "background is not supported", code="invalid_value", param="background")
    if request.text is not None and request.text.format is not None and request.text.format.type == "json_schema" \
            and request.text.format.schema is None:
        raise ApiError(400, "text.format.schema is required for json_schema", code="invalid_value", param="text")


def tool_choice_of(request: ResponsesRequest) -> str | dict[str, Any]:
    """The request's `tool_choice` as vLLM settles it (no tools: "auto" becomes "none"); a misfit is a 400."""
    choice = request.tool_choice
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not request.tools:
        if choice in ("auto", "none"):
            return "none"
        if choice == "required":
            raise ApiError(400, "Tool choice 'required' must be specified with 'tools' parameter.",
                           code="invalid_value", param="tool_choice")
        if named:
            raise ApiError(400, "Tool choice 'function' not found in 'tools' parameter.", code="invalid_value", param="tool_choice")
    elif named and not any(tool.get("name") == choice.get("name") for tool in request.tools):  # type: ignore[union-attr]
        raise ApiError(400, "Tool choice 'function' not found in 'tools' parameter.", code="invalid_value", param="tool_choice")
    return choice


def chat_request(request: ResponsesRequest, previous: StoredResponse | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat completion body vLLM's renderer builds from `request`, and its messages (what a stored
    response keeps of its conversation)."""
    check_request(request)
    tool_choice = tool_choice_of(request)
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if previous is not None:
        messages += history_of(previous)
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        messages += chat_messages(request.input)
    body: dict[str, Any] = {"messages": messages}
    if request.model is not None:
        body["model"] = request.model
    optional = {"max_tokens": request.max_output_tokens, "temperature": request.temperature, "top_p": request.top_p,
                "top_k": request.top_k, "min_p": request.min_p, "presence_penalty": request.presence_penalty,
                "frequency_penalty": request.frequency_penalty, "repetition_penalty": request.repetition_penalty,
                "seed": request.seed, "stop": request.stop or None, "ignore_eos": request.ignore_eos,
                "logit_bias": request.logit_bias, "user": request.user, "priority": request.priority}
    body.update((name, value) for name, value in optional.items() if value is not None)
    if not request.include_reasoning:
        body["include_reasoning"] = False
    if continues_last_item(request.input):
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    functions = [_chat_tool(tool) for tool in request.tools if tool.get("type") == "function"]
    if functions:
        # Other tool types (web search, MCP, ...) need vLLM's tool server; without one vLLM renders only functions.
        body["tools"] = functions
        body["tool_choice"] = ({"type": "function", "function": {"name": tool_choice["name"]}}
                               if isinstance(tool_choice, dict) else tool_choice)
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
    template_kwargs = dict(request.chat_template_kwargs or {})
    effort = request.reasoning.effort if request.reasoning is not None else None
    if effort is not None:
        body["reasoning_effort"] = effort
        # Templates that need thinking switched on (e.g. Gemma 4) get it, unless the caller said otherwise.
        template_kwargs.setdefault("enable_thinking", effort != "none")
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.name or "response", "schema": text_format.schema,
            **({"strict": text_format.strict} if text_format.strict is not None else {})}}
    if logprobs_asked(request):
        body["logprobs"] = True
        if request.top_logprobs:
            body["top_logprobs"] = request.top_logprobs
    if request.stream:
        # Usage on every chunk: the first gives `response.created` its prompt length, the last the final usage.
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body, messages


def logprobs_asked(request: ResponsesRequest) -> bool:
    return "message.output_text.logprobs" in (request.include or [])


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "a function tool needs a `name`", code="invalid_value", param="tools")
    function = {key: value for key, value in tool.items() if key in ("name", "description", "parameters", "strict")
                and value is not None}
    return {"type": "function", "function": function}


def continues_last_item(items: str | list[InputItem]) -> bool:
    """Whether the last input item is a partial assistant message (or reasoning) for the model to continue."""
    if isinstance(items, str) or not items:
        return False
    last = items[-1]
    return last.type in ("message", "reasoning") and last.status in _PARTIAL


def history_of(previous: StoredResponse) -> list[dict[str, Any]]:
    """The conversation a previous response continues: its messages without instructions (they do not carry
    over, per the OpenAI spec), then what it answered."""
    messages = [message for message in previous.messages if message.get("role") != "system"]
    for item in previous.response.output:
        if isinstance(item, OutputMessage):
            messages += [{"role": "assistant", "content": part.text} for part in item.content]
        elif isinstance(item, FunctionCallItem):
            # vLLM leaves calls out of the history; a `function_call_output` that follows would then answer no call.
            _append_tool_call(messages, item.call_id, item.name, item.namespace, item.arguments)
        # Reasoning is left out, as vLLM leaves it out.
    return messages


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Chat messages from input items (vLLM's `construct_chat_messages_with_tool_call`): an assistant's
    reasoning, text and calls that follow one another merge into one message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        previous = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        if item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise ApiError(400, "a function_call input item needs call_id, name and arguments", code="invalid_value", param="input")
            _append_tool_call(messages, item.call_id, item.name, item.namespace, item.arguments)
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "content": _tool_output(item.output), "tool_call_id": item.call_id})
        elif item.type == "reasoning":
            if item.encrypted_content:
                raise ApiError(400, "Encrypted content is not supported.", code="invalid_value", param="input")
            text = _first_text(item.content) or _first_text(item.summary) or ""
            if previous is not None and previous.get("reasoning") is None:
                previous["reasoning"] = text
            else:
                messages.append({"role": "assistant", "reasoning": text})
        elif item.type == "message" and item.role == "assistant":
            text = item.content if isinstance(item.content, str) else _first_text(item.content)
            if text is None:
                raise ApiError(400, "an assistant message needs text content", code="invalid_value", param="input")
            if previous is not None and previous.get("content") is None:
                previous["content"] = text
            else:
                messages.append({"role": "assistant", "content": text})
        elif item.type == "message" and item.role:
            messages.append({"role": item.role, "content": _chat_content(item.content)})
        else:
            raise ApiError(400, f"Unsupported input item type: {item.type}", code="invalid_value", param="input")
    return messages


def _append_tool_call(messages: list[dict[str, Any]], call_id: str, name: str, namespace: str | None, arguments: str) -> None:
    call = {"id": call_id, "type": "function",
            "function": {"name": f"{namespace}__{name}" if namespace else name, "arguments": arguments}}
    previous = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if previous is not None:
        previous.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "tool_calls": [call]})


def _first_text(parts: list[InputContent] | None) -> str | None:
    return parts[0].text if parts else None


def _chat_part(part: InputContent) -> dict[str, Any]:
    if part.type in _TEXT_PARTS:
        return {"type": "text", "text": part.text or ""}
    if part.type == "input_image":
        return {"type": "image_url", "image_url": {"url": part.image_url or ""}}
    return {"type": part.type}  # the chat path says which part types the model takes


def _chat_content(content: str | list[InputContent] | None) -> str | list[dict[str, Any]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return [_chat_part(part) for part in content]


def _tool_output(output: str | list[InputContent] | None) -> str | list[dict[str, Any]]:
    return _chat_content(output)


# --- response: chat completion → Responses -----------------------------------------


def usage_of(usage: CompletionUsage | None) -> ResponseUsage | None:
    """vLLM's usage, of one turn: a chat model without built-in tools answers in one generation."""
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    reasoning = usage.completion_tokens_details.reasoning_tokens if usage.completion_tokens_details else 0
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached, 0, [usage.prompt_tokens], [cached]),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning, 0, [usage.completion_tokens], [0]),
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
    )


def status_of(finish_reason: str | None) -> ResponseStatus:
    return "incomplete" if finish_reason == "length" else "completed"


def _output_logprobs(chat: ChatCompletion) -> list[dict[str, Any]] | None:
    logprobs = chat.choices[0].logprobs
    if logprobs is None or logprobs.content is None:
        return None
    return [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes or list(t.token.encode()),
             "top_logprobs": [{"token": top.token, "logprob": top.logprob, "bytes": top.bytes or list(top.token.encode())}
                              for top in t.top_logprobs]}
            for t in logprobs.content]


def output_of(chat: ChatCompletion, parsed: bool) -> list[OutputItem]:
    """A whole chat answer's output items (vLLM's `_make_response_output_items`): reasoning, then the message,
    then each call. `parsed`: the model has a reasoning or tool-call parser; without one vLLM answers one
    message, even an empty one."""
    message = chat.choices[0].message
    logprobs = _output_logprobs(chat)
    items: list[OutputItem] = []
    if message.reasoning:
        items.append(ReasoningItem(_random_id("rs"), content=[ReasoningText(message.reasoning)]))
    if message.content or (not parsed and not message.tool_calls):
        content = [OutputText(message.content, logprobs=logprobs)] if message.content else []
        items.append(OutputMessage(_random_id("msg"), content))
    items += [FunctionCallItem(call.function.arguments, call.id, call.function.name, _random_id("fc"))
              for call in message.tool_calls]
    return items


@dataclass(frozen=True)
class ResponseDraft:
    """What a response says of its request (vLLM's `ResponsesResponse.from_request`), before its output."""

    id: str
    created_at: int
    model: str
    request: ResponsesRequest
    # What bounds `max_output_tokens` when the request leaves it out: the ingress's default and the model's context.
    max_tokens_default: int
    max_model_len: int

    def max_output_tokens(self, prompt_tokens: int | None) -> int:
        if self.request.max_output_tokens is not None:
            return self.request.max_output_tokens
        if prompt_tokens is None:
            return self.max_tokens_default
        return max(0, min(self.max_tokens_default, self.max_model_len - prompt_tokens))

    def response(self, status: ResponseStatus, output: list[OutputItem], usage: ResponseUsage | None,
                 prompt_tokens: int | None = None) -> Response:
        request = self.request
        if prompt_tokens is None and usage is not None:
            prompt_tokens = usage.input_tokens
        return Response(
            id=self.id,
            created_at=self.created_at,
            incomplete_details=IncompleteDetails("max_output_tokens") if status == "incomplete" else None,
            instructions=request.instructions,
            metadata=request.metadata,
            model=self.model,
            output=output,
            parallel_tool_calls=request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
            temperature=1.0 if request.temperature is None else request.temperature,
            tool_choice=tool_choice_of(request),
            tools=request.tools,
            top_p=1.0 if request.top_p is None else request.top_p,
            background=bool(request.background),
            max_output_tokens=self.max_output_tokens(prompt_tokens),
            max_tool_calls=request.max_tool_calls,
            previous_response_id=request.previous_response_id,
            prompt=request.prompt,
            reasoning=request.reasoning,
            service_tier=request.service_tier,
            status=status,
            text=request.text,
            top_logprobs=request.top_logprobs if logprobs_asked(request) else None,
            truncation=request.truncation or "disabled",
            usage=usage,
            user=request.user,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
        )

    def whole(self, chat: ChatCompletion, parsed: bool) -> Response:
        return self.response(status_of(chat.choices[0].finish_reason), output_of(chat, parsed), usage_of(chat.usage))


def _split(delta: ChatDelta) -> list[ChatDelta]:
    """A chat delta as deltas of one kind each (vLLM's `split_delta`): reasoning, content, then calls by index."""
    parts: list[ChatDelta] = []
    if delta.reasoning is not None:
        parts.append(ChatDelta(reasoning=delta.reasoning))
    if delta.content is not None:
        parts.append(ChatDelta(content=delta.content))
    by_index: dict[int, list[DeltaToolCall]] = {}
    for call in delta.tool_calls:
        by_index.setdefault(call.index, []).append(call)
    parts += [ChatDelta(tool_calls=calls) for calls in by_index.values()]
    return parts


class ResponseStream:
    """Chat completion chunks in, Responses stream events out (vLLM's `SimpleStreamingEventProcessor`).

    One output item is open at a time (a message, a reasoning item or a
    function call); output of another kind, or another call, closes it and
    opens the next. Whatever the chunks, the events are well formed:
    `response.created` and `response.in_progress` first, every item added
    and done in order, `response.completed` last, `sequence_number`
    counting up from 0.
    """

    def __init__(self, draft: ResponseDraft) -> None:
        self._draft = draft
        self._sequence = 0
        self._started = False
        self._prompt_tokens: int | None = None
        self._usage: CompletionUsage | None = None
        self._finish_reason: str | None = None
        self._output: list[OutputItem] = []
        # The open item: its kind ("message", "reasoning", "function_call" or None), id, text so far.
        self._open: str | None = None
        self._item_id = ""
        self._text = ""
        self._logprobs: list[dict[str, Any]] = []
        self._call_id = ""
        self._call_name = ""
        self._call_index: int | None = None
        self.finished = False

    @property
    def output(self) -> list[OutputItem]:
        return self._output

    def _numbered(self, events: list[StreamEvent]) -> list[StreamEvent]:
        for event in events:
            event.sequence_number = self._sequence
            self._sequence += 1
        return events

    def _opening(self) -> list[StreamEvent]:
        if self._started:
            return []
        self._started = True
        opened = self._draft.response("in_progress", [], None, self._prompt_tokens)
        return [ResponseCreated(response=opened), ResponseInProgress(response=opened)]

    def feed(self, chunk: ChatCompletionChunk) -> list[StreamEvent]:
        if self.finished:
            return []
        if chunk.usage is not None:
            self._usage = chunk.usage
            if self._prompt_tokens is None:
                self._prompt_tokens = chunk.usage.prompt_tokens
        events = self._opening()
        for choice in chunk.choices[:1]:
            if choice.finish_reason is not None:
                self._finish_reason = choice.finish_reason
            for delta in _split(choice.delta):
                events += self._delta(delta, choice.logprobs.content if choice.logprobs else None)
        return self._numbered(events)

    def _delta(self, delta: ChatDelta, logprobs: list[Any] | None) -> list[StreamEvent]:
        call = delta.tool_calls[0] if delta.tool_calls and delta.tool_calls[0].function is not None else None
        kind = "function_call" if call is not None else "reasoning" if delta.reasoning is not None \
            else "message" if delta.content else None
        if kind is None:
            return []
        events: list[StreamEvent] = []
        if kind != self._open or (call is not None and self._call_index is not None and call.index != self._call_index):
            events += self._close()
            events += self._start(kind, call)
        if kind == "function_call":
            arguments = "".join(c.function.arguments or "" for c in delta.tool_calls if c.function is not None)
            if arguments:
                self._text += arguments
                events.append(FunctionCallArgumentsDelta(item_id=self._item_id, output_index=len(self._output), delta=arguments))
        elif kind == "reasoning":
            assert delta.reasoning is not None
            self._text += delta.reasoning
            events.append(ReasoningTextDelta(item_id=self._item_id, output_index=len(self._output), content_index=0,
                                             delta=delta.reasoning))
        else:
            assert delta.content is not None
            self._text += delta.content
            stream_logprobs = [{"token": t.token, "logprob": t.logprob,
                                "top_logprobs": [{"token": top.token, "logprob": top.logprob} for top in t.top_logprobs]}
                               for t in logprobs or []] if logprobs_asked(self._draft.request) else []
            self._logprobs += [{**lp, "bytes": list(lp["token"].encode())} for lp in stream_logprobs]
            events.append(OutputTextDelta(item_id=self._item_id, output_index=len(self._output), content_index=0,
                                          delta=delta.content, logprobs=stream_logprobs))
        return events

    def _start(self, kind: str, call: DeltaToolCall | None) -> list[StreamEvent]:
        self._open, self._text, self._logprobs = kind, "", []
        index = len(self._output)
        if kind == "function_call":
            assert call is not None and call.function is not None
            self._item_id = _random_id("fc")
            self._call_id = call.id or f"chatcmpl-tool-{uuid.uuid4().hex}"
            self._call_name = call.function.name or ""
            self._call_index = call.index
            item = FunctionCallItem("", self._call_id, self._call_name, self._item_id, status="in_progress")
            return [OutputItemAdded(output_index=index, item=item)]
        if kind == "reasoning":
            self._item_id = _random_id("rs")
            return [OutputItemAdded(output_index=index, item=ReasoningItem(self._item_id, status="in_progress")),
                    ContentPartAdded(item_id=self._item_id, output_index=index, content_index=0, part=ReasoningText(""))]
        self._item_id = _random_id("msg")
        return [OutputItemAdded(output_index=index, item=OutputMessage(self._item_id, [], status="in_progress")),
                ContentPartAdded(item_id=self._item_id, output_index=index, content_index=0, part=OutputText("", logprobs=[]))]

    def _close(self) -> list[StreamEvent]:
        kind, self._open = self._open, None
        index, text, item_id = len(self._output), self._text, self._item_id
        events: list[StreamEvent]
        item: OutputItem
        if kind is None:
            return []
        if kind == "function_call":
            self._call_index = None
            item = FunctionCallItem(text, self._call_id, self._call_name, item_id)
            events = [FunctionCallArgumentsDone(item_id=item_id, output_index=index, arguments=text, name=self._call_name)]
        elif kind == "reasoning":
            reasoning = ReasoningText(text)
            item = ReasoningItem(item_id, content=[reasoning], status="completed")
            events = [ReasoningTextDone(item_id=item_id, output_index=index, content_index=0, text=text),
                      ContentPartDone(item_id=item_id, output_index=index, content_index=0, part=reasoning)]
        else:
            part = OutputText(text, logprobs=self._logprobs or None)
            item = OutputMessage(item_id, [part] if text else [])
            events = [OutputTextDone(item_id=item_id, output_index=index, content_index=0, text=text),
                      ContentPartDone(item_id=item_id, output_index=index, content_index=0, part=part)]
        self._output.append(item)
        return [*events, OutputItemDone(output_index=index, item=item)]

    def final(self) -> Response:
        """The response as `response.completed` carries it (only once the chunks have run out)."""
        return self._draft.response(status_of(self._finish_reason), list(self._output), usage_of(self._usage),
                                    self._prompt_tokens)

    def finish(self) -> list[StreamEvent]:
        """The events that end the stream once the chunks have run out: the open item's end, `response.completed`."""
        if self.finished:
            return []
        events = [*self._opening(), *self._close()]
        self.finished = True
        return self._numbered([*events, ResponseCompleted(response=self.final())])

    def fail(self, error: ApiError) -> list[StreamEvent]:
        """The `error` event that ends a stream broken off."""
        if self.finished:
            return []
        self.finished = True
        return self._numbered([*self._opening(), ErrorEvent(code=error.code, message=error.message, param=error.param)])


# --- the shell the transports call -------------------------------------------------


def sse_event(event: StreamEvent) -> bytes:
    """One event as vLLM writes it: `event: <type>` and `data: <json>`."""
    return named_sse(event_type(event), _ENCODER.encode(event))


class Responses:
    def __init__(self, completions: Completions, store: ResponseStore, max_tokens_default: int,
                 clock: Callable[[], float] = time.time) -> None:
        self._completions = completions
        self._store = store
        self._max_tokens_default = max_tokens_default
        self._clock = clock

    async def start(self, payload: bytes, caller_gone: Callable[[], bool],
                    headers: Mapping[str, str] | None = None) -> ResponseAnswer:
        """Translate, run as a chat completion, wait for the first output; every error is raised as an `ApiError`."""
        try:
            request = _REQUEST.decode(payload)
        except msgspec.DecodeError as exc:
            # As on the chat path: a caller without a valid key learns nothing of its body.
            await self._completions.authenticate(headers, None)
            raise from_decode_error(exc) from exc
        # Before the store is read: a caller without a valid key learns nothing of stored responses either.
        await self._completions.authenticate(headers, request.model)
        previous = None
        if request.previous_response_id is not None:
            previous = await self._store.get(request.previous_response_id)
            if previous is None:
                raise not_found(request.previous_response_id)
        body, messages = chat_request(request, previous)
        registration, _ = await self._completions.resolve(request.model)
        body["model"] = registration.model if request.model is None else request.model
        draft = ResponseDraft(_random_id("resp"), int(self._clock()), body["model"], request,
                              self._max_tokens_default, registration.max_model_len)
        answer = await self._completions.start(CHAT, _ENCODER.encode(body), caller_gone, headers)
        parsed = bool(registration.tool_call_parser or registration.reasoning_parser)
        return ResponseAnswer(answer, draft, parsed, messages, self._store if request.store else None)

    async def retrieve(self, response_id: str, headers: Mapping[str, str] | None = None) -> bytes:
        """`GET /v1/responses/{id}`: a stored response, else a 404."""
        await self._completions.authenticate(headers, None)
        stored = await self._store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return _ENCODER.encode(stored.response)


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", code="not_found", param="response_id")


class ResponseAnswer(TranslatedAnswer):
    """What a transport serves: one response, or a stream of events. Close it (`async with`) to end or abort it."""

    def __init__(self, answer: Answer, draft: ResponseDraft, parsed: bool, messages: list[dict[str, Any]],
                 store: ResponseStore | None) -> None:
        super().__init__(answer)
        self._draft = draft
        self._parsed = parsed
        self._messages = messages
        self._store = store
        self._stream = ResponseStream(draft)

    async def _keep(self, response: Response) -> None:
        if self._store is not None:
            await self._store.put(StoredResponse(response, self._messages))

    async def body(self) -> bytes:
        response = self._draft.whole(_COMPLETION.decode(await self._answer.body()), self._parsed)
        await self._keep(response)
        return _ENCODER.encode(response)

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The stream's events, in order; an error mid-stream raises `ApiError` (`error_events` end the stream with it)."""
        async for chunk in self._answer.chunks():
            for event in self._stream.feed(_CHUNK.decode(chunk)):
                yield event
        closing = self._stream.finish()
        # Stored before `response.completed` goes out: a client may continue it as soon as it reads it.
        await self._keep(self._stream.final())
        for event in closing:
            yield event

    def error_events(self, error: ApiError) -> list[StreamEvent]:
        """The events that end a stream broken off by `error` (an `error` event; none once the stream has ended)."""
        return self._stream.fail(error)

    async def sse(self) -> AsyncIterator[bytes]:
        """The stream as server-sent events, ended by an `error` event if it broke off."""
        try:
            async for event in self.events():
                yield sse_event(event)
        except ApiError as exc:
            log.warning("stream_failed", code=exc.code, error=exc.message)
            for event in self.error_events(exc):
                yield sse_event(event)
