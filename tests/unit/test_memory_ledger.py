"""The simulator's in-memory ledger keeps the Lua ledger's rule that a lease is found through its node (the full
comparison against Redis is tests/integration/test_ledger_conformance.py)."""

from __future__ import annotations

from loadtest.simulation.ledger import MemoryLedger
from shared.kv.allocation import NodeAsk


def ask(blocks: int) -> NodeAsk:
    return NodeAsk(blocks=blocks, cached_blocks=0, pool="general", general_capacity=10, short_capacity=0)


def test_a_request_leased_again_elsewhere_keeps_its_first_lease_until_a_release_names_that_node() -> None:
    ledger = MemoryLedger()
    assert ledger.reserve("r1", "a", ask(3), 1.0, 8, 0.0)
    assert ledger.reserve("r1", "b", ask(4), 1.0, 8, 1.0)
    assert (ledger.used("a"), ledger.used("b")) == ((3, 0), (4, 0))
    assert ledger.reserve("r1", "a", ask(5), 1.0, 8, 2.0)  # held there already: nothing more taken
    assert ledger.used("a") == (3, 0)
    assert ledger.release("r1", "a") == 3  # the first attempt's end
    assert ledger.release("r1", "a") is None
    assert (ledger.used("a"), ledger.used("b")) == ((0, 0), (4, 0))


def test_a_release_that_knows_only_the_request_frees_it_on_every_node() -> None:
    ledger = MemoryLedger()
    assert ledger.reserve("r1", "a", ask(3), 1.0, 8, 0.0)
    assert ledger.reserve("r1", "b", ask(4), 1.0, 8, 0.0)
    assert ledger.reserve("r2", "b", ask(6), 1.0, 8, 0.0)
    assert not ledger.reserve("r3", "b", ask(1), 1.0, 8, 0.0)  # b is full
    assert ledger.release("r1") == 7
    assert ledger.release("r1") is None
    assert (ledger.used("a"), ledger.used("b")) == ((0, 0), (6, 0))
    ledger.release_node("b")
    assert ledger.used("b") == (0, 0) and ledger.leases_on("b", lambda _: 0) == []
