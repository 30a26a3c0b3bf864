"""Which node holds which prefix blocks (pure core, no I/O).

Fed by workers' `KvEvents` (what entered and left each prefix cache), it
answers `match(block_hashes)`: per node, how many LEADING blocks of a
prompt that node holds. Block hashes are chained, so holding block k means
holding the whole prefix up to k; a node that holds block k but not k-1
(partly evicted) counts only up to its first missing block.

Memory is bounded: at most `max_blocks` distinct hashes are kept; past
that the least recently stored or matched hash is forgotten for every node
(the index then under-reports, which costs a cache hit, never correctness).
Each entry costs one dict slot plus a small set of node ids: measured about
330 bytes per block (~330 MB per million blocks) with 1-3 nodes per hash in
CPython 3.11 (`python -m benchmarks.cache_manager_bench`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self._max_blocks = max_blocks
        self._holders: OrderedDict[int, set[str]] = OrderedDict()
        self._per_node: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def blocks_on(self, node: str) -> int:
        return self._per_node.get(node, 0)

    def nodes(self) -> list[str]:
        return sorted(self._per_node)

    def apply(self, node: str, stored: Iterable[int] = (), removed: Iterable[int] = (), cleared: bool = False) -> None:
        if cleared:
            self.remove_node(node)
        for block_hash in removed:
            holders = self._holders.get(block_hash)
            if holders is not None and node in holders:
                self._drop(block_hash, holders, node)
        for block_hash in stored:
            holders = self._holders.get(block_hash)
            if holders is None:
                holders = self._holders[block_hash] = set()
            else:
                self._holders.move_to_end(block_hash)
            if node not in holders:
                holders.add(node)
                self._per_node[node] = self._per_node.get(node, 0) + 1
        while len(self._holders) > self._max_blocks:
            _, holders = self._holders.popitem(last=False)
            for holder in holders:
                self._count_down(holder)

    def remove_node(self, node: str) -> None:
        if node not in self._per_node:
            return
        for block_hash in [h for h, holders in self._holders.items() if node in holders]:
            self._drop(block_hash, self._holders[block_hash], node)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per node, the number of leading `block_hashes` it holds (nodes with 0 omitted)."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        reached = 0  # leading blocks every node still in `alive` holds
        for depth, block_hash in enumerate(block_hashes):
            holders = self._holders.get(block_hash)
            if not holders:
                break
            self._holders.move_to_end(block_hash)
            if alive is None:
                alive = set(holders)
                matched = dict.fromkeys(alive, 1)
            elif not alive <= holders:
                # A node is written only when it drops out (and at the end): long shared prefixes cost no per-node work per block.
                for node in alive - holders:
                    matched[node] = depth
                alive &= holders
                if not alive:
                    break
            reached = depth + 1
        for node in alive or ():
            matched[node] = reached
        return matched

    def _drop(self, block_hash: int, holders: set[str], node: str) -> None:
        holders.discard(node)
        if not holders:
            del self._holders[block_hash]
        self._count_down(node)

    def _count_down(self, node: str) -> None:
        left = self._per_node.get(node, 0) - 1
        if left > 0:
            self._per_node[node] = left
        else:
            self._per_node.pop(node, None)
