"""The autoscaler's `RequestServed` events, published a batch at a time.

One event per request answered. Published as each request ends, every event
cost a task and a socket write of its own; gathered for `interval_s`, a
batch goes out in one write. The autoscaler's statistics span tens of
seconds: an event that arrives `interval_s` later changes nothing there.
"""

from __future__ import annotations

import asyncio
import contextlib

from contracts import subjects
from contracts.autoscaler import RequestServed
from shared.bus import Bus


class ServedEvents:
    def __init__(self, bus: Bus, interval_s: float = 0.05) -> None:
        self._bus = bus
        self._interval_s = interval_s
        self._pending: list[RequestServed] = []
        self._due: asyncio.TimerHandle | None = None

    def add(self, served: RequestServed) -> None:
        self._pending.append(served)
        if self._due is None:
            self._due = asyncio.get_running_loop().call_later(self._interval_s, self._send)

    def _send(self) -> None:
        self._due = None
        batch, self._pending = self._pending, []
        if batch:
            self._bus.spawn(self._publish(batch))

    async def _publish(self, batch: list[RequestServed]) -> None:
        # One lost while NATS reconnects costs nothing more than a sample of a statistic.
        with contextlib.suppress(Exception):
            for served in batch:  # nats-py queues each; its flusher writes them all at once
                await self._bus.publish(subjects.REQUEST_SERVED, served, traced=False)

    async def close(self) -> None:
        """Send what is waiting now (before the bus closes, which flushes it)."""
        if self._due is not None:
            self._due.cancel()
            self._due = None
        batch, self._pending = self._pending, []
        await self._publish(batch)
