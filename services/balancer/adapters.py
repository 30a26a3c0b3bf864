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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from msgspec import Struct

from contracts.messages import Heartbeat
from shared.balancer_settings import AdapterRoutingSettings


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
        # The requests this balancer placed that hold their slot, by request id: their node and adapter; and per
        # node, how many of them run each adapter.
        self._placed: dict[str, tuple[str, str]] = {}
        self._placed_on: dict[str, dict[str, int]] = {}
        # Per node, the adapters whose last request this balancer placed there ended since the node's last heartbeat:
        # that heartbeat still counts them as running, and is up to a second old.
        self._ended_since: dict[str, set[str]] = {}

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

    def note_placed(self, request_id: str, worker_id: str, adapter: str) -> None:
        """`request_id`, with `adapter`, took a slot on `worker_id` (until `released`)."""
        if adapter:
            self._placed[request_id] = (worker_id, adapter)
            on_node = self._placed_on.setdefault(worker_id, {})
            on_node[adapter] = on_node.get(adapter, 0) + 1

    def released(self, request_id: str) -> None:
        placed = self._placed.pop(request_id, None)
        if placed is None:
            return
        worker_id, adapter = placed
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
        aware = self._settings.aware
        costs: dict[str, float | None] = {}
        for heartbeat in heartbeats:
            worker_id = heartbeat.registration.worker_id
            node = self._nodes.get(worker_id)
            if node is None:
                costs[worker_id] = None
            elif not aware:
                costs[worker_id] = 0.0
            else:
                placed = self._placed_on.get(worker_id, {}).keys()
                costs[worker_id] = self._seconds(node, adapter, placed, self._ended_since.get(worker_id, ()))
        return costs

    def _seconds(self, node: NodeAdapters, adapter: str, placed: Iterable[str], ended: Iterable[str]) -> float | None:
        if adapter in node.in_slots or adapter in placed:
            return 0.0
        # Running there: what the heartbeat said, but for what ended since, and what this balancer placed since.
        busy = node.running.difference(ended).union(placed)
        if len(busy) >= node.max_loras:
            return None  # every slot runs another adapter's requests
        load = self._settings.activate_s if adapter in node.in_host else node.load_s
        # With every slot taken, an idle adapter goes back to host memory: its next request there loads it again.
        evicts = len(node.in_slots.union(placed)) >= node.max_loras
        return load + self._settings.activate_s if evicts else load
