"""Which node holds which prefix blocks (pure core, no I/O).

Fed by workers' `KvEvents` (what entered and left each prefix cache), it
answers `match(block_hashes)`: per node, how many LEADING blocks of a
prompt that node holds. Block hashes are chained, so holding block k means
holding the whole prefix up to k; a node that holds block k but not k-1
(partly evicted) counts only up to its first missing block.

Memory is bounded: at most `max_blocks` distinct hashes are kept; past
that the least recently stored or matched hash is forgotten for every node
(the index then under-reports, which costs a cache hit, never correctness).
Each entry costs one dict slot; its set of node ids is immutable and shared
with the other blocks that have the same holders (those one KV event
stored), measured about 130 bytes per block (~125 MB per million blocks)
with 1-3 nodes per hash in CPython 3.11 (`python -m
benchmarks.cache_manager_bench`; one set per block cost 350). A matched
run of blocks with one shared set is then checked once, not once per
block (`python -m benchmarks.prefix_index_bench`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice


_MEMO_SIZE = 64  # holder sets remembered per node and direction between events


class PrefixIndex:
    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self._max_blocks = max_blocks
        # Holder sets are immutable and shared by runs of blocks with the same holders (what one KV event stores or
        # removes, a node's own blocks): `match` then checks a node set once per run, not once per block.
        self._holders: OrderedDict[int, frozenset[str]] = OrderedDict()
        self._per_node: dict[str, int] = {}
        self._only: dict[str, frozenset[str]] = {}  # per node, the holder set of the blocks only it holds
        # Per node, holder sets with and without it made lately: blocks stored or removed in separate events (one
        # per engine step) then share sets too. A pure function of immutable sets, so never stale; cleared when large.
        self._with_node: dict[str, dict[frozenset[str], frozenset[str]]] = {}
        self._without_node: dict[str, dict[frozenset[str], frozenset[str]]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def blocks_on(self, node: str) -> int:
        return self._per_node.get(node, 0)

    def nodes(self) -> list[str]:
        return sorted(self._per_node)

    def apply(self, node: str, stored: Iterable[int] = (), removed: Iterable[int] = (), cleared: bool = False) -> None:
        if cleared:
            self.remove_node(node)
        if removed:
            self._remove(node, removed)
        if stored:
            self._store(node, stored)
        holders_of = self._holders
        while len(holders_of) > self._max_blocks:
            _, holders = holders_of.popitem(last=False)
            for holder in holders:
                self._count(holder, -1)

    def remove_node(self, node: str) -> None:
        if node not in self._per_node:
            return
        without_node = self._memo(self._without_node, node)
        for block_hash, holders in [(h, holders) for h, holders in self._holders.items() if node in holders]:
            self._set_holders(block_hash, holders, without_node, node)
        del self._per_node[node]
        self._forget_memos(node)

    def match(self, block_hashes: Sequence[int], touch_blocks: bool = True) -> dict[str, int]:
        """Per node, the number of leading `block_hashes` it holds (nodes with 0 omitted).

        Touches (for the LRU bound) each leading block up to the one where
        the last node drops out, in prompt order, unless `touch_blocks` is
        False: a look that routes nothing (an operator's query) leaves the
        eviction order as routing made it.
        """
        if not block_hashes:
            return {}
        # Bound methods in locals: this loop runs once per prompt block on every routing decision.
        holders_of = self._holders.get
        touch = self._holders.move_to_end if touch_blocks else _untouched
        first_hash = block_hashes[0]
        alive = holders_of(first_hash)  # the nodes holding every block so far
        if not alive:
            return {}
        touch(first_hash)
        matched = dict.fromkeys(alive, 1)
        reached = 1  # leading blocks every node in `alive` holds
        checked = alive  # the last holder set seen to contain all of `alive`
        for block_hash in islice(block_hashes, 1, None):
            holders = holders_of(block_hash)
            if not holders:
                break
            touch(block_hash)
            if holders is not checked:
                if not alive <= holders:
                    # A node is written only when it drops out (and at the end): long shared prefixes cost no per-node work per block.
                    for node in alive - holders:
                        matched[node] = reached
                    alive &= holders
                    if not alive:
                        return matched
                checked = holders
            reached += 1
        if reached > 1:
            for node in alive:
                matched[node] = reached
        return matched

    def _store(self, node: str, stored: Iterable[int]) -> None:
        holders_of = self._holders
        only = self._only.get(node)
        if only is None:
            only = self._only[node] = frozenset((node,))
        with_node = None
        added = 0
        for block_hash in stored:
            holders = holders_of.get(block_hash)
            if holders is None:
                holders_of[block_hash] = only
                added += 1
            else:
                holders_of.move_to_end(block_hash)
                if node not in holders:
                    if with_node is None:
                        with_node = self._memo(self._with_node, node)
                    larger = with_node.get(holders)
                    if larger is None:
                        larger = with_node[holders] = holders | only
                    holders_of[block_hash] = larger  # an existing key keeps its place (just moved to the end)
                    added += 1
        if added:
            self._per_node[node] = self._per_node.get(node, 0) + added

    def _remove(self, node: str, removed: Iterable[int]) -> None:
        holders_of = self._holders
        without_node = None
        dropped = 0
        for block_hash in removed:
            holders = holders_of.get(block_hash)
            if holders is not None and node in holders:
                if without_node is None:
                    without_node = self._memo(self._without_node, node)
                self._set_holders(block_hash, holders, without_node, node)
                dropped += 1
        if dropped:
            self._count(node, -dropped)

    def _set_holders(self, block_hash: int, holders: frozenset[str], without_node: dict[frozenset[str], frozenset[str]],
                     node: str) -> None:
        """Take `node` off `block_hash`'s holders (the block is forgotten when none is left); the count is the caller's."""
        smaller = without_node.get(holders)
        if smaller is None:
            smaller = without_node[holders] = holders - {node}
        if smaller:
            self._holders[block_hash] = smaller
        else:
            del self._holders[block_hash]

    def _count(self, node: str, change: int) -> None:
        left = self._per_node.get(node, 0) + change
        if left > 0:
            self._per_node[node] = left
        else:
            self._per_node.pop(node, None)
            self._forget_memos(node)

    @staticmethod
    def _memo(memos: dict[str, dict[frozenset[str], frozenset[str]]], node: str) -> dict[frozenset[str], frozenset[str]]:
        memo = memos.get(node)
        if memo is None or len(memo) > _MEMO_SIZE:
            memo = memos[node] = {}
        return memo

    def _forget_memos(self, node: str) -> None:
        self._only.pop(node, None)
        self._with_node.pop(node, None)
        self._without_node.pop(node, None)


def _untouched(block_hash: int) -> None:
    """`match`'s touch when the LRU order is to stay as it is."""
