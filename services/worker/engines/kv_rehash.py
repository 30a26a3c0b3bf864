"""Translating vLLM's KV-cache events into kvlane block hashes (pure).

vLLM names a cached block by its own hash (sha256-derived, salted per
process), which no other kvlane service can compute. kvlane names it by the
chained hash of `shared/kv/block_hash.py`, which ingress computes from the
prompt. An event only carries the tokens of the blocks it stores and the
vLLM hash of their parent, so the chain is continued through a map from
vLLM hash to kvlane hash, kept for every block the engine holds:

* `BlockStored(block_hashes, parent_block_hash, token_ids)`: the first
  block's kvlane parent is the map's entry for `parent_block_hash` (the
  root when that is None: the LoRA adapter's for an adapter's block);
  each block then chains on the previous one.
  A parent the map does not know (stored before this subscriber connected,
  or already evicted) cannot be continued: those blocks are skipped, since
  a guessed hash would advertise a prefix the node does not hold.
* `BlockRemoved(block_hashes)` maps back through the same map and forgets
  the entries, which keeps the map as large as the engine's cache.
* `AllBlocksCleared` forgets everything.

The output is an ordered list of (stored?, kvlane hash) pairs for
`net_kv_delta`, plus whether the cache was cleared.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from shared.kv.block_hash import adapter_root, chained_block_hashes


class KvEventRehasher:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._kvlane_hash: dict[Hashable, int] = {}
        self._events: list[tuple[bool, int]] = []
        self._cleared = False
        self.skipped_blocks = 0

    def __len__(self) -> int:
        return len(self._kvlane_hash)

    def stored(
        self,
        block_hashes: Sequence[Hashable],
        parent_block_hash: Hashable | None,
        token_ids: Sequence[int],
        block_size: int,
        adapter: str | None = None,
    ) -> None:
        if block_size != self.block_size or len(token_ids) != len(block_hashes) * block_size:
            # A different block geometry (another KV-cache group) is not a
            # prefix kvlane can name; counting it keeps the loss visible.
            self.skipped_blocks += len(block_hashes)
            return
        if parent_block_hash is None:
            parent = None if adapter is None else adapter_root(adapter)
        else:
            parent = self._kvlane_hash.get(parent_block_hash)
            if parent is None:
                self.skipped_blocks += len(block_hashes)
                return
        kvlane_hashes = chained_block_hashes(token_ids, block_size, parent)
        for vllm_hash, kvlane_hash in zip(block_hashes, kvlane_hashes, strict=True):
            self._kvlane_hash[vllm_hash] = kvlane_hash
            self._events.append((True, kvlane_hash))

    def removed(self, block_hashes: Sequence[Hashable]) -> None:
        for vllm_hash in block_hashes:
            kvlane_hash = self._kvlane_hash.pop(vllm_hash, None)
            if kvlane_hash is not None:
                self._events.append((False, kvlane_hash))

    def all_cleared(self) -> None:
        self._kvlane_hash.clear()
        # Whatever happened before the clear no longer matters to a reader.
        self._events.clear()
        self._cleared = True

    def drain(self) -> tuple[list[tuple[bool, int]], bool]:
        """Events since the previous drain, in order, and whether the cache was cleared first."""
        events, cleared = self._events, self._cleared
        self._events, self._cleared = [], False
        return events, cleared
