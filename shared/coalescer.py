"""Items put one at a time, handled a batch at a time.

A burst of events (an engine step's frames, the `RequestFinished` of many
requests) arrives as many callbacks within one loop iteration. Each puts
its item and goes on; one loop iteration later the coalescer hands all of
them to `flush` at once: one message or one Redis pipeline instead of one
per item. Items put while a flush is under way wait for the next one, so
under load batches grow instead of round trips queueing up.

Without `linger` the batch leaves one iteration sooner: right after the
callbacks that were ready together with the first put, for bursts that are
put within one iteration (an engine step's frames), where the extra
iteration only delays every item.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import structlog

T = TypeVar("T")

log = structlog.get_logger("kvlane.coalescer")


class Coalescer(Generic[T]):
    def __init__(self, name: str, flush: Callable[[list[T]], Awaitable[None]], *, linger: bool = True) -> None:
        self._name = name
        self._flush = flush
        self._linger = linger
        self._items: list[T] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False

    def put(self, item: T) -> None:
        self._items.append(item)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)
        self._wake.set()

    async def _run(self) -> None:
        while not self._closed:
            await self._wake.wait()
            if self._linger:
                # The other callbacks of this burst are ready to run: let them put their items first.
                await asyncio.sleep(0)
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Hand everything put so far to `flush` (a failure is logged: the items are gone)."""
        if not self._items:
            return
        items, self._items = self._items, []
        try:
            await self._flush(items)
        except Exception:
            log.exception("batch_flush_failed", coalescer=self._name, items=len(items))

    async def close(self) -> None:
        """Flush what is left and stop (not cancelled: a batch being flushed would be lost)."""
        self._closed = True
        if self._task is not None:
            self._wake.set()
            await self._task
        await self.flush()
