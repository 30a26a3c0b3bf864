"""Paged KV block pool with prefix caching (services/worker/sim/blocks.py)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from services.worker.sim.blocks import BlockPool, KvCacheEvent
from shared.kv.block_hash import chained_block_hashes


def computed(pool: BlockPool, seq_id: str, token_ids: list[int]) -> int | None:
    """Allocate and prefill a whole sequence; the allocation's hit count."""
    hit = pool.allocate(seq_id, token_ids)
    if hit is not None:
        pool.mark_computed(seq_id, len(token_ids))
    return hit


def assert_counters_consistent(pool: BlockPool) -> None:
    assert pool.num_used + pool.num_free == pool.num_blocks
    assert 0 <= pool.num_cached <= pool.num_blocks


def test_fresh_allocation_takes_ceil_blocks_and_hits_nothing() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.allocate("a", list(range(10))) == 0
    assert pool.num_used == 3
    assert pool.num_free == 5
    assert pool.num_cached == 0  # nothing computed yet
    assert_counters_consistent(pool)


def test_full_computed_blocks_are_hit_after_free_partial_ones_are_not() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    tokens = list(range(10))
    computed(pool, "a", tokens)
    assert pool.num_cached == 2  # the partial third block is not cached
    pool.free("a")
    assert pool.num_used == 0
    assert pool.num_free == 8
    assert pool.num_cached == 2
    assert pool.cached_prefix_blocks(chained_block_hashes(tokens, 4)) == 2
    assert computed(pool, "b", tokens) == 8
    assert pool.num_used == 3
    assert_counters_consistent(pool)


def test_uncomputed_blocks_are_not_hit() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    tokens = list(range(12))
    pool.allocate("a", tokens)
    pool.mark_computed("a", 5)  # one full block computed so far
    assert pool.allocate("b", tokens) == 4


def test_a_fully_cached_prompt_still_recomputes_its_last_token() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    tokens = list(range(8))
    computed(pool, "a", tokens)
    pool.free("a")
    assert pool.allocate("b", tokens) == 4
    assert pool.allocate("c", tokens + [8]) == 8


def test_cached_prefix_blocks_counts_leading_hits_only_and_has_no_side_effects() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    computed(pool, "a", [1, 2, 3, 4])
    pool.free("a")
    hashes = chained_block_hashes([1, 2, 3, 4, 5, 6], 2)
    assert pool.cached_prefix_blocks(hashes) == 2
    assert pool.cached_prefix_blocks(chained_block_hashes([9, 9, 3, 4], 2)) == 0
    assert pool.cached_prefix_blocks([]) == 0
    assert (pool.num_used, pool.num_free, pool.num_cached) == (0, 8, 2)


def test_refcounts_let_two_sequences_share_a_prefix() -> None:
    pool = BlockPool(num_blocks=10, block_size=4)
    prefix = list(range(8))
    computed(pool, "a", prefix + [100, 101, 102, 103, 104])
    assert pool.num_used == 4
    assert pool.allocate("b", prefix + [200, 201]) == 8
    assert pool.num_used == 5  # two shared blocks counted once, one new
    pool.free("a")
    # The shared prefix is still in use by b; a's own blocks are free.
    assert pool.num_used == 3
    assert pool.cached_prefix_blocks(chained_block_hashes(prefix, 4)) == 2
    pool.free("b")
    assert pool.num_used == 0
    assert pool.num_free == 10
    assert_counters_consistent(pool)


def test_blank_blocks_are_used_before_cached_ones_are_evicted() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    computed(pool, "a", [1, 2, 3, 4])
    pool.free("a")
    computed(pool, "b", [7, 8, 9, 10])  # fits in the two blank blocks
    assert pool.cached_prefix_blocks(chained_block_hashes([1, 2, 3, 4], 2)) == 2
    assert pool.evicted == 0


def test_eviction_is_least_recently_freed_first_and_tail_first() -> None:
    pool = BlockPool(num_blocks=6, block_size=2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    computed(pool, "a", a)
    computed(pool, "b", b)
    pool.free("a")
    pool.free("b")
    # Touch a: reusing and freeing it again makes it the most recently used.
    assert computed(pool, "a2", a + [0]) == 4
    pool.free("a2")
    # Two blank blocks remain; a third new block must evict b's tail block.
    computed(pool, "c", [20, 21, 22, 23, 24])
    assert pool.cached_prefix_blocks(chained_block_hashes(b, 2)) == 1
    assert pool.cached_prefix_blocks(chained_block_hashes(a, 2)) == 2
    computed(pool, "d", [30, 31])  # evicts b's head block
    assert pool.cached_prefix_blocks(chained_block_hashes(b, 2)) == 0
    assert pool.cached_prefix_blocks(chained_block_hashes(a, 2)) == 2
    computed(pool, "e", [40])  # now a's tail
    assert pool.cached_prefix_blocks(chained_block_hashes(a, 2)) == 1
    assert pool.evicted == 3  # b's two blocks, then a's tail
    assert_counters_consistent(pool)


def test_failed_allocation_changes_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=2, record_events=True)
    computed(pool, "a", [1, 2, 3, 4])
    pool.free("a")
    computed(pool, "b", [5, 6])
    pool.drain_events()
    before = (pool.num_used, pool.num_free, pool.num_cached)
    # Reusing a's two cached blocks still leaves 3 new blocks to find; 1 free.
    assert pool.allocate("c", [1, 2, 3, 4, 9, 9, 9, 9, 9]) is None
    assert (pool.num_used, pool.num_free, pool.num_cached) == before
    assert "c" not in pool
    assert pool.drain_events() == []
    assert pool.cached_prefix_blocks(chained_block_hashes([1, 2, 3, 4], 2)) == 2


def test_allocation_may_use_every_evictable_block() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    computed(pool, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    pool.free("a")
    assert computed(pool, "b", [1, 2, 3, 4, 9, 9, 9, 9]) == 4
    assert pool.num_free == 0


def test_append_token_takes_a_block_only_at_a_boundary_and_caches_filled_blocks() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    computed(pool, "a", [1, 2, 3])
    assert pool.num_used == 1
    assert pool.append_token("a", 4)  # fills block 0, no new block
    assert pool.num_used == 1
    assert pool.num_cached == 1
    assert pool.append_token("a", 5)  # block boundary: a new block
    assert pool.num_used == 2
    for token in (6, 7, 8):
        assert pool.append_token("a", token)
    assert pool.num_cached == 2
    pool.free("a")
    # A follow-up turn that repeats the prompt and the answer hits both blocks.
    assert pool.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_append_token_fails_cleanly_when_no_block_is_free() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    computed(pool, "a", [1, 2])
    computed(pool, "b", [3, 4])
    assert not pool.append_token("a", 5)
    assert (pool.num_used, pool.num_free) == (2, 0)
    pool.free("b")
    assert pool.append_token("a", 5)  # evicts b's cached block
    assert pool.num_cached == 1


def test_same_content_computed_twice_is_cached_once() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    pool.allocate("a", [1, 2, 3])
    pool.allocate("b", [1, 2, 3])  # nothing computed yet: no hit
    pool.mark_computed("a", 3)
    pool.mark_computed("b", 3)
    assert pool.num_cached == 1
    pool.free("a")
    pool.free("b")
    assert pool.num_free == 8
    assert pool.num_cached == 1


def test_events_report_stores_and_evictions_in_order() -> None:
    pool = BlockPool(num_blocks=2, block_size=2, record_events=True)
    computed(pool, "a", [1, 2, 3, 4])
    [h0, h1] = chained_block_hashes([1, 2, 3, 4], 2)
    pool.free("a")
    computed(pool, "b", [7])
    assert pool.drain_events() == [
        KvCacheEvent("stored", h0),
        KvCacheEvent("stored", h1),
        KvCacheEvent("removed", h1),
    ]
    assert pool.drain_events() == []


def test_rejects_misuse() -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks=0, block_size=4)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=4, block_size=0)
    pool = BlockPool(num_blocks=4, block_size=2)
    with pytest.raises(ValueError, match="no tokens"):
        pool.allocate("a", [])
    with pytest.raises(ValueError, match="block hashes"):
        pool.allocate("a", [1, 2, 3, 4], block_hashes=[1])
    pool.allocate("a", [1])
    with pytest.raises(ValueError, match="already"):
        pool.allocate("a", [1])


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate/compute/append/free sequences keep the accounting exact."""

    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=12, block_size=2)
        self.tables: dict[str, int] = {}  # seq id -> token count
        self.next_id = 0

    @rule(
        target=sequences,
        prefix=st.sampled_from([[], [1, 2], [1, 2, 3, 4]]),
        tail=st.lists(st.integers(0, 3), max_size=7),
    )
    def allocate(self, prefix: list[int], tail: list[int]) -> str:
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        tokens = prefix + tail or [0]
        free_before = self.pool.num_free
        hit = self.pool.allocate(seq_id, tokens)
        if hit is None:
            assert self.pool.num_free == free_before
            return "none"
        assert hit % 2 == 0 and hit < len(tokens)
        self.pool.mark_computed(seq_id, len(tokens))
        self.tables[seq_id] = len(tokens)
        return seq_id

    @rule(seq_id=sequences, token=st.integers(0, 3))
    def append(self, seq_id: str, token: int) -> None:
        if seq_id in self.tables:
            if self.pool.append_token(seq_id, token):
                self.tables[seq_id] += 1

    @rule(seq_id=consumes(sequences))
    def free(self, seq_id: str) -> None:
        if self.tables.pop(seq_id, None) is not None:
            self.pool.free(seq_id)

    @invariant()
    def accounting(self) -> None:
        pool = self.pool
        assert pool.num_used + pool.num_free == pool.num_blocks
        # Blocks in use never exceed what the live sequences need (sharing only lowers it).
        assert pool.num_used <= sum(pool.blocks_needed(n) for n in self.tables.values())
        if not self.tables:
            assert pool.num_used == 0


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
