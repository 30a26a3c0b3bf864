"""Streamed frames batched per engine step and per receiver.

An engine step wakes every running request at once; each request's task
hands its frame to the outbox and goes on. Once those tasks have run (one
loop iteration later), the outbox publishes one `StreamBatch` per receiving
process instead of one message per frame. Under load, frames that arrive
while a publish is under way join the next batch, so the message rate
follows the engine's step rate, not its token rate.
"""

from __future__ import annotations

import asyncio

import structlog

from contracts.messages import AddressedFrame, StreamBatch, StreamFrame
from shared.bus import Bus

log = structlog.get_logger("kvlane.bus")


class StreamOutbox:
    def __init__(self, bus: Bus, max_frames: int = 1024) -> None:
        self._bus = bus
        # Bounds one message's size (NATS refuses payloads above its max_payload, 1 MiB by default).
        self._max_frames = max_frames
        self._pending: dict[str, list[AddressedFrame]] = {}
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task | None = None
        self._closed = False

    def put(self, stream_to: str, frame: StreamFrame) -> None:
        """Queue `frame` for the stream subject `stream_to`; it leaves within one loop iteration."""
        receiver, _, stream = stream_to.rpartition(".")
        self._pending.setdefault(receiver, []).append(AddressedFrame(stream, frame))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._run(), name="stream-outbox")
        self._wake.set()

    async def _run(self) -> None:
        while not self._closed:
            await self._wake.wait()
            # The other requests of this engine step are ready to run: let them add their frames.
            await asyncio.sleep(0)
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Publish everything queued so far."""
        pending, self._pending = self._pending, {}
        for receiver, frames in pending.items():
            for start in range(0, len(frames), self._max_frames):
                batch = StreamBatch(frames[start : start + self._max_frames])
                try:
                    # The receiver's wildcard subscription takes it; the frames say their streams.
                    await self._bus.publish(f"{receiver}.batch" if receiver else "batch", batch, traced=False)
                except Exception as exc:  # NATS down: the receivers' stall checks resume the streams
                    log.warning("stream_batch_lost", receiver=receiver, frames=len(batch.frames), error=str(exc))

    async def close(self) -> None:
        """Publish what is queued and stop (not cancelled: a batch it is publishing would be lost)."""
        self._closed = True
        if self._flusher is not None:
            self._wake.set()
            await self._flusher
        await self.flush()
