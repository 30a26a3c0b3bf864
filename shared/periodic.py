"""Housekeeping that runs every so often until its service stops.

Stopping sets a flag as well as cancelling the task, because cancellation
alone is not enough: redis-py's asyncio client can swallow a CancelledError
that lands mid-command, and a loop that only waits to be cancelled then runs
for ever and its service never exits. With the flag, such a loop ends after
the step it was in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("kvlane.periodic")


class Periodic:
    """Run `step` every `interval_s` (start to start), first after one interval or, with `immediately`, at once.

    A step that raises is logged and the next one runs on time: housekeeping
    must outlive any one bad step.
    """

    def __init__(self, name: str, interval_s: float, step: Callable[[], Awaitable[object]], *, immediately: bool = False) -> None:
        self.name = name
        self._interval_s = interval_s
        self._step = step
        self._immediately = immediately
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        if not self._immediately:
            await self._pause(self._interval_s)
        while not self._stopping.is_set():
            started = loop.time()
            try:
                await self._step()
            except Exception:
                log.exception("periodic_step_failed", task=self.name)
            await self._pause(self._interval_s - (loop.time() - started))

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, unless told to stop already (a stop during the sleep cancels it).

        A plain sleep, not a wait for the stop flag with a timeout: that costs a task per pause,
        which a process hosting hundreds of nodes (each with its 20 Hz KV-event batches) feels.
        """
        if not self._stopping.is_set():
            await asyncio.sleep(max(0.0, seconds))
