"""PrefixIndex against a naive model: per node, the set of hashes it holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.engines.base import net_kv_delta
from shared.prefix_index import PrefixIndex

NODES = ["a", "b", "c"]
HASHES = list(range(8))


def naive_match(held: dict[str, set[int]], hashes: list[int]) -> dict[str, int]:
    result = {}
    for node, blocks in held.items():
        depth = 0
        while depth < len(hashes) and hashes[depth] in blocks:
            depth += 1
        if depth:
            result[node] = depth
    return result


operations = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear", "leave"]),
        st.sampled_from(NODES),
        st.lists(st.sampled_from(HASHES), max_size=5),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(operations, st.lists(st.sampled_from(HASHES), max_size=6))
def test_match_agrees_with_a_naive_model_when_unbounded(ops, query) -> None:
    index = PrefixIndex(max_blocks=1000)
    held: dict[str, set[int]] = {n: set() for n in NODES}
    for kind, node, hashes in ops:
        if kind == "store":
            index.apply(node, stored=hashes)
            held[node] |= set(hashes)
        elif kind == "remove":
            index.apply(node, removed=hashes)
            held[node] -= set(hashes)
        elif kind == "clear":
            index.apply(node, stored=hashes, cleared=True)
            held[node] = set(hashes)
        else:
            index.remove_node(node)
            held[node] = set()
        for n in NODES:
            assert index.blocks_on(n) == len(held[n])
    assert index.match(query) == naive_match(held, query)
    assert len(index) == len(set().union(*held.values()))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NODES), st.lists(st.integers(0, 50), max_size=10)), max_size=30))
def test_size_stays_within_the_bound_and_counts_stay_consistent(stores) -> None:
    index = PrefixIndex(max_blocks=10)
    for node, hashes in stores:
        index.apply(node, stored=hashes)
        assert len(index) <= 10
        assert sum(index.blocks_on(n) for n in NODES) >= len(index)
    for node in NODES:
        index.remove_node(node)
    assert len(index) == 0 and index.nodes() == []


def test_a_gap_in_the_chain_stops_the_match() -> None:
    index = PrefixIndex()
    index.apply("a", stored=[1, 2, 3])
    index.apply("b", stored=[1, 3])
    assert index.match([1, 2, 3]) == {"a": 3, "b": 1}
    assert index.match([9, 1]) == {}


def test_eviction_forgets_the_least_recently_used_hash() -> None:
    index = PrefixIndex(max_blocks=2)
    index.apply("a", stored=[1, 2])
    index.match([1])  # touches 1, so 2 is the oldest
    index.apply("a", stored=[3])
    assert index.match([1]) == {"a": 1}
    assert index.match([2]) == {}


def test_bad_bound_is_rejected() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(max_blocks=0)


def test_net_kv_delta_keeps_each_hash_last_state() -> None:
    delta = net_kv_delta([(True, 1), (False, 1), (False, 2), (True, 2), (True, 3)])
    assert sorted(delta.stored) == [2, 3] and delta.removed == [1]
    assert not net_kv_delta([])
    assert net_kv_delta([], cleared=True)
