"""What of the OpenAI request the sim engine honours, and how it shapes the answer (pure).

The sim model is a pure function from seed, prompt and position to a token,
and it honours the request surface in that spirit:
* tools and structured outputs: the answer is scripted (`sim.responder`):
  a tool call in the sim's `<tool_call>` format, or JSON valid for the
  schema, emitted token by token, then "stop" (or "length" at max_tokens);
* logprobs: made up, yet a function of the stream (`sim.logprobs`);
* `n`: choice i is the stream of seed + i;
* chat answers go through the `kvlane_sim` tool-call parser (when the worker
  advertises it): deltas when streamed, the whole output parsed on each
  choice's last output otherwise, as the vLLM engine shapes them.
Every piece is a function of the request, so a run resumed elsewhere with
`resume_token_ids` (n = 1) answers as an uninterrupted one.

What it still cannot honour is refused, naming the parameter, rather than
answered as if it had been: what needs a distribution to sample (logit
bias, penalties, min_p, banned or allowed tokens, prompt logprobs), stop
token ids and min_tokens, a regex, grammar or structural tag, and a tool
choice the worker's parser (`worker.sim.tool_call_parser`) is off for.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from msgspec import Struct

from contracts.messages import ApiRequest, FinishReason
from services.worker.engines.base import EngineOutput, EngineRequest, RequestRejected
from services.worker.sim.logprobs import token_logprob
from services.worker.sim.responder import ApiAsks, scripted_output
from services.worker.sim.tokens import prompt_digest, stream_key
from services.worker.sim.tool_parser import TOOL_CALL_PARSER, SimToolParser

# As `vllm serve`'s default max_logprobs.
MAX_LOGPROBS = 20
# The tool-call parsers a sim worker can run, by the name its registration advertises.
SIM_TOOL_CALL_PARSERS = {TOOL_CALL_PARSER: SimToolParser}

_DECODER = msgspec.json.Decoder(ApiAsks)


def decode_asks(api: ApiRequest) -> ApiAsks:
    try:
        return _DECODER.decode(api.body)
    except msgspec.DecodeError as exc:
        raise RequestRejected(f"the request body does not decode: {exc}") from exc


def check_sim_request(api: ApiRequest | None, tool_call_parser: str = TOOL_CALL_PARSER) -> ApiAsks | None:
    """Raise `RequestRejected` naming the first parameter of `api` the sim engine cannot honour; its asks else."""
    if api is None:
        return None
    asks = decode_asks(api)
    unsupported = {
        "prompt_logprobs": asks.prompt_logprobs is not None,
        "logit_bias": bool(asks.logit_bias),
        "min_tokens": asks.min_tokens > 0,
        "repetition_penalty": asks.repetition_penalty not in (None, 1.0),
        "min_p": asks.min_p not in (None, 0.0),
        "stop_token_ids": bool(asks.stop_token_ids),
        "bad_words": bool(asks.bad_words),
        "allowed_token_ids": asks.allowed_token_ids is not None,
    }
    for param, asked_for in unsupported.items():
        if asked_for:
            raise RequestRejected(f"the sim engine does not support `{param}` (its model samples no distribution); "
                                  "serve the model with --engine vllm", param=param)
    top = _ranked(asks, api.kind)
    if top is not None and top - (api.kind == "completion") > MAX_LOGPROBS:
        param = "top_logprobs" if api.kind == "chat" else "logprobs"
        raise RequestRejected(f"at most {MAX_LOGPROBS} logprobs per token (the sim's max_logprobs)", param=param)
    named_or_required = asks.tool_choice == "required" or isinstance(asks.tool_choice, dict)
    if api.kind == "chat" and named_or_required and not tool_call_parser:
        # vLLM's own refusal when no tool parser is configured.
        described = "a named function" if isinstance(asks.tool_choice, dict) else '"required"'
        raise RequestRejected(f"tool_choice={described} requires a tool-call parser (worker.sim.tool_call_parser)",
                              param="tool_choice")
    return asks


def _ranked(asks: ApiAsks, kind: str) -> int | None:
    """How many entries each token's `top` carries (None: no logprobs): chat's top_logprobs, or a completion's
    logprobs and the sampled token beside them (the ingress cuts to what the API shows)."""
    if kind == "chat":
        if not asks.logprobs:
            return None
        top = asks.top_logprobs or 0
        return MAX_LOGPROBS if top == -1 else top
    if asks.logprobs is None or isinstance(asks.logprobs, bool):
        return None
    return (MAX_LOGPROBS if asks.logprobs == -1 else asks.logprobs) + 1


class SimChoice(Struct):
    """One choice's stream: its seed, and its scripted answer ([]: free words)."""

    index: int
    seed: int
    script: list[int]


class SimApiRun:
    """One request's answer shaping: logprobs and parsing, per choice, over the tokens the scheduler emits."""

    def __init__(self, choices: list[SimChoice], keys: list[int], ranked: int | None,
                 parsers: dict[int, SimToolParser], streamed: bool, text_of: Callable[[int], str],
                 alternatives: tuple[int, int], resumed: int) -> None:
        self.choices = choices
        self._keys = keys
        self._ranked = ranked
        self._parsers = parsers
        self._streamed = streamed
        self._text_of = text_of
        self._alternatives = alternatives
        # Each choice's next output position (after what a previous run produced).
        self._positions = [resumed] * len(choices)

    def output(self, index: int, token_ids: list[int], text: str, finish_reason: FinishReason | None,
               stop_reason: str | None, cached_tokens: int) -> EngineOutput:
        output = EngineOutput(token_ids, text, finish_reason, cached_tokens, index)
        if finish_reason is not None:
            output.stop_reason = stop_reason
        position = self._positions[index]
        self._positions[index] = position + len(token_ids)
        if self._ranked is not None:
            key = self._keys[index]
            output.logprobs = [token_logprob(key, position + i, token_id, self._ranked, self._alternatives, self._text_of)
                               for i, token_id in enumerate(token_ids)]
        parser = self._parsers.get(index)
        if parser is not None:
            delta = parser.feed(token_ids, finished=finish_reason is not None, text=text)
            if self._streamed:
                output.delta = delta
            elif finish_reason is not None:
                output.parsed = parser.parsed()
        return output

    def ends_script(self, index: int, count: int) -> bool:
        """Whether `count` more tokens of the choice complete its scripted answer (it then stops, not runs out)."""
        script = self.choices[index].script
        return bool(script) and self._positions[index] + count >= len(script)


def plan_sim_request(request: EngineRequest, seed: int, tool_call_parser: str, text_of: Callable[[int], str],
                     alternatives: tuple[int, int]) -> SimApiRun | None:
    """How the sim answers `request` beyond plain words; None when it asks for nothing more (the plain path).

    `seed`: the request's (or the worker's); `alternatives`: the ids logprobs rank beside the sampled token."""
    asks = check_sim_request(request.api, tool_call_parser)
    if asks is None:
        return None
    api = request.api
    assert api is not None
    n = request.sampling.n
    resumed = request.resume_token_ids
    if resumed and n > 1:
        # Each choice went its own way: the resumed tokens are one choice's, and kvlane resumes one stream.
        raise RequestRejected("cannot resume a request with n > 1", param="n")
    digest = prompt_digest(request.prompt_token_ids)
    keys = [stream_key(seed + index, digest) for index in range(n)]
    choices = [SimChoice(index, seed + index, scripted_output(asks, api.kind, request.prompt_token_ids, key))
               for index, key in enumerate(keys)]
    ranked = _ranked(asks, api.kind)
    parser_cls = SIM_TOOL_CALL_PARSERS.get(tool_call_parser) if api.kind == "chat" else None
    if n == 1 and ranked is None and parser_cls is None and not choices[0].script:
        return None
    parsers = {} if parser_cls is None else {index: parser_cls(text_of, key) for index, key in enumerate(keys)}
    if resumed and parsers:
        # What the client already has was parsed by the previous run; the parser only needs its state.
        parsers[0].feed(resumed)
    run = SimApiRun(choices, keys, ranked, parsers, api.stream, text_of, alternatives, len(resumed))
    if resumed and run.ends_script(0, 0):
        raise RequestRejected("the resumed tokens already complete the scripted answer")
    return run

