"""The balancer's tick reads the global count only of chains that no reservation's reply counted since the last tick."""

from __future__ import annotations

from contracts.messages import ErrorReply, RouteDecision
from services.balancer.slot_store import LocalSlotStore
from tests.unit.balancer_fixtures import heartbeat
from tests.unit.test_balancer_core import make_balancer, route_request
from tests.unit.test_unleased_routes import FixedAllocator

NODES = ("a", "b", "c")


class CountingStore(LocalSlotStore):
    """A store whose reservations answer with a global count, recording the chains each usage read asks for."""

    def __init__(self) -> None:
        self.reads: list[list[str]] = []

    async def reserve(self, request_id, chain_id, slots, expires_at):
        return True, 1

    async def usage(self, chain_ids, now):
        self.reads.append(list(chain_ids))
        return dict.fromkeys(chain_ids, 0)


def chains_of(balancer) -> list[str]:
    return sorted(balancer.router.builder.facts(heartbeat(node)).chain_id for node in NODES)


async def test_a_tick_reads_only_the_chains_no_reservation_counted_since_the_last_one() -> None:
    balancer, _, _ = make_balancer(*(heartbeat(node) for node in NODES))
    store = balancer._store = CountingStore()
    assert isinstance(await balancer.route(route_request("r1")), RouteDecision)
    placed = balancer.router.table.holder("r1")
    await balancer.tick()
    assert store.reads == [[chain for chain in chains_of(balancer) if chain != placed]]
    await balancer.tick()  # nothing counted since: every chain is read
    assert store.reads[-1] == chains_of(balancer)


async def test_a_chain_taken_as_full_for_want_of_kv_room_is_read_at_the_next_tick() -> None:
    balancer, _, _ = make_balancer(*(heartbeat(node) for node in NODES), max_wait_s=0.0)
    store = balancer._store = CountingStore()
    balancer._allocator = FixedAllocator(ErrorReply(code="no_capacity", message="no room", status=503))
    assert isinstance(await balancer.route(route_request("r1")), ErrorReply)
    await balancer.tick()
    # Every chain was refused for KV and so taken as full: the tick reads them all again.
    assert store.reads == [chains_of(balancer)]
    assert balancer.router.table.total_used() == 0
