"""Which requests hold a slot on which chain (pure, no I/O).

A slot is held from the route decision until the request's
`RequestFinished`, a re-route of the same request id, its deadline, or its
chain leaving the cluster, whichever comes first, so nothing can leak for
ever. With several balancer replicas the global count lives in Redis
(`slot_store.RedisSlotStore`); this table then holds this replica's own
reservations plus the last known count of everyone else's ("foreign"), so
policies see usage without a Redis round trip per chain.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable


class SlotTable:
    def __init__(self) -> None:
        self._holders: dict[str, tuple[str, float]] = {}
        # A plain dict, not a Counter: Counter's `del` is Python code, and it runs on every release.
        self._own: dict[str, int] = {}
        self._foreign: dict[str, int] = {}
        self._expiry: list[tuple[float, str]] = []
        # Chains whose count changed since the last `take_changed`: the chain index refreshes only those.
        self._changed: set[str] = set()
        # Told of every request whose slot is freed, however it was (its end, a re-route, its deadline, its node leaving).
        self.on_release: Callable[[str], None] | None = None

    def take_changed(self) -> set[str]:
        """Chains whose used count may have changed since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def used(self, chain_id: str) -> int:
        return self._own.get(chain_id, 0) + self._foreign.get(chain_id, 0)

    def own(self, chain_id: str) -> int:
        return self._own.get(chain_id, 0)

    def holder(self, request_id: str) -> str | None:
        entry = self._holders.get(request_id)
        return entry[0] if entry else None

    def reserve(self, request_id: str, chain_id: str, slots: int, expires_at: float) -> bool:
        """Take a slot unless the chain is full; any slot `request_id` held before is released either way."""
        self.release(request_id)
        if self.used(chain_id) >= slots:
            return False
        self._holders[request_id] = (chain_id, expires_at)
        self._own[chain_id] = self._own.get(chain_id, 0) + 1
        self._changed.add(chain_id)
        heapq.heappush(self._expiry, (expires_at, request_id))
        return True

    def release(self, request_id: str, worker_id: str | None = None) -> str | None:
        """Free `request_id`'s slot; returns its chain, or None if it held none (releases are idempotent).

        With `worker_id`, only a slot on that worker's chain is freed: the
        late end of an attempt that was resumed elsewhere must not free the
        slot the resumed attempt holds.
        """
        entry = self._holders.get(request_id)
        if entry is None or (worker_id is not None and not entry[0].startswith(f"{worker_id}@")):
            return None
        del self._holders[request_id]
        chain_id = entry[0]
        self._changed.add(chain_id)
        own = self._own[chain_id] - 1
        if own > 0:
            self._own[chain_id] = own
        else:
            del self._own[chain_id]
        if self.on_release is not None:
            self.on_release(request_id)
        return chain_id

    def expire(self, now: float) -> list[str]:
        """Release every reservation whose deadline is at or before `now`; returns their request ids."""
        expired = []
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, request_id = heapq.heappop(self._expiry)
            entry = self._holders.get(request_id)
            if entry is not None and entry[1] == expires_at:
                self.release(request_id)
                expired.append(request_id)
        return expired

    def set_global_used(self, chain_id: str, total: int) -> None:
        """Record the authoritative count for the chain (all replicas); the rest is someone else's."""
        foreign = max(0, total - self._own.get(chain_id, 0))
        self._changed.add(chain_id)
        if foreign:
            self._foreign[chain_id] = foreign
        else:
            self._foreign.pop(chain_id, None)

    def retain_chains(self, live: Iterable[str]) -> list[str]:
        """Drop reservations and counts of chains not in `live` (their node left); returns released request ids."""
        live = set(live)
        released = [r for r, (chain_id, _) in self._holders.items() if chain_id not in live]
        for request_id in released:
            self.release(request_id)
        for chain_id in [c for c in self._foreign if c not in live]:
            del self._foreign[chain_id]
            self._changed.add(chain_id)
        return released

    def held(self) -> list[tuple[str, str, float]]:
        """(request id, chain id, expires at) of every reservation this process holds."""
        return [(r, chain_id, expires_at) for r, (chain_id, expires_at) in self._holders.items()]

    def chains(self) -> set[str]:
        return set(self._own) | set(self._foreign)

    def total_used(self) -> int:
        return sum(self._own.values()) + sum(self._foreign.values())

    def __len__(self) -> int:
        """Reservations this process holds."""
        return len(self._holders)
