"""The OpenAI request surface of `vllm serve`, on the embedded vLLM engine.

The ingress renders and tokenizes the prompt; everything else `vllm serve`
does with a request happens here, with vLLM's own code, so that answers match
it: the request body becomes vLLM's own pydantic request (and its validation
errors vLLM's 400s), its sampling comes from the request's own
`to_sampling_params`, and each choice's output goes through the tool-call and
reasoning parser that `vllm serve --tool-call-parser/--reasoning-parser` would
build. The ingress turns the pieces into OpenAI JSON as vLLM's serving does.

Mirrors `vllm/entrypoints/openai/chat_completion/serving.py` (its stream and
full generators), `completion/serving.py` and `renderers/online_renderer.py`
(the parts that do not need the messages).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic
from vllm.entrypoints.generate.base.protocol import DeltaMessage, FunctionCall
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam, ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
# `_format_error` is private to vLLM: tests/vllm/test_vllm_internals.py pins it.
from vllm.entrypoints.serve.exception_handling.handlers.validation import _format_error, clean_loc_for_param
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
from vllm.exceptions import VLLMValidationError
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput
from vllm.parser import ParserManager
from vllm.parser.abstract_parser import Parser
from vllm.sampling_params import RequestOutputKind
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.v1.structured_output.request import get_structured_output_key

from contracts.messages import ApiRequest, FinishReason, OutputDelta, ParsedOutput, ParsedToolCall, TokenLogprob, ToolCallDelta, TopLogprob
from services.worker.engines.base import EngineConfigError, EngineOutput, EngineRequest, RequestRejected
from services.worker.engines.vllm_resumed_grammar import RESUMED_GRAMMAR, RESUMED_GRAMMAR_PROCESSOR, resumed_grammar_entry
from shared.config import VllmSettings

OpenAiRequest = ChatCompletionRequest | CompletionRequest

# The body comes without its prompt (it rides as token ids), yet vLLM's request models require one. These pass
# every validator that looks at it; what the real messages must satisfy, the ingress checked when it rendered them.
CHAT_PLACEHOLDER_MESSAGES = [{"role": "user", "content": ""}]
COMPLETION_PLACEHOLDER_PROMPT = [0]

# As vLLM's validation handler bounds its message (vllm/entrypoints/serve/exception_handling/handlers/validation.py).
MAX_REPORTED_ERRORS = 10
LOGPROB_FLOOR = -9999.0


# --- the request --------------------------------------------------------------------


def parse_api_request(api: ApiRequest) -> OpenAiRequest:
    """vLLM's own request model for `api`; `RequestRejected` with vLLM's 400 message when it is invalid."""
    try:
        body = json.loads(api.body)
    except ValueError as exc:
        raise RequestRejected(f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestRejected("the request body must be a JSON object")
    model: type[OpenAiRequest]
    if api.kind == "chat":
        body["messages"], model = CHAT_PLACEHOLDER_MESSAGES, ChatCompletionRequest
    else:
        body["prompt"], model = COMPLETION_PLACEHOLDER_PROMPT, CompletionRequest
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise validation_rejection(exc) from None
    except (VLLMValidationError, ValueError, TypeError) as exc:  # raised past pydantic by a validator
        raise vllm_rejection(exc) from None


def validation_rejection(exc: pydantic.ValidationError) -> RequestRejected:
    """What `vllm serve` answers a body that fails validation: FastAPI's errors (their `loc` under "body"), as its
    validation handler words them, and the `param` it names."""
    errors = [{**error, "loc": ("body", *error.get("loc", ()))} for error in exc.errors(include_url=False)]
    param = next((error["ctx"]["error"].parameter for error in errors
                  if isinstance(error.get("ctx", {}).get("error"), VLLMValidationError)), None)
    if param is None and errors and errors[0].get("loc"):
        param = clean_loc_for_param(tuple(errors[0]["loc"]))
    if not errors:
        return RequestRejected("Validation error", param)
    count = len(errors)
    label = "error" if count == 1 else "errors"
    reported = errors[:MAX_REPORTED_ERRORS]
    message = f"{count} validation {label}:\n" + "".join(f"  {_format_error(error)}\n" for error in reported)
    if count > len(reported):
        message += f"  ...and {count - len(reported)} more {label}\n"
    return RequestRejected(sanitize_message(message.rstrip()), param)


def vllm_rejection(exc: Exception) -> RequestRejected:
    """A vLLM error about the request, worded as `vllm serve`'s error response words it."""
    return RequestRejected(sanitize_message(str(exc)), getattr(exc, "parameter", None))


def check_tool_choice_servable(request: ChatCompletionRequest, parser_cls: type[Parser] | None,
                               enable_auto_tools: bool) -> None:
    """The renderer's refusal of a tool choice that no configured tool parser can honour (vLLM's wording)."""
    tool_parser = parser_cls.tool_parser_cls if parser_cls is not None else None
    if tool_parser is not None or request.tool_choice in (None, "none"):
        return
    if request.tool_choice == "auto":
        if not enable_auto_tools:
            raise RequestRejected('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        return
    if isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam):
        described = f'function "{request.tool_choice.function.name}"'
    else:
        described = f'"{request.tool_choice}"'
    raise RequestRejected(f"tool_choice={described} requires --tool-call-parser to be set")


def wants_logprobs(request: OpenAiRequest) -> bool:
    """Whether the answer carries logprobs: chat's `logprobs` is a flag, completion's a count (0 included)."""
    if isinstance(request, ChatCompletionRequest):
        return bool(request.logprobs)
    return request.logprobs is not None


# --- output pieces (pure) ------------------------------------------------------------------


def decoded_token(logprob: Logprob, token_id: int, tokenizer: Any, as_token_id: bool) -> str:
    """vLLM serving's `_get_decoded_token`."""
    if as_token_id:
        return f"token_id:{token_id}"
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def token_logprobs(token_ids: Sequence[int], positions: Sequence[Mapping[int, Logprob] | None], tokenizer: Any,
                   as_token_ids: bool = False) -> list[TokenLogprob]:
    """One entry per generated token, as vLLM's chat serving builds them (`_create_chat_logprobs`), with every
    ranked token vLLM returned for the position in `top` (the ingress cuts them to the request's count)."""
    entries = []
    for token_id, ranked in zip(token_ids, positions, strict=True):
        sampled = ranked.get(token_id) if ranked is not None else None
        if sampled is None:
            # A token vLLM gave no logprob for: named, without one.
            token = f"token_id:{token_id}" if as_token_ids else tokenizer.decode(token_id)
            entries.append(TokenLogprob(token=token, bytes=utf8(token), token_id=token_id))
            continue
        top = [
            TopLogprob(token=(name := decoded_token(logprob, ranked_id, tokenizer, as_token_ids)),
                       logprob=max(logprob.logprob, LOGPROB_FLOOR), bytes=utf8(name), token_id=ranked_id)
            for ranked_id, logprob in ranked.items()
        ]
        entries.append(TokenLogprob(
            token=decoded_token(sampled, token_id, tokenizer, as_token_ids),
            logprob=max(sampled.logprob, LOGPROB_FLOOR),
            bytes=None if sampled.decoded_token is None else utf8(sampled.decoded_token),
            top=top,
            token_id=token_id,
        ))
    return entries


def output_delta(message: DeltaMessage) -> OutputDelta:
    return OutputDelta(
        content=message.content,
        reasoning=message.reasoning,
        tool_calls=[
            ToolCallDelta(index=call.index, id=call.id,
                          name=call.function.name if call.function is not None else None,
                          arguments=call.function.arguments if call.function is not None else None)
            for call in message.tool_calls
        ],
    )


def parsed_output(reasoning: str | None, content: str | None, tool_calls: Sequence[FunctionCall] | None,
                  reasoning_tokens: int) -> ParsedOutput:
    return ParsedOutput(
        content=content,
        reasoning=reasoning,
        tool_calls=[ParsedToolCall(name=call.name, arguments=call.arguments, id=call.id) for call in tool_calls or ()],
        reasoning_tokens=reasoning_tokens,
    )


# --- per request ------------------------------------------------------------------------


class ChoiceParse:
    """One choice's parser and, for an answer parsed once at the end, its whole output so far."""

    def __init__(self, parser: Parser, text: str = "", token_ids: Sequence[int] = ()) -> None:
        self.parser = parser
        self.text = text
        self.token_ids = list(token_ids)
        self.produced = bool(token_ids)


class ApiRun:
    """One request's sampling and output shaping, as `vllm serve` would do them."""

    def __init__(self, request: OpenAiRequest, sampling: VllmSamplingParams, engine_kwargs: dict[str, Any],
                 streamed: bool, prompt_token_ids: list[int], tokenizer: Any, enable_auto_tools: bool,
                 choices: dict[int, ChoiceParse]) -> None:
        self.request = request
        self.sampling = sampling
        # `reasoning_ended` / `reasoning_parser_kwargs` for AsyncLLM.generate / add_request.
        self.engine_kwargs = engine_kwargs
        self._streamed = streamed
        self._prompt_token_ids = prompt_token_ids
        self._tokenizer = tokenizer
        self._enable_auto_tools = enable_auto_tools
        self._choices = choices
        self._logprobs = wants_logprobs(request)
        # A completion that echoes its prompt with logprobs reports the prompt's too (once per choice).
        self._echoed_logprobs = self._logprobs and bool(getattr(request, "echo", False)) and isinstance(request, CompletionRequest)
        self._prompt_logprobs_sent: set[int] = set()
        self._as_token_ids = bool(getattr(request, "return_tokens_as_token_ids", False))

    def output(self, completion: CompletionOutput, cached_tokens: int, finish_reason: FinishReason | None,
               prompt_logprobs: Sequence[Mapping[int, Logprob] | None] | None = None) -> EngineOutput:
        """The engine output for one choice's new tokens (`finish_reason` set on its last); a completion that
        echoes its prompt with logprobs gets the prompt's (`prompt_logprobs`, vLLM's) on the choice's first."""
        token_ids = list(completion.token_ids)
        output = EngineOutput(token_ids=token_ids, text=completion.text, finish_reason=finish_reason,
                              cached_tokens=cached_tokens, index=completion.index)
        if self._echoed_logprobs and prompt_logprobs and completion.index not in self._prompt_logprobs_sent:
            self._prompt_logprobs_sent.add(completion.index)
            output.prompt_logprobs = token_logprobs(self._prompt_token_ids, prompt_logprobs, self._tokenizer, self._as_token_ids)
        if finish_reason is not None:
            output.stop_reason = completion.stop_reason
        if self._logprobs and completion.logprobs is not None:
            output.logprobs = token_logprobs(token_ids, completion.logprobs, self._tokenizer, self._as_token_ids)
        choice = self._choices.get(completion.index)
        if choice is not None:
            if self._streamed:
                output.delta = self._parse_delta(choice, completion.text, token_ids, finish_reason is not None)
            else:
                choice.text += completion.text
                choice.token_ids += token_ids
                if finish_reason is not None:
                    output.parsed = self._parse_whole(choice)
        return output

    def _parse_delta(self, choice: ChoiceParse, text: str, token_ids: list[int], finished: bool) -> OutputDelta | None:
        if not text and not token_ids and not choice.produced:
            return None  # vLLM sends nothing for an empty output before the first token (chunked prefill)
        choice.produced = choice.produced or bool(token_ids)
        message = choice.parser.parse_delta(delta_text=text, delta_token_ids=token_ids, request=self.request,
                                            prompt_token_ids=self._prompt_token_ids, finished=finished)
        return None if message is None else output_delta(message)

    def _parse_whole(self, choice: ChoiceParse) -> ParsedOutput:
        parser, request = choice.parser, self.request
        parser.set_prompt_token_ids(self._prompt_token_ids)
        reasoning, content, tool_calls = parser.parse(choice.text, request, enable_auto_tools=self._enable_auto_tools,
                                                      model_output_token_ids=choice.token_ids)
        if not request.include_reasoning:  # type: ignore[union-attr]  # only chat requests are parsed
            reasoning = None
        return parsed_output(reasoning, content, tool_calls, parser.count_reasoning_tokens(choice.token_ids))


class ApiSurface:
    """What `vllm serve` holds for the engine's requests: its parser class, its sampling defaults, its tokenizer."""

    def __init__(self, parser_cls: type[Parser] | None, enable_auto_tools: bool, tokenizer: Any, model_config: Any,
                 default_sampling_params: dict[str, Any], structured_outputs_config: Any = None,
                 resumes_grammar: bool = False) -> None:
        self.parser_cls = parser_cls
        self.enable_auto_tools = enable_auto_tools
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.default_sampling_params = default_sampling_params
        # The engine's; None: resumed structured outputs are refused.
        self.structured_outputs_config = structured_outputs_config
        # Whether the engine core runs the resumed-grammar logits processor (vllm_resumed_grammar.py).
        self.resumes_grammar = resumes_grammar and structured_outputs_config is not None

    @classmethod
    def of_engine(cls, settings: VllmSettings, engine: Any) -> ApiSurface:
        """Built from the started `AsyncLLM`, with vLLM's checks of the parser options."""
        check_parser_settings(settings)
        model_config = engine.model_config
        try:
            parser_cls = ParserManager.get_parser(
                tool_parser_name=settings.tool_call_parser or None,
                reasoning_parser_name=settings.reasoning_parser,
                enable_auto_tools=settings.enable_auto_tool_choice,
                model_name=model_config.model,
                is_harmony=model_config.hf_config.model_type == "gpt_oss",
                tokenizer=engine.tokenizer,
            )
        except (TypeError, ValueError, KeyError) as exc:
            raise EngineConfigError(f"vllm parser options: {exc}") from exc
        vllm_config = engine.vllm_config
        return cls(parser_cls, settings.enable_auto_tool_choice, engine.tokenizer, model_config,
                   model_config.get_diff_sampling_param(), vllm_config.structured_outputs_config,
                   runs_resumed_grammar(vllm_config))

    def prepare(self, request: EngineRequest) -> ApiRun:
        """`request.api` as vLLM's serving would run it; `RequestRejected` when vLLM would answer a 400."""
        assert request.api is not None
        api = request.api
        parsed = parse_api_request(api)
        resumed = list(request.resume_token_ids)
        if parsed.use_beam_search:
            raise RequestRejected("beam search is not supported here", param="use_beam_search")
        if resumed and (parsed.n or 1) > 1:
            # Each choice went its own way: the resumed tokens are one choice's, and kvlane resumes one stream.
            raise RequestRejected("cannot resume a request with n > 1", param="n")
        engine_prompt = list(request.prompt_token_ids) + resumed
        parser = None
        chat_template_kwargs: dict[str, Any] = {}
        if isinstance(parsed, ChatCompletionRequest):
            check_tool_choice_servable(parsed, self.parser_cls, self.enable_auto_tools)
            chat_template_kwargs = parsed.build_chat_params(None, "auto").chat_template_kwargs
            if self.parser_cls is not None:
                parsed = self._adjusted(parsed, chat_template_kwargs)
                parser = self._parser(parsed, chat_template_kwargs)
        try:
            sampling = parsed.to_sampling_params(request.sampling.max_tokens - len(resumed), self.default_sampling_params)
        except (VLLMValidationError, ValueError, TypeError) as exc:
            raise vllm_rejection(exc) from None
        if resumed and sampling.structured_outputs is not None:
            self._resume_grammar(parsed, parser, sampling, list(request.prompt_token_ids), len(resumed))
        sampling.output_kind = RequestOutputKind.DELTA  # the worker streams its frames whatever the client reads
        if resumed:
            # The resumed tokens were generated, and count toward the minimum as they do toward the maximum.
            sampling.min_tokens = max(sampling.min_tokens - len(resumed), 0)
        engine_kwargs: dict[str, Any] = {}
        if isinstance(parsed, ChatCompletionRequest):
            engine_kwargs = self._engine_reasoning_kwargs(parsed, parser, chat_template_kwargs, engine_prompt)
        choices: dict[int, ChoiceParse] = {}
        if parser is not None:
            choices = self._choices(parsed, parser, chat_template_kwargs, resumed, sampling, api.stream,
                                    list(request.prompt_token_ids))
        return ApiRun(parsed, sampling, engine_kwargs, api.stream, list(request.prompt_token_ids), self.tokenizer,
                      self.enable_auto_tools, choices)

    def _resume_grammar(self, request: OpenAiRequest, parser: Parser | None, sampling: VllmSamplingParams,
                        prompt_token_ids: list[int], resumed: int) -> None:
        """Hand a resumed request's structured output to the engine core's resumed-grammar processor.

        vLLM's own grammar would start over at the resumed tokens, constraining the rest as if it were the whole.
        The processor compiles the grammar vLLM would (the backend and key that vLLM's validation picks, checked
        here with vLLM's own code), advances it over the resumed tokens, and masks from there; `sampling` then
        carries the spec under `extra_args`, and no structured output of vLLM's own.
        """
        if not self.resumes_grammar:
            raise RequestRejected("cannot resume a request with structured outputs on this vllm engine (its model "
                                  "runner has no resumed-grammar logits processor)", param="response_format")
        if wants_logprobs(request):
            # vLLM masks the logits before its sampler computes logprobs; a logits processor masks after.
            raise RequestRejected("cannot resume a request with structured outputs and logprobs", param="logprobs")
        if sampling.min_tokens > resumed:
            # vLLM's min-tokens processor lets a grammar's stop tokens through where nothing else is allowed,
            # seeing the grammar's mask; it runs before this one and would not see it.
            raise RequestRejected("cannot resume a request with structured outputs before its min_tokens were "
                                  "generated", param="min_tokens")
        self._check_grammar_from_start(request, parser, prompt_token_ids)
        config = self.structured_outputs_config
        try:
            # As the engine's input processor checks the request and picks its backend (rewriting, as it does,
            # a choice into a grammar).
            # Private to vLLM, as is `_backend` below: tests/vllm/test_vllm_internals.py pins them.
            sampling._validate_structured_outputs(self.model_config, config, self.tokenizer)
        except (VLLMValidationError, ValueError, TypeError) as exc:
            raise vllm_rejection(exc) from None
        params = sampling.structured_outputs
        assert params is not None
        if params._backend != "xgrammar":
            raise RequestRejected(f"cannot resume a request whose structured output runs on the {params._backend} "
                                  "backend (only xgrammar's resumes)", param="response_format")
        request_type, spec = get_structured_output_key(params)
        sampling.structured_outputs = None
        sampling.extra_args = {**(sampling.extra_args or {}),
                               RESUMED_GRAMMAR: resumed_grammar_entry(request_type, spec, resumed)}

    def _check_grammar_from_start(self, request: OpenAiRequest, parser: Parser | None,
                                  prompt_token_ids: list[int]) -> None:
        """Refuses a request whose grammar did not constrain its output from the first token: vLLM starts it only
        once the reasoning ended (StructuredOutputManager._get_constraint_bounds), which the resumed tokens may
        have passed partway."""
        config = self.structured_outputs_config
        if config.enable_in_reasoning or not config.reasoning_parser:
            return  # no reasoning gate in the engine: the grammar applies from the first token
        ended = None
        if isinstance(request, ChatCompletionRequest):
            # What the engine was given for the original prompt (the resumed tokens are not part of it).
            ended = request.resolve_reasoning_ended(parser, prompt_token_ids)
        if ended is not True:
            raise RequestRejected("cannot resume a request with structured outputs whose reasoning had not ended "
                                  "when its output began (the grammar starts partway through the output)",
                                  param="response_format")

    def _parser(self, request: ChatCompletionRequest, chat_template_kwargs: dict[str, Any]) -> Parser:
        assert self.parser_cls is not None
        return self.parser_cls(self.tokenizer, request.tools, chat_template_kwargs=chat_template_kwargs,
                               model_config=self.model_config)

    def _adjusted(self, request: ChatCompletionRequest, chat_template_kwargs: dict[str, Any]) -> ChatCompletionRequest:
        """The renderer's `adjust_request`: tool calls and reasoning may constrain sampling (structural tags) or
        change it (special tokens kept), so it runs where the sampling is made."""
        assert self.parser_cls is not None
        adjust = (self.parser_cls.always_adjust_request or self.parser_cls.reasoning_parser_cls is not None
                  or request.tool_choice != "none")
        if not adjust:
            return request
        try:
            return self._parser(request, chat_template_kwargs).adjust_request(request=request)  # type: ignore[return-value]
        except (VLLMValidationError, ValueError, TypeError) as exc:
            raise vllm_rejection(exc) from None

    @staticmethod
    def _engine_reasoning_kwargs(request: ChatCompletionRequest, parser: Parser | None,
                                 chat_template_kwargs: dict[str, Any], prompt_token_ids: list[int]) -> dict[str, Any]:
        """The chat serving's `_engine_reasoning_kwargs`."""
        parser_kwargs = None
        if parser is not None and parser.reasoning_parser is not None:
            parser_kwargs = {"chat_template_kwargs": chat_template_kwargs}
        return {"reasoning_ended": request.resolve_reasoning_ended(parser, prompt_token_ids),
                "reasoning_parser_kwargs": parser_kwargs}

    def _choices(self, request: ChatCompletionRequest, first: Parser, chat_template_kwargs: dict[str, Any],
                 resumed: list[int], sampling: VllmSamplingParams, streamed: bool,
                 prompt_token_ids: list[int]) -> dict[int, ChoiceParse]:
        """One parser per choice (parsers keep state), primed with what a previous run already streamed."""
        parsers = [first] + [self._parser(request, chat_template_kwargs) for _ in range(1, request.n or 1)]
        if not resumed:
            return {index: ChoiceParse(parser) for index, parser in enumerate(parsers)}
        # Resumption is refused for n > 1 (prepare): one choice.
        resumed_text = self.tokenizer.decode(resumed, skip_special_tokens=sampling.skip_special_tokens)
        if not streamed:
            return {0: ChoiceParse(first, resumed_text, resumed)}
        # What the client already has was parsed by the previous run; this parser only needs its state.
        first.parse_delta(delta_text=resumed_text, delta_token_ids=resumed, request=request,
                          prompt_token_ids=prompt_token_ids, finished=False)
        return {0: ChoiceParse(first, token_ids=resumed)}


def runs_resumed_grammar(vllm_config: Any) -> bool:
    """Whether the started engine core runs the resumed-grammar logits processor: it is loaded, and the model
    runner is the V1 one whose interface it implements."""
    processors = vllm_config.model_config.logits_processors or ()
    return RESUMED_GRAMMAR_PROCESSOR in processors and not vllm_config.use_v2_model_runner


def check_parser_settings(settings: VllmSettings) -> None:
    """`vllm serve`'s own check of its parser flags (validate_parsed_serve_args)."""
    if settings.enable_auto_tool_choice and not settings.tool_call_parser:
        raise EngineConfigError("worker.vllm.enable_auto_tool_choice requires worker.vllm.tool_call_parser "
                                "(vLLM: --enable-auto-tool-choice requires --tool-call-parser)")

