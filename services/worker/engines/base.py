"""The interface every worker engine implements (sim today, vLLM next)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
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

    def drain_kv_events(self) -> KvCacheDelta:
        """Prefix-cache changes since the previous call, as kvlane block hashes."""

    def stats(self) -> EngineStats:
        """A snapshot for the heartbeat; throughputs are measured since the previous call."""
