"""Cache-aware baselines: SGLang-style prefix affinity, Dynamo-style KV cost, and the score rule."""

from __future__ import annotations

import math

import structlog

from contracts.messages import RouteRequest
from services.balancer.chain_index import Decision
from services.balancer.policies.base import Rotation, match_ratio
from services.balancer.snapshot import ChainState, ClusterSnapshot
from shared.config import KvCostSettings, PrefixAffinitySettings, ScoreSettings

log = structlog.get_logger("kvlane.balancer")


class PrefixAffinity:
    """Longest cached prefix when it covers enough of the prompt, unless load is too uneven.

    As SGLang's cache-aware router: the cluster counts as imbalanced when the
    busiest and idlest chains differ by more than an absolute AND a relative
    bound; then load decides. Without a good match the request goes where the
    cache has most room, so new prefixes spread out.
    """

    name = "prefix_affinity"
    cache_hold_share = 0.0
    bounds_backlog = False
    fast_forwards = 0

    def __init__(self, settings: PrefixAffinitySettings) -> None:
        self._settings = settings
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = snapshot.free()
        if not free:
            return None
        loads = [c.load for c in snapshot.chains]
        busiest, idlest = max(loads), min(loads)
        if busiest - idlest > self._settings.balance_abs_threshold and busiest > idlest * self._settings.balance_rel_threshold:
            return self._rotation.best(free, lambda c: c.load)
        best_match = self._rotation.best(free, lambda c: (-c.cached_blocks, c.load))
        if match_ratio(best_match, snapshot) > self._settings.match_threshold:
            return best_match
        return self._rotation.best(free, lambda c: (c.kv_usage, c.load))

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        if not chains.free.any():
            return None
        extent = chains.load_extent()
        if extent is None:
            return None
        idlest, busiest = extent
        if busiest - idlest > self._settings.balance_abs_threshold and busiest > idlest * self._settings.balance_rel_threshold:
            return self._rotation.among(chains.least("load"))
        best_match = self._rotation.among(self._most_cached(chains))
        blocks = len(request.block_hashes)
        if (chains.cached.get(best_match, 0) / blocks if blocks else 0.0) > self._settings.match_threshold:
            return best_match
        return self._rotation.among(chains.least("kv_usage", "load"))

    @staticmethod
    def _most_cached(chains: Decision) -> list[int]:
        """The free rows of least (-cached blocks, load), in row order: `choose`'s best match."""
        free = chains.free
        most = max((blocks for row, blocks in chains.cached.items() if free[row]), default=0)
        if most == 0:  # every free row caches nothing: load alone decides
            return chains.least("load")
        rows = sorted(row for row, blocks in chains.cached.items() if blocks == most and free[row])
        load = chains.index.load
        lowest = min(load.item(row) for row in rows)
        return [row for row in rows if load.item(row) == lowest]


class KvCost:
    """Least `overlap_weight * prefill blocks after overlap + decode blocks` (Dynamo's KV router)."""

    name = "kv_cost"
    cache_hold_share = 0.0
    bounds_backlog = False
    fast_forwards = 0

    def __init__(self, settings: KvCostSettings) -> None:
        self._overlap_weight = settings.overlap_weight
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = snapshot.free()
        if not free:
            return None
        return self._rotation.best(free, lambda c: self.cost(request, c))

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        tied = chains.least_kv_cost(request.prompt_tokens, request.max_tokens, self._overlap_weight)
        return self._rotation.among(tied) if tied else None

    def cost(self, request: RouteRequest, chain: ChainState) -> float:
        block_size = chain.node.block_size
        prompt_blocks = math.ceil(request.prompt_tokens / block_size)
        new_blocks = math.ceil((request.prompt_tokens + request.max_tokens) / block_size)
        prefill_blocks = max(0, prompt_blocks - chain.cached_blocks)
        # Reservations the last heartbeat does not show yet hold blocks too.
        unseen = max(0, chain.in_flight - chain.node.running - chain.node.waiting)
        decode_blocks = chain.node.kv_blocks_used + (unseen + 1) * new_blocks
        return (self._overlap_weight * prefill_blocks + decode_blocks) / chain.node.health_weight


class ScoreBased:
    """`-w_l*load + w_c*cache_affinity + w_f*resource_fit`, fast-forwarding to the cache node while it is not busy.

    `load = 0.4*utilisation + 0.3*queue/10`. Every fast-forward is counted
    (`fast_forwards`) and logged at debug.
    """

    name = "score"
    cache_hold_share = 0.0
    bounds_backlog = False

    def __init__(self, settings: ScoreSettings) -> None:
        self._settings = settings
        self._rotation = Rotation()
        self.fast_forwards = 0

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = snapshot.free()
        if not free:
            return None
        best = self._rotation.best(free, lambda c: -self.score(request, c, snapshot))
        cache_node = max(free, key=lambda c: c.cached_blocks)
        if cache_node.cached_blocks > 0 and cache_node is not best and cache_node.cached_blocks > best.cached_blocks:
            if cache_node.utilisation < self._settings.fast_forward_utilisation:
                self.fast_forwards += 1
                log.debug(
                    "fast_forward", request_id=request.request_id, to=cache_node.worker_id, instead_of=best.worker_id,
                    utilisation=round(cache_node.utilisation, 3), cached_blocks=cache_node.cached_blocks,
                )
                return cache_node
        return best

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        s = self._settings
        tied = chains.best_scored(request.prompt_tokens, request.max_tokens, len(request.block_hashes),
                                  s.load_weight, s.cache_weight, s.fit_weight)
        if not tied:
            return None
        best = self._rotation.among(tied)
        free = chains.free
        # `max` over the free chains by cached blocks: the first of the most cached, in row order.
        cache_node, most = best, 0
        for row, blocks in chains.cached.items():
            if free[row] and (blocks > most or (blocks == most and row < cache_node)):
                cache_node, most = row, blocks
        if most > 0 and cache_node != best and most > chains.cached.get(best, 0):
            utilisation = chains.index.utilisation.item(cache_node)
            if utilisation < s.fast_forward_utilisation:
                self.fast_forwards += 1
                log.debug(
                    "fast_forward", request_id=request.request_id, to=chains.state(cache_node).worker_id,
                    instead_of=chains.state(best).worker_id, utilisation=round(utilisation, 3), cached_blocks=most,
                )
                return cache_node
        return best

    def score(self, request: RouteRequest, chain: ChainState, snapshot: ClusterSnapshot) -> float:
        s = self._settings
        queue = chain.node.waiting + chain.node.growth_penalty
        load = (0.4 * chain.utilisation + 0.3 * queue / 10) / chain.node.health_weight
        need = max(1, math.ceil((request.prompt_tokens + request.max_tokens) / chain.node.block_size) - chain.cached_blocks)
        free_blocks = max(0, chain.node.kv_blocks_total - chain.node.kv_blocks_used)
        fit = 0.5 * min(1.0, free_blocks / need) + 0.5 * chain.free_slots / max(1, chain.node.slots_total)
        return -s.load_weight * load + s.cache_weight * match_ratio(chain, snapshot) + s.fit_weight * fit
