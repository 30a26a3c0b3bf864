"""The central wait queue (pure): one FIFO per priority class, bounded, with deadlines.

A request waits here only when no suitable chain has a free slot. Higher
`priority` classes are served first; within a class, arrival order, or with
tenants' shares (`fair_share.TenantShares`) the least-served tenant's oldest
request first. A request taken out for a placement that then fails (another
replica won the slot) is put back at its original place.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterator

from msgspec import Struct

from contracts.messages import RouteRequest
from services.balancer.fair_share import TenantShares


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
        self._per_tenant: Counter[str] = Counter()
        self._class_tenants: dict[int, Counter[str]] = {}

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
        self._count(request, 1)
        return entry

    def restore(self, entry: QueuedRequest) -> None:
        """Put back an entry taken out by `remove`, at its original place (even if the queue is full)."""
        if entry.request_id in self._by_id:
            return
        bisect.insort(self._classes.setdefault(entry.request.priority, []), entry, key=lambda e: e.seq)
        self._by_id[entry.request_id] = entry
        self._count(entry.request, 1)

    def remove(self, request_id: str) -> QueuedRequest | None:
        entry = self._by_id.pop(request_id, None)
        if entry is not None:
            entries = self._classes[entry.request.priority]
            entries.pop(bisect.bisect_left(entries, entry.seq, key=lambda e: e.seq))
            if not entries:
                del self._classes[entry.request.priority]
            self._count(entry.request, -1)
        return entry

    def _count(self, request: RouteRequest, change: int) -> None:
        tenant = request.tenant
        for counts in (self._per_tenant, self._class_tenants.setdefault(request.priority, Counter())):
            counts[tenant] += change
            if not counts[tenant]:
                del counts[tenant]
        if not self._class_tenants[request.priority]:
            del self._class_tenants[request.priority]

    def in_order(self, shares: TenantShares | None = None) -> Iterator[QueuedRequest]:
        """Every waiting request, highest class first; within a class oldest first, or in the order `shares`
        serves tenants in (a snapshot: safe to remove while iterating)."""
        for priority in sorted(self._classes, reverse=True):
            entries = list(self._classes[priority])
            if shares is not None and len(entries) > 1:
                entries = [entries[i] for i in shares.order([e.request for e in entries])]
            yield from entries

    def waiting_per_tenant(self) -> Counter[str]:
        """Requests waiting per tenant, every class together."""
        return self._per_tenant

    def expire(self, now: float) -> list[QueuedRequest]:
        expired = [e for e in self._by_id.values() if e.deadline <= now]
        for entry in expired:
            self.remove(entry.request_id)
        return expired

    def ahead_of(self, priority: int, tenant: str | None = None) -> int:
        """Requests served before one of `priority` queued now: all of higher classes, and of its own class all, or
        with `tenant` (tenants served in turn) of each tenant as many as `tenant`'s own already waiting, plus one."""
        ahead = sum(length for cls, length in self.lengths().items() if cls > priority)
        counts = self._class_tenants.get(priority)
        if not counts:
            return ahead
        if tenant is None:
            return ahead + sum(counts.values())
        turns = counts.get(tenant, 0) + 1
        return ahead + sum(min(count, turns) for count in counts.values())

    def newest_of_tenant(self, tenant: str, priority: int) -> QueuedRequest | None:
        """The newest waiting request of `tenant` in `priority`'s class."""
        for entry in reversed(self._classes.get(priority, ())):
            if entry.request.tenant == tenant:
                return entry
        return None

    def tenants_of(self, priority: int) -> Counter[str]:
        """Requests waiting per tenant in one class."""
        return self._class_tenants.get(priority, Counter())

    def newest_of(self, priority: int) -> QueuedRequest | None:
        entries = self._classes.get(priority)
        return entries[-1] if entries else None

    def lengths(self) -> dict[int, int]:
        """Waiting requests per priority class."""
        return {priority: len(entries) for priority, entries in self._classes.items()}

    def oldest_enqueued_at(self) -> float | None:
        return min((e.enqueued_at for e in self._by_id.values()), default=None)
