"""Where a request's LoRA adapter is, node by node, and what loading it would cost there (pure).

Each heartbeat says which adapters the node holds in its batch slots, which
of them have requests (a slot the engine cannot give up), which it keeps in
host memory, and how long its loads took. A request for adapter X then
costs, on a node: nothing with X in a slot; a copy from host memory with X
there; a fetch and load otherwise; and, where every slot is taken, the copy
back that the idle adapter it evicts will need. A node whose every slot runs other
adapters' requests cannot start X until one of them ends: it is not offered
(JFFC's chains respect the slots, as they respect KV). The adapters of the
requests this balancer placed on a node count as running there, in their
slots, until those requests end, and an adapter whose last such request
ended no longer does, whatever the last heartbeat said: a heartbeat is up to
a second old, and without this a burst for a new adapter would load it
everywhere, every node's last free slot would be promised to several
adapters at once, and slots freed since would stay unused.

Slots are what a fleet serving many adapters runs out of first: with more
adapters wanted at once than it has slots, requests of the adapters without
one wait for one to free, whichever node is fast. So a request that would
start its adapter on a node where it runs nothing also pays for the slot it
takes (`slot_price_s`): the seconds it holds it (the mean hold of this
balancer's adapter requests) times rho / (1 - rho), where rho is the share
of the fleet's slots running requests, as a queue's wait grows with its
server's utilisation. An adapter with a free node where it runs already
goes there, unless that node is slower by more than the price; one spread
over every node holds slots the unpopular adapters wait for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from msgspec import Struct

from contracts.messages import Heartbeat
from shared.balancer_settings import AdapterRoutingSettings


# How much each ended hold moves the mean hold: about the last 50 count.
_HOLD_WEIGHT = 0.02
# Slots all busy would price a slot without bound; a slot is then still worth taking over waiting forever.
_MOST_UTILISATION = 0.95


class NodeAdapters(Struct, frozen=True):
    max_loras: int
    in_slots: frozenset[str]
    running: frozenset[str]
    in_host: frozenset[str]
    load_s: float


class AdapterPlacement:
    def __init__(self, settings: AdapterRoutingSettings) -> None:
        self._settings = settings
        self._nodes: dict[str, NodeAdapters] = {}
        # The requests this balancer placed that hold their slot, by request id: their node, adapter and when they
        # took it; and per node, how many of them run each adapter.
        self._placed: dict[str, tuple[str, str, float]] = {}
        self._placed_on: dict[str, dict[str, int]] = {}
        # Per node, the adapters whose last request this balancer placed there ended since the node's last heartbeat:
        # that heartbeat still counts them as running, and is up to a second old.
        self._ended_since: dict[str, set[str]] = {}
        # The mean seconds a placed request held its slot (a moving average).
        self.mean_hold_s = settings.hold_s

    def observe(self, heartbeat: Heartbeat) -> None:
        registration, stats = heartbeat.registration, heartbeat.stats
        worker_id = registration.worker_id
        self._ended_since.pop(worker_id, None)
        if not registration.max_loras:
            self._nodes.pop(worker_id, None)
            return
        self._nodes[worker_id] = NodeAdapters(
            max_loras=registration.max_loras, in_slots=frozenset(stats.adapters_active),
            running=frozenset(stats.adapters_running), in_host=frozenset(stats.adapters_cached),
            load_s=stats.adapter_load_s or self._settings.load_s)

    def note_placed(self, request_id: str, worker_id: str, adapter: str, now: float) -> None:
        """`request_id`, with `adapter`, took a slot on `worker_id` at `now` (until `released`)."""
        if adapter:
            self._placed[request_id] = (worker_id, adapter, now)
            on_node = self._placed_on.setdefault(worker_id, {})
            on_node[adapter] = on_node.get(adapter, 0) + 1

    def released(self, request_id: str, now: float) -> None:
        placed = self._placed.pop(request_id, None)
        if placed is None:
            return
        worker_id, adapter, placed_at = placed
        self.mean_hold_s += _HOLD_WEIGHT * (max(0.0, now - placed_at) - self.mean_hold_s)
        on_node = self._placed_on[worker_id]
        if on_node[adapter] > 1:
            on_node[adapter] -= 1
        else:
            del on_node[adapter]
            self._ended_since.setdefault(worker_id, set()).add(adapter)

    def forget(self, worker_ids: Iterable[str]) -> None:
        for worker_id in worker_ids:
            self._nodes.pop(worker_id, None)
            self._ended_since.pop(worker_id, None)

    def serves_adapters(self, heartbeats: Sequence[Heartbeat]) -> bool:
        return any(hb.registration.max_loras for hb in heartbeats)

    def load_seconds(self, adapter: str, heartbeats: Sequence[Heartbeat]) -> Mapping[str, float | None]:
        """Per node of `heartbeats`: the seconds `adapter` takes to load there, None where it cannot run now."""
        nodes = {hb.registration.worker_id: self._nodes.get(hb.registration.worker_id) for hb in heartbeats}
        if not self._settings.aware:
            return {worker_id: None if node is None else 0.0 for worker_id, node in nodes.items()}
        busy_on = {worker_id: self._busy(worker_id, node) for worker_id, node in nodes.items() if node is not None}
        price = self.slot_price_s(busy_on)
        return {worker_id: None if node is None else self._seconds(node, adapter, busy_on[worker_id], price)
                for worker_id, node in nodes.items()}

    def slot_price_s(self, busy_on: Mapping[str, frozenset[str]]) -> float:
        """What taking a slot costs the requests that will wait for one: its hold times rho / (1 - rho)."""
        slots = sum(self._nodes[worker_id].max_loras for worker_id in busy_on)
        if not slots or not self._settings.price_slots:
            return 0.0
        busy = sum(min(len(running), self._nodes[worker_id].max_loras) for worker_id, running in busy_on.items())
        utilisation = min(busy / slots, _MOST_UTILISATION)
        return self.mean_hold_s * utilisation / (1.0 - utilisation)

    def _busy(self, worker_id: str, node: NodeAdapters) -> frozenset[str]:
        """The adapters running requests on the node: what its heartbeat said, but for what ended since, and what
        this balancer placed since."""
        return node.running.difference(self._ended_since.get(worker_id, ())).union(self._placed_on.get(worker_id, {}))

    def _seconds(self, node: NodeAdapters, adapter: str, busy: frozenset[str], price: float) -> float | None:
        if adapter in busy:
            return 0.0
        if adapter in node.in_slots:
            return price  # idle in its slot: it takes that slot from the adapters without one
        if len(busy) >= node.max_loras:
            return None  # every slot runs another adapter's requests
        load = self._settings.activate_s if adapter in node.in_host else node.load_s
        # With every slot taken, an idle adapter goes back to host memory: its next request there loads it again.
        evicts = len(node.in_slots | busy) >= node.max_loras
        return price + load + (self._settings.activate_s if evicts else 0.0)
