"""The central wait queue (pure): one FIFO per priority class, bounded, with deadlines.

A request waits here only when no suitable chain has a free slot. Higher
`priority` classes are served first; within a class, arrival order. A
request taken out for a placement that then fails (another replica won the
slot) is put back at its original place.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from msgspec import Struct

from contracts.messages import RouteRequest


class QueuedRequest(Struct, frozen=True):
    request: RouteRequest
    seq: int
    enqueued_at: float
    deadline: float  # when waiting ends with a 503: the request's deadline or the queue's limit

    @property
    def request_id(self) -> str:
        return self.request.request_id


class CentralQueue:
    def __init__(self, max_length: int) -> None:
        self._max_length = max_length
        self._classes: dict[int, list[QueuedRequest]] = {}
        self._by_id: dict[str, QueuedRequest] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    @property
    def full(self) -> bool:
        return len(self._by_id) >= self._max_length

    def push(self, request: RouteRequest, now: float, deadline: float) -> QueuedRequest | None:
        """Queue at the back of its class; None when the queue is full or the id already waits."""
        if self.full or request.request_id in self._by_id:
            return None
        entry = QueuedRequest(request, next(self._seq), now, deadline)
        self._classes.setdefault(request.priority, []).append(entry)
        self._by_id[request.request_id] = entry
        return entry

    def restore(self, entry: QueuedRequest) -> None:
        """Put back an entry taken out by `remove`, at its original place (even if the queue is full)."""
        if entry.request_id in self._by_id:
            return
        bisect.insort(self._classes.setdefault(entry.request.priority, []), entry, key=lambda e: e.seq)
        self._by_id[entry.request_id] = entry

    def remove(self, request_id: str) -> QueuedRequest | None:
        entry = self._by_id.pop(request_id, None)
        if entry is not None:
            entries = self._classes[entry.request.priority]
            entries.pop(bisect.bisect_left(entries, entry.seq, key=lambda e: e.seq))
            if not entries:
                del self._classes[entry.request.priority]
        return entry

    def in_order(self) -> Iterator[QueuedRequest]:
        """Every waiting request, highest class first, oldest first (a snapshot: safe to remove while iterating)."""
        for priority in sorted(self._classes, reverse=True):
            yield from list(self._classes[priority])

    def expire(self, now: float) -> list[QueuedRequest]:
        expired = [e for e in self._by_id.values() if e.deadline <= now]
        for entry in expired:
            self.remove(entry.request_id)
        return expired

    def newest_of(self, priority: int) -> QueuedRequest | None:
        entries = self._classes.get(priority)
        return entries[-1] if entries else None

    def lengths(self) -> dict[int, int]:
        """Waiting requests per priority class."""
        return {priority: len(entries) for priority, entries in self._classes.items()}

    def oldest_enqueued_at(self) -> float | None:
        return min((e.enqueued_at for e in self._by_id.values()), default=None)
