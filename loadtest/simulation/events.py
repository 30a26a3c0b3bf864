"""A discrete-event clock (pure): callbacks run in time order, ties in the order they were scheduled."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self.processed = 0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, when: float, callback: Callable[..., Any], *args: Any) -> None:
        """Run `callback(*args)` at virtual time `when` (never before now)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), callback, args))

    def after(self, delay: float, callback: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, callback, *args)

    def run(self, until: float = float("inf"), done: Callable[[], bool] = lambda: False,
            after_each: Callable[[], None] | None = None) -> None:
        """Run events up to virtual time `until`, until `done()` holds, or until none are left."""
        heap = self._heap
        while heap and heap[0][0] <= until and not done():
            when, _, callback, args = heapq.heappop(heap)
            self.now = when
            callback(*args)
            self.processed += 1
            if after_each is not None:
                after_each()
