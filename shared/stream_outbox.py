"""Streamed frames batched per engine step and per receiver.

An engine step wakes every running request at once; each request's task
hands its frame to the outbox and goes on. Once those tasks have run, the
outbox publishes one `StreamBatch` per receiving process instead of one
message per frame, so the message rate follows the engine's step rate, not
its token rate. Frames of one stream keep their order.
"""

from __future__ import annotations

import structlog

from contracts.messages import AddressedFrame, StreamBatch, StreamFrame
from shared.bus import Bus
from shared.coalescer import Coalescer

log = structlog.get_logger("kvlane.bus")


class StreamOutbox:
    def __init__(self, bus: Bus, max_frames: int = 1024) -> None:
        self._bus = bus
        # Bounds one message's size (NATS refuses payloads above its max_payload, 1 MiB by default).
        self._max_frames = max_frames
        # No lingering: a step's frames are all put within one iteration (each request's task, woken by the
        # step, puts its own; vLLM's output handler puts them all in one go), so waiting one more only delays them.
        self._frames: Coalescer[tuple[str, StreamFrame]] = Coalescer("stream-outbox", self._publish, linger=False)

    def put(self, stream_to: str, frame: StreamFrame) -> None:
        """Queue `frame` for the stream subject `stream_to`; it leaves within one loop iteration."""
        self._frames.put((stream_to, frame))

    async def _publish(self, frames: list[tuple[str, StreamFrame]]) -> None:
        by_receiver: dict[str, list[AddressedFrame]] = {}
        for stream_to, frame in frames:
            receiver, _, stream = stream_to.rpartition(".")
            by_receiver.setdefault(receiver, []).append(AddressedFrame(stream, frame))
        for receiver, addressed in by_receiver.items():
            for start in range(0, len(addressed), self._max_frames):
                batch = StreamBatch(addressed[start : start + self._max_frames])
                try:
                    # The receiver's wildcard subscription takes it; the frames say their streams.
                    await self._bus.publish(f"{receiver}.batch", batch, traced=False)
                except Exception as exc:  # NATS down: the receivers' stall checks resume the streams
                    log.warning("stream_batch_lost", receiver=receiver, frames=len(batch.frames), error=str(exc))

    async def close(self) -> None:
        """Publish what is queued and stop."""
        await self._frames.close()
