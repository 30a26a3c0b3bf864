"""Pre-warming hot prefixes onto more nodes (pure core, no I/O).

Prefixes that many requests share (system prompts) pull traffic to the
nodes that cache them; when those nodes are busy, affinity piles requests
onto them. The tracker counts each prefix's requests in a sliding window;
`plan_prewarms` picks, for every hot prefix whose holders are all loaded,
one lightly loaded node without it, to be filled by a prefill-only request
while load there is low.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping

from msgspec import Struct


class HotPrefix(Struct, frozen=True):
    key: int
    block_hashes: tuple[int, ...]
    token_ids: tuple[int, ...]
    hits: int


class _Seen:
    __slots__ = ("block_hashes", "token_ids", "times")

    def __init__(self, block_hashes: tuple[int, ...], token_ids: tuple[int, ...]) -> None:
        self.block_hashes = block_hashes
        self.token_ids = token_ids
        self.times: deque[float] = deque()


class HotPrefixTracker:
    def __init__(self, window_s: float, min_hits: int, max_prefixes: int = 4096) -> None:
        self._window_s = window_s
        self._min_hits = min_hits
        self._max_prefixes = max_prefixes
        self._seen: OrderedDict[int, _Seen] = OrderedDict()

    def observe(self, block_hashes: tuple[int, ...], token_ids: tuple[int, ...], now: float) -> None:
        """Count one request whose prompt starts with these full blocks."""
        if not block_hashes or not token_ids:
            return
        key = block_hashes[-1]  # chained: the last hash names the whole prefix
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = _Seen(block_hashes, token_ids)
            if len(self._seen) > self._max_prefixes:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(key)
        seen.times.append(now)

    def hot(self, now: float) -> list[HotPrefix]:
        hot = []
        for key in list(self._seen):
            seen = self._seen[key]
            while seen.times and now - seen.times[0] > self._window_s:
                seen.times.popleft()
            if not seen.times:
                del self._seen[key]
            elif len(seen.times) >= self._min_hits:
                hot.append(HotPrefix(key, seen.block_hashes, seen.token_ids, len(seen.times)))
        return hot


class Prewarm(Struct, frozen=True):
    prefix: HotPrefix
    target: str


def plan_prewarms(
    hot: list[HotPrefix],
    matches: Mapping[int, Mapping[str, int]],
    loads: Mapping[str, float],
    high_load: float,
    low_load: float,
    in_progress: set[tuple[int, str]],
) -> list[Prewarm]:
    """One pre-warm per hot prefix whose every holder is busy, onto the idlest node that lacks it.

    `matches[key]` is the prefix index's answer for that prefix's blocks;
    a node holds the prefix when it matches all of them.
    """
    plans = []
    planned = set(in_progress)
    for prefix in sorted(hot, key=lambda p: -p.hits):
        depth = len(prefix.block_hashes)
        holders = {n for n, m in matches.get(prefix.key, {}).items() if m >= depth and n in loads}
        if not holders or any(loads[h] <= high_load for h in holders):
            continue
        idle = [n for n, load in loads.items() if n not in holders and load < low_load and (prefix.key, n) not in planned]
        if idle:
            target = min(idle, key=lambda n: (loads[n], n))
            plans.append(Prewarm(prefix, target))
            planned.add((prefix.key, target))
    return plans
