"""KV hand-off between a prefill node and a decode node, over NATS.

Only references travel here; the bytes move engine to engine (NIXL for
vLLM, a modelled link for the sim engine).

* `KvHolds` (prefill side) remembers which prompts' KV this node holds and
  answers decode nodes on `subjects.worker_kv`: a `KvPull` is granted while
  the KV is held; a `KvRelease` frees it. Unreleased KV is freed when its
  hold time ends, so a decode node that died strands nothing.
* `KvPuller` (decode side) asks the source before the engine transfers:
  a source that is gone fails the pull at once (no responders) instead of
  after the engine's own transfer timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog
from nats.aio.msg import Msg

from contracts import subjects
from contracts.messages import ErrorReply, KvMessage, KvPull, KvPullGranted, KvPullReply, KvRef, KvRelease
from services.worker.engines.base import KvPullFailed
from shared.bus import Bus, BusError

log = structlog.get_logger("kvlane.worker.handoff")


class KvHolds:
    """The KV references this (prefill) node holds, each until released or expired."""

    def __init__(self, bus: Bus, worker_id: str, release: Callable[[str], None]) -> None:
        self._bus = bus
        self._worker_id = worker_id
        self._release = release
        self._held: dict[str, tuple[KvRef, asyncio.TimerHandle]] = {}

    async def start(self) -> None:
        await self._bus.subscribe(subjects.worker_kv(self._worker_id), KvMessage, self._on_message)

    def hold(self, request_id: str, ref: KvRef) -> None:
        """Remember `ref` (the engine holds its blocks already) until released or expired.

        Keyed by kvlane's request id: an engine may name the request its own
        way in `ref.request_id` (vLLM adds a suffix).
        """
        previous = self._held.pop(request_id, None)
        if previous is not None:
            previous[1].cancel()
        timer = asyncio.get_running_loop().call_later(ref.hold_s, self._expire, request_id)
        self._held[request_id] = (ref, timer)

    def time_left(self, request_id: str) -> float:
        """Seconds until the hold on `request_id`'s KV ends (0 if none is held)."""
        entry = self._held.get(request_id)
        if entry is None:
            return 0.0
        timer = entry[1]
        return max(0.0, timer.when() - asyncio.get_running_loop().time())

    def release(self, request_id: str) -> None:
        entry = self._held.pop(request_id, None)
        if entry is not None:
            entry[1].cancel()
        self._release(request_id)

    def release_all(self) -> None:
        for request_id in list(self._held):
            self.release(request_id)

    def _expire(self, request_id: str) -> None:
        if request_id in self._held:
            log.warning("kv_hold_expired", request_id=request_id)
            self.release(request_id)

    async def _on_message(self, message: KvMessage, msg: Msg) -> KvPullReply | None:
        match message:
            case KvPull(request_id=request_id):
                entry = self._held.get(request_id)
                if entry is None:
                    return ErrorReply(code="kv_not_held", message=f"no KV held for request {request_id}", status=404)
                ref = entry[0]
                return KvPullGranted(request_id=request_id, num_tokens=ref.num_tokens, kv_bytes=ref.kv_bytes)
            case KvRelease(request_id=request_id):
                self.release(request_id)
                return None


class KvPuller:
    """The decode side of a hand-off: confirm with the source, release when done."""

    def __init__(self, bus: Bus, worker_id: str, timeout_s: float) -> None:
        self._bus = bus
        self._worker_id = worker_id
        self._timeout_s = timeout_s

    async def pull(self, request_id: str, ref: KvRef, held_until: float | None) -> None:
        """Raise `KvPullFailed` unless the source still holds `request_id`'s KV for us.

        `held_until`: when the source's hold ends, on `time.monotonic`'s clock (None: not known here).
        """
        if held_until is not None and held_until <= time.monotonic():
            raise KvPullFailed(f"KV of {request_id} on {ref.source_worker_id} expired")
        subject = subjects.worker_kv(ref.source_worker_id)
        try:
            reply = await self._bus.request(subject, KvPull(request_id, self._worker_id), KvPullReply, self._timeout_s)
        except BusError as exc:
            raise KvPullFailed(f"source {ref.source_worker_id} unreachable: {exc}") from exc
        if isinstance(reply, ErrorReply):
            raise KvPullFailed(f"source {ref.source_worker_id}: {reply.message}")

    async def release(self, request_id: str, ref: KvRef) -> None:
        with contextlib.suppress(Exception):
            await self._bus.publish(subjects.worker_kv(ref.source_worker_id), KvRelease(request_id), traced=False)
