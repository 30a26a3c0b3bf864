"""kvlane's chained KV-block hash (shared/kv/block_hash.py)."""

from __future__ import annotations

import struct
from hashlib import blake2b

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.kv.block_hash import ROOT_MARKER, chained_block_hashes, next_block_hash

token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=40)


def reference_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The scheme exactly as the module docstring states it, written the slow way."""
    hashes: list[int] = []
    parent = ROOT_MARKER
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = blake2b(parent + struct.pack(f"<{block_size}I", *block), digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        parent = digest
    return hashes


def test_one_hash_per_full_block_and_none_for_the_partial_tail() -> None:
    assert chained_block_hashes([], 4) == []
    assert chained_block_hashes([1, 2, 3], 4) == []
    assert len(chained_block_hashes(list(range(8)), 4)) == 2
    assert chained_block_hashes(list(range(11)), 4) == chained_block_hashes(list(range(8)), 4)


@given(token_lists, st.integers(1, 6))
def test_matches_the_documented_scheme(token_ids: list[int], block_size: int) -> None:
    assert chained_block_hashes(token_ids, block_size) == reference_hashes(token_ids, block_size)


def test_pinned_values_never_change() -> None:
    # Every service and every stored prefix index depends on these exact values.
    assert chained_block_hashes(list(range(8)), 4) == [0xD8C3F20E21948DA3, 0xA6A57D2A61513266]


def test_hashes_are_unsigned_64_bit() -> None:
    for value in chained_block_hashes(list(range(64)), 4):
        assert 0 <= value < 2**64


def test_a_block_hash_depends_on_every_earlier_token() -> None:
    base = list(range(12))
    original = chained_block_hashes(base, 4)
    changed_first = chained_block_hashes([99] + base[1:], 4)
    assert all(a != b for a, b in zip(original, changed_first, strict=True))
    changed_last = chained_block_hashes(base[:8] + [99] + base[9:], 4)
    assert changed_last[:2] == original[:2]
    assert changed_last[2] != original[2]


def test_same_block_content_at_another_position_hashes_differently() -> None:
    hashes = chained_block_hashes([5, 5, 5, 5] * 3, 4)
    assert len(set(hashes)) == 3


@given(token_lists, token_lists, st.integers(1, 6))
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(a: list[int], b: list[int], block_size: int) -> None:
    assert chained_block_hashes(a + b, block_size)[: len(a) // block_size] == chained_block_hashes(a, block_size)


@given(token_lists, st.integers(1, 6), st.integers(0, 6))
def test_parent_continues_a_chain(token_ids: list[int], block_size: int, split_blocks: int) -> None:
    full = chained_block_hashes(token_ids, block_size)
    split_blocks = min(split_blocks, len(full))
    parent = full[split_blocks - 1] if split_blocks else None
    rest = chained_block_hashes(token_ids[split_blocks * block_size :], block_size, parent)
    assert full[:split_blocks] + rest == full


def test_next_block_hash_is_one_link_of_the_chain() -> None:
    tokens = list(range(100, 112))
    hashes = chained_block_hashes(tokens, 4)
    assert next_block_hash(None, tokens[:4]) == hashes[0]
    assert next_block_hash(hashes[0], tokens[4:8]) == hashes[1]
    assert next_block_hash(hashes[1], tokens[8:]) == hashes[2]


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="block_size"):
        chained_block_hashes([1, 2], 0)
    with pytest.raises(OverflowError):
        chained_block_hashes([-1, 2], 2)
    with pytest.raises(OverflowError):
        chained_block_hashes([2**32, 2], 2)
