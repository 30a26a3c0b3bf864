"""Paged KV-cache memory of the sim engine, with prefix caching (vLLM v1 style).

The pool holds ``num_blocks`` blocks of ``block_size`` token slots. A
sequence owns a block table: enough blocks for its tokens, not contiguous.

Prefix caching: once a FULL block's KV has been computed it is registered
under its chained hash (``shared.kv.block_hash``), and a later sequence whose
leading block hashes match shares it instead of recomputing it (reference
counts). When its last user frees it, a hashed block stays cached: free, but
reusable until it is evicted to make room. Blocks are reclaimed in this
order: free blocks holding nothing reusable first, then cached blocks, least
recently freed first (an ``OrderedDict``, so eviction is O(1)).

Every block is in exactly one state:

* in use: reference count > 0 (possibly also cached);
* cached free: count 0, has a hash (``_evictable``, LRU order);
* blank free: count 0, no hash (``_blank``).

so ``num_used + num_free == num_blocks`` always.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import msgspec

from shared.kv.block_hash import chained_block_hashes, next_block_hash


class KvCacheEvent(msgspec.Struct, frozen=True, array_like=True):
    """A block entered (``stored``) or left (``removed``) the prefix cache.

    The worker shell republishes these so the cache-manager's prefix index
    knows which prefixes this node holds.
    """

    kind: Literal["stored", "removed"]
    block_hash: int


class _SequenceBlocks:
    """A sequence's block table and what the pool needs to hash its next blocks."""

    __slots__ = ("block_ids", "block_hashes", "num_tokens", "num_committed", "tail_tokens")

    def __init__(
        self,
        block_ids: list[int],
        block_hashes: list[int],
        num_tokens: int,
        num_committed: int,
        tail_tokens: list[int],
    ) -> None:
        self.block_ids = block_ids
        # Hashes of all full blocks, computed or not.
        self.block_hashes = block_hashes
        self.num_tokens = num_tokens
        # Leading blocks whose KV is computed and that went through the cache.
        self.num_committed = num_committed
        # Token ids of the trailing partial block, hashed when it fills up.
        self.tail_tokens = tail_tokens


class BlockPool:
    """Reference-counted KV blocks with a prefix cache and LRU eviction.

    Sequences are named by the caller (``seq_id``). Lifecycle of one:
    ``allocate`` (all slots for the tokens known now, reusing cached leading
    blocks) -> ``mark_computed`` as its prefill progresses -> ``append_token``
    once per decoded token -> ``free``.
    """

    def __init__(self, *, num_blocks: int, block_size: int, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: list[int | None] = [None] * num_blocks
        self._block_of_hash: dict[int, int] = {}
        # Reversed so that blocks are handed out 0, 1, 2...: easier to read in tests.
        self._blank: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._num_used = 0
        # Cached blocks reclaimed for new allocations, since the pool was made.
        self.evicted = 0
        self._sequences: dict[str, _SequenceBlocks] = {}
        self._events: list[KvCacheEvent] | None = [] if record_events else None

    # --- counters ---------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks available to a new allocation: blank plus evictable cached ones."""
        return len(self._blank) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with a reference count above zero."""
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash, in use or not."""
        return len(self._block_of_hash)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._sequences

    # --- queries ------------------------------------------------------------------

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many leading ``block_hashes`` are in the cache (no side effects)."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._block_of_hash:
                break
            count += 1
        return count

    def blocks_held_by(self, seq_id: str) -> int:
        return len(self._sequences[seq_id].block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- sequence lifecycle --------------------------------------------------------

    def allocate(
        self, seq_id: str, token_ids: Sequence[int], block_hashes: Sequence[int] | None = None
    ) -> int | None:
        """Give ``seq_id`` slots for all of ``token_ids``; return the cache-hit token count.

        Leading full blocks found in the cache are shared (their KV counts as
        computed); the rest are fresh blocks. ``block_hashes`` may pass the
        precomputed ``chained_block_hashes(token_ids, block_size)``.
        Returns None, changing nothing, when free plus evictable blocks do
        not suffice; the caller decides whether to wait or preempt.
        The hit is capped below ``len(token_ids)``: like vLLM, the last
        token is always recomputed, because its logits are needed to sample.
        """
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        num_tokens = len(token_ids)
        if num_tokens == 0:
            raise ValueError("cannot allocate a sequence with no tokens")
        block_size = self.block_size
        num_full = num_tokens // block_size
        if block_hashes is None:
            block_hashes = chained_block_hashes(token_ids, block_size)
        elif len(block_hashes) != num_full:
            raise ValueError(f"expected {num_full} block hashes for {num_tokens} tokens, got {len(block_hashes)}")

        hit_ids: list[int] = []
        max_hit_blocks = (num_tokens - 1) // block_size
        for block_hash in block_hashes[:max_hit_blocks]:
            block_id = self._block_of_hash.get(block_hash)
            if block_id is None:
                break
            hit_ids.append(block_id)
        new_count = self.blocks_needed(num_tokens) - len(hit_ids)
        # Hits that sit in the evictable queue stop being free once shared.
        free_after_hits = self.num_free - sum(1 for block_id in hit_ids if self._ref_counts[block_id] == 0)
        if new_count > free_after_hits:
            return None

        ref_counts = self._ref_counts
        for block_id in hit_ids:
            if ref_counts[block_id] == 0:
                del self._evictable[block_id]
                self._num_used += 1
            ref_counts[block_id] += 1
        block_ids = hit_ids + [self._take_free_block() for _ in range(new_count)]  # type: ignore[misc]
        self._sequences[seq_id] = _SequenceBlocks(
            block_ids=block_ids,
            block_hashes=list(block_hashes),
            num_tokens=num_tokens,
            num_committed=len(hit_ids),
            tail_tokens=list(token_ids[num_full * block_size :]),
        )
        return len(hit_ids) * block_size

    def mark_computed(self, seq_id: str, num_computed_tokens: int) -> None:
        """The first ``num_computed_tokens`` of the sequence now have KV.

        Full blocks among them enter the prefix cache. Registering only
        computed blocks keeps a second request from "hitting" KV that a
        chunked prefill has not produced yet.
        """
        record = self._sequences[seq_id]
        full = min(num_computed_tokens // self.block_size, len(record.block_hashes))
        for index in range(record.num_committed, full):
            self._commit(record.block_ids[index], record.block_hashes[index])
        if full > record.num_committed:
            record.num_committed = full

    def append_token(self, seq_id: str, token_id: int) -> bool:
        """Add one computed token (a decode step's input) to the sequence.

        Needs a new block only when the last one is full; returns False,
        changing nothing, if none is free. A block that fills up is hashed
        and cached, so a follow-up turn repeating prompt + answer can hit it.
        """
        record = self._sequences[seq_id]
        block_size = self.block_size
        if record.num_tokens % block_size == 0:
            block_id = self._take_free_block()
            if block_id is None:
                return False
            record.block_ids.append(block_id)
        tail = record.tail_tokens
        tail.append(token_id)
        record.num_tokens += 1
        if len(tail) == block_size:
            hashes = record.block_hashes
            block_hash = next_block_hash(hashes[-1] if hashes else None, tail)
            hashes.append(block_hash)
            record.tail_tokens = []
            if record.num_committed == len(hashes) - 1:
                self._commit(record.block_ids[len(hashes) - 1], block_hash)
                record.num_committed += 1
        return True

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks; full computed ones stay cached.

        Blocks are released tail first, so the tail is evicted first: a
        prefix cache hit needs the leading blocks, and keeping them longest
        keeps the most reusable part.
        """
        record = self._sequences.pop(seq_id)
        ref_counts = self._ref_counts
        for block_id in reversed(record.block_ids):
            count = ref_counts[block_id] - 1
            ref_counts[block_id] = count
            if count == 0:
                self._num_used -= 1
                if self._hash_of_block[block_id] is None:
                    self._blank.append(block_id)
                else:
                    self._evictable[block_id] = None

    def drain_events(self) -> list[KvCacheEvent]:
        """Cache events since the last call, in order (empty unless ``record_events``)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    # --- internals ------------------------------------------------------------------

    def _take_free_block(self) -> int | None:
        if self._blank:
            block_id = self._blank.pop()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            evicted_hash = self._hash_of_block[block_id]
            self._hash_of_block[block_id] = None
            del self._block_of_hash[evicted_hash]  # type: ignore[arg-type]
            self.evicted += 1
            if self._events is not None:
                self._events.append(KvCacheEvent("removed", evicted_hash))  # type: ignore[arg-type]
        else:
            return None
        self._ref_counts[block_id] = 1
        self._num_used += 1
        return block_id

    def _commit(self, block_id: int, block_hash: int) -> None:
        if block_hash in self._block_of_hash:
            # Another sequence computed the same content concurrently; keep
            # its block as the cached copy and let this one go blank on free.
            return
        self._block_of_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        if self._events is not None:
            self._events.append(KvCacheEvent("stored", block_hash))
