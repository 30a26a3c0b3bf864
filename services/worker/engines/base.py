"""The interface every worker engine implements (sim today, vLLM next)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from msgspec import Struct

from contracts.messages import EngineStats, FinishReason, SamplingParams


class EngineRequest(Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


class EngineOutput(Struct):
    """What one engine step produced for one request."""

    token_ids: list[int]
    text: str
    # Set on the last output of a request, None before.
    finish_reason: FinishReason | None = None
    # Prompt tokens served from the prefix cache; known from the first output on.
    cached_tokens: int = 0


class RequestRejected(ValueError):
    """The engine can never run this request (too long, bad token ids...)."""


class Engine(Protocol):
    async def start(self) -> None:
        """Called once before the first request; returns when the engine is ready."""

    async def shutdown(self) -> None:
        """Called once at exit, after in-flight requests ended or were aborted."""

    def check(self, request: EngineRequest) -> None:
        """Raise `RequestRejected` (with a message for the client) if `request` can never run."""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Run `request`; yields outputs until one carries a finish reason.

        Closing the iterator early (client gone, deadline) aborts the
        request inside the engine and frees its KV blocks.
        """

    def stats(self) -> EngineStats:
        """A snapshot for the heartbeat; throughputs are measured since the previous call."""
