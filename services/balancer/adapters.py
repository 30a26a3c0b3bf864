"""Where a request's LoRA adapter is, node by node, and what loading it would cost there (pure).

Each heartbeat says which adapters the node holds in its batch slots, which
of them have requests (a slot the engine cannot give up), which it keeps in
host memory, and how long its loads took. A request for adapter X then
costs, on a node: nothing with X in a slot; a copy from host memory with X
there; a fetch and load otherwise; and, where every slot is taken, the copy
back that the idle adapter it evicts will need. A node whose every slot runs other
adapters' requests cannot start X until one of them ends: it is not offered
(JFFC's chains respect the slots, as they respect KV). Between heartbeats,
adapters this balancer sent a node count as in its slots, so that a burst
for a new adapter goes where the first of it went, not everywhere.
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
        # Adapters sent to each node since its last heartbeat.
        self._sent: dict[str, set[str]] = {}

    def observe(self, heartbeat: Heartbeat) -> None:
        registration, stats = heartbeat.registration, heartbeat.stats
        worker_id = registration.worker_id
        self._sent.pop(worker_id, None)
        if not registration.max_loras:
            self._nodes.pop(worker_id, None)
            return
        self._nodes[worker_id] = NodeAdapters(
            max_loras=registration.max_loras, in_slots=frozenset(stats.adapters_active),
            running=frozenset(stats.adapters_running), in_host=frozenset(stats.adapters_cached),
            load_s=stats.adapter_load_s or self._settings.load_s)

    def note_sent(self, worker_id: str, adapter: str) -> None:
        if adapter:
            self._sent.setdefault(worker_id, set()).add(adapter)

    def forget(self, worker_ids: Iterable[str]) -> None:
        for worker_id in worker_ids:
            self._nodes.pop(worker_id, None)
            self._sent.pop(worker_id, None)

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
                costs[worker_id] = self._seconds(node, adapter, self._sent.get(worker_id, ()))
        return costs

    def _seconds(self, node: NodeAdapters, adapter: str, sent: Iterable[str]) -> float | None:
        sent = set(sent)
        if adapter in node.in_slots or adapter in sent:
            return 0.0
        busy = node.running | sent
        if len(busy) >= node.max_loras:
            return None  # every slot runs another adapter's requests
        load = self._settings.activate_s if adapter in node.in_host else node.load_s
        # With every slot taken, an idle adapter goes back to host memory: its next request there loads it again.
        evicts = len(node.in_slots | sent) >= node.max_loras
        return load + self._settings.activate_s if evicts else load
