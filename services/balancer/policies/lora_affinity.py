"""LoRA affinity: the Gateway API Inference Extension's rule for requests with LoRA adapters.

Its endpoint picker scores each model server for a request's adapter
(`lora-affinity-scorer`): 1.0 where the adapter is active, 0.8 where the
server has room for one more adapter, 0.6 where the adapter only waits in
its queue, 0 where it has no room; its earlier filter chain (`lora-affinity`,
then `least-queue`, then `least-kv-cache`) let load decide among the best.
This policy keeps that order, without the filter's random escape to servers
with room: among free chains, the nodes with the adapter active, else the
nodes with room for it, else the rest; then least load (requests there or
reserved, per health weight), then least KV used; ties in turn.

What it reads is what the balancer's adapter placement
(`services.balancer.adapters.AdapterPlacement`) makes of the heartbeats: a
chain's `adapter_load_s` (the index's `adapter_s` column) is 0 where the
adapter is in a batch slot, or runs a request this balancer placed there
that still holds its slot, which is "active" here. A node whose slots all run other
adapters' requests is not offered at all, so every other offered node has
room, and the last tier is empty. This needs `balancer.adapters.aware`
(the default): unaware, every node reads 0 and the policy is least-loaded.
A request without an adapter is routed by load alone.
"""

from __future__ import annotations

from contracts.messages import RouteRequest
from services.balancer.chain_index import Decision
from services.balancer.policies.base import Rotation
from services.balancer.snapshot import ChainState, ClusterSnapshot

_ACTIVE, _ROOM = 0, 1


class LoraAffinity:
    name = "lora_affinity"
    cache_hold_share = 0.0
    bounds_backlog = False
    fast_forwards = 0

    def __init__(self) -> None:
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = snapshot.free()
        if not free:
            return None
        adapter = request.adapter
        return self._rotation.best(free, lambda c: (_tier(adapter, c.adapter_load_s), c.load, c.kv_usage))

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        if request.adapter:
            chains.prefer(chains.index.adapter_s == 0.0)
        tied = chains.least("load", "kv_usage")
        return self._rotation.among(tied) if tied else None


def _tier(adapter: str, load_s: float) -> int:
    # Offered chains that would load the adapter all have room for it (see the module doc).
    return _ACTIVE if not adapter or load_s == 0.0 else _ROOM
