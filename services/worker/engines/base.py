"""The interface every worker engine implements (sim today, vLLM next)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Protocol, runtime_checkable

from msgspec import Struct

from contracts.messages import ApiRequest, EngineStats, FinishReason, KvRef, OutputDelta, ParsedOutput, SamplingParams, TokenLogprob


class LocalAdapter(Struct, frozen=True):
    """A LoRA adapter as an engine loads it: the name clients use, and the directory its fetched files are in."""

    name: str
    path: str


class EngineRequest(Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Output already produced elsewhere; generation continues after it.
    resume_token_ids: list[int] = []
    # The prompt's KV waits on a prefill node: pull it instead of prefilling.
    kv_ref: KvRef | None = None
    # When the source's hold on that KV ends, on this process's `time.monotonic` clock.
    kv_held_until: float | None = None
    # The API request (tool calls, structured outputs, logprobs, `n`...): None for plain sampled text.
    api: ApiRequest | None = None
    # The LoRA adapter to run with (None: the base model).
    adapter: LocalAdapter | None = None


class EngineOutput(Struct):
    """What one engine step produced for one request."""

    token_ids: list[int]
    text: str
    # Set on the last output of a request, None before.
    finish_reason: FinishReason | None = None
    # Prompt tokens served from the prefix cache; known from the first output on.
    cached_tokens: int = 0
    # The choice it belongs to (`n` > 1); a request ends once every choice has its finish reason.
    index: int = 0
    # One per token, when the request asked for logprobs.
    logprobs: list[TokenLogprob] = []
    # The new text parsed (reasoning, tool calls), for a streamed request whose output is parsed.
    delta: OutputDelta | None = None
    # With the finish reason: the stop string or token that ended the choice (if one did), and, for a
    # request whose output is parsed and not streamed, the choice's whole output parsed.
    stop_reason: str | int | None = None
    parsed: ParsedOutput | None = None
    # On a choice's first output, when the request echoes its prompt with logprobs: one per prompt token.
    prompt_logprobs: list[TokenLogprob] = []


class KvCacheDelta(Struct):
    """Net change of an engine's prefix cache since the previous drain."""

    stored: list[int] = []
    removed: list[int] = []
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


def net_kv_delta(events: Iterable[tuple[bool, int]], cleared: bool = False) -> KvCacheDelta:
    """Collapse ordered (stored?, block_hash) events to each hash's last state."""
    last: dict[int, bool] = {}
    for stored, block_hash in events:
        last[block_hash] = stored
    return KvCacheDelta(
        stored=[h for h, s in last.items() if s], removed=[h for h, s in last.items() if not s], cleared=cleared
    )


class RequestRejected(ValueError):
    """The engine can never run this request (too long, bad token ids, a parameter it cannot honour...).

    `param` names the request parameter at fault, when there is one.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class KvPullFailed(RuntimeError):
    """The KV named by a request's `kv_ref` could not be pulled; nothing was generated."""


class EngineDeadError(RuntimeError):
    """The engine died: it runs nothing more, and the worker leaves the cluster."""


class EngineConfigError(ValueError):
    """The engine can never start with this configuration; the message names the problem."""


class EngineFacts(Struct, frozen=True):
    """What a worker advertises about its engine in its registration."""

    model: str  # the name clients ask for
    block_size: int
    max_model_len: int
    tokenizer: str  # a spec that shared.tokenizer.load_tokenizer understands
    # The model's directory (its config.json gives the shapes an adapter must fit); "": no real model (sim).
    model_directory: str = ""


def check_fits(request: EngineRequest, max_model_len: int, vocab_size: int | None) -> None:
    """The checks every engine makes: context length, resumption room, token ids in the vocabulary."""
    prompt_len = len(request.prompt_token_ids)
    max_tokens = request.sampling.max_tokens
    if prompt_len + max_tokens > max_model_len:
        raise RequestRejected(
            f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the model's context length ({max_model_len})"
        )
    if len(request.resume_token_ids) >= max_tokens:
        raise RequestRejected(
            f"resuming after {len(request.resume_token_ids)} tokens leaves nothing of max_tokens ({max_tokens})"
        )
    if vocab_size:
        # Resumed tokens too: the engine appends them to the sequence as if it had sampled them.
        tokens = itertools.chain(request.prompt_token_ids, request.resume_token_ids)
        bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


class Engine(Protocol):
    async def start(self) -> None:
        """Called once before the first request; returns when the engine is ready."""

    async def shutdown(self) -> None:
        """Called once at exit, after in-flight requests ended or were aborted."""

    def check(self, request: EngineRequest) -> None:
        """Raise `RequestRejected` (with a message for the client) if `request` can never run."""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Run `request`; yields outputs until one carries a finish reason.

        With `request.kv_ref` set the engine first pulls the prompt's KV from
        the source node; a pull that fails raises `KvPullFailed` before any
        output. Closing the iterator early (client gone, deadline) aborts the
        request inside the engine and frees its KV blocks.
        """

    async def prefill(self, request: EngineRequest, source_worker_id: str, hold_s: float) -> KvRef:
        """Run the prompt (plus `resume_token_ids`) and hold its KV for a decode node to pull.

        The blocks stay held until `release_kv`, which the worker calls when
        the decode node is done with them or `hold_s` has passed (`KvHolds`);
        the returned reference expires then. An engine may also bound the
        hold itself (vLLM's lease).
        Cancelling the call aborts the prefill and frees what it held.
        """

    def release_kv(self, request_id: str) -> None:
        """Free the KV held for `request_id` (idempotent; unknown ids are ignored)."""

    def drain_kv_events(self) -> KvCacheDelta:
        """Prefix-cache changes since the previous call, as kvlane block hashes."""

    def stats(self) -> EngineStats:
        """A snapshot for the heartbeat; throughputs are measured since the previous call."""

    @property
    def errored(self) -> bool:
        """Whether the engine died (it then fails every request, running or new, and never recovers)."""


@runtime_checkable
class PushesOutputs(Protocol):
    """An engine that can hand each output to a callback as it produces it.

    Streaming through `Engine.generate` wakes one reader per running request
    at every engine step; here the engine calls `on_output` itself, at once,
    and the caller wakes only when the request has ended.
    """

    async def stream(self, request: EngineRequest, on_output: Callable[[EngineOutput], None]) -> None:
        """Run `request` (without a `kv_ref`), calling `on_output` for every output; return after the last.

        `on_output` runs inside the engine's own output loop: it must not
        block, and what it raises ends the request (it is raised here).
        Raises as `generate` does (`RequestRejected`, engine errors).
        Cancelling the call aborts the request inside the engine and frees
        its KV blocks.
        """
