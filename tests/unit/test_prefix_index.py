"""PrefixIndex against a naive model: per node, the set of hashes it holds."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.engines.base import net_kv_delta
from shared.kv.prefix_index import PrefixIndex

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


def test_a_match_touches_blocks_only_up_to_where_the_last_node_drops_out() -> None:
    index = PrefixIndex(max_blocks=4)
    index.apply("a", stored=[1, 2])
    index.apply("b", stored=[3, 4])
    assert index.match([1, 3, 4]) == {"a": 1}  # no node holds 1 and 3: 4 is not reached, so not touched
    index.apply("c", stored=[5, 6])  # evicts the two least recently used: 2, then 4
    assert [index.match([h]) for h in (1, 2, 3, 4)] == [{"a": 1}, {}, {"b": 1}, {}]


def test_a_match_that_routes_nothing_leaves_the_eviction_order_alone() -> None:
    index = PrefixIndex(max_blocks=2)
    index.apply("a", stored=[1, 2])
    assert index.match([1], touch_blocks=False) == {"a": 1}  # 1 stays the oldest
    index.apply("a", stored=[3])
    assert [index.match([h]) for h in (1, 2, 3)] == [{}, {"a": 1}, {"a": 1}]


def test_bad_bound_is_rejected() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(max_blocks=0)


def test_net_kv_delta_keeps_each_hash_last_state() -> None:
    delta = net_kv_delta([(True, 1), (False, 1), (False, 2), (True, 2), (True, 3)])
    assert sorted(delta.stored) == [2, 3] and delta.removed == [1]
    assert not net_kv_delta([])
    assert net_kv_delta([], cleared=True)


class ReferenceIndex:
    """The index written plainly: a mutable holder set per hash, every matched block moved to the LRU end in turn."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.holders: OrderedDict[int, set[str]] = OrderedDict()

    def apply(self, node: str, stored: list[int], removed: list[int], cleared: bool) -> None:
        if cleared:
            self.remove_node(node)
        for block_hash in removed:
            holders = self.holders.get(block_hash, set())
            holders.discard(node)
            if not holders:
                self.holders.pop(block_hash, None)
        for block_hash in stored:
            self.holders.setdefault(block_hash, set()).add(node)
            self.holders.move_to_end(block_hash)
        while len(self.holders) > self.max_blocks:
            self.holders.popitem(last=False)

    def remove_node(self, node: str) -> None:
        self.apply(node, [], [h for h, holders in self.holders.items() if node in holders], False)

    def match(self, block_hashes: list[int]) -> dict[str, int]:
        depth_of: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, block_hash in enumerate(block_hashes):
            holders = self.holders.get(block_hash)
            if not holders:
                break
            self.holders.move_to_end(block_hash)
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for node in alive:
                depth_of[node] = depth + 1
        return depth_of

    def blocks_on(self, node: str) -> int:
        return sum(node in holders for holders in self.holders.values())


chain_ops = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["store", "remove", "clear"]), st.sampled_from(NODES),
                  st.lists(st.sampled_from(HASHES), max_size=8)),
        st.tuples(st.just("leave"), st.sampled_from(NODES), st.just([])),
        st.tuples(st.just("match"), st.just(""), st.lists(st.sampled_from(HASHES), max_size=8)),
        # A prompt's chain stored (or matched) as one run, as KV events and requests carry them.
        st.tuples(st.sampled_from(["store", "match"]), st.sampled_from(NODES), st.integers(0, 7).map(lambda n: HASHES[:n])),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(chain_ops, st.integers(1, 9))
def test_matches_and_lru_eviction_agree_with_a_plain_reference(ops, max_blocks) -> None:
    index, reference = PrefixIndex(max_blocks=max_blocks), ReferenceIndex(max_blocks)
    for kind, node, hashes in ops:
        if kind == "match":
            assert index.match(hashes) == reference.match(hashes)
        elif kind == "leave":
            index.remove_node(node)
            reference.remove_node(node)
        else:
            stored = hashes if kind in ("store", "clear") else []
            removed = hashes if kind == "remove" else []
            index.apply(node, stored=stored, removed=removed, cleared=kind == "clear")
            reference.apply(node, stored, removed, kind == "clear")
        assert len(index) == len(reference.holders)
        assert [index.blocks_on(n) for n in NODES] == [reference.blocks_on(n) for n in NODES]
    # Which hashes survive, and in which order they would be evicted, shows through single-block matches.
    for block_hash in HASHES:
        assert index.match([block_hash]) == reference.match([block_hash])
