"""Requests a balancer routed and has not yet seen finish, per worker.

Finished events can be lost (a worker killed mid-request, a NATS restart):
each entry therefore also expires at its request's deadline, so a count
can never stay inflated for ever.
"""

from __future__ import annotations

import heapq
from collections import Counter


class OutstandingRequests:
    def __init__(self) -> None:
        self._by_request: dict[str, tuple[str, float]] = {}
        self._per_worker: Counter[str] = Counter()
        self._expiry: list[tuple[float, str]] = []

    def add(self, request_id: str, worker_id: str, deadline: float) -> None:
        self.finish(request_id)
        self._by_request[request_id] = (worker_id, deadline)
        self._per_worker[worker_id] += 1
        heapq.heappush(self._expiry, (deadline, request_id))

    def finish(self, request_id: str) -> None:
        entry = self._by_request.pop(request_id, None)
        if entry is not None:
            self._per_worker[entry[0]] -= 1
            if self._per_worker[entry[0]] <= 0:
                del self._per_worker[entry[0]]

    def expire(self, now: float) -> int:
        """Drop entries whose deadline passed; returns how many were still open."""
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            deadline, request_id = heapq.heappop(self._expiry)
            entry = self._by_request.get(request_id)
            if entry is not None and entry[1] == deadline:
                self.finish(request_id)
                dropped += 1
        return dropped

    def forget_worker(self, worker_id: str) -> None:
        for request_id in [r for r, (w, _) in self._by_request.items() if w == worker_id]:
            self.finish(request_id)

    def count(self, worker_id: str) -> int:
        return self._per_worker.get(worker_id, 0)

    def __len__(self) -> int:
        return len(self._by_request)
