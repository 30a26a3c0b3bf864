"""Join-the-Fastest-Free-Chain, with chain speed or with per-request completion time.

Both only ever pick a chain with a free slot (None otherwise: the request
waits in the central queue), which keeps JFFC work-conserving; that is what
its throughput optimality rests on. Waiting for a busy chain because it
would be faster for this request is not done on an estimate of when that
chain frees: a wrong one would leave the request waiting beside an idle
slot. The one wait there is, jffc_per_request's for a busy chain that
caches much more of the prompt, is bounded in time, not estimated.
"""

from __future__ import annotations

import numpy as np

from contracts.messages import RouteRequest
from services.balancer.chain_index import Decision
from services.balancer.policies.base import Rotation
from services.balancer.snapshot import ChainState, ClusterSnapshot
from shared.config import JffcPerRequestSettings


class Jffc:
    """The fastest chain with a free slot; equal speeds go to the less loaded (load per unit of health).

    Speeds come tiered (`trackers.speed_tiers`): identical nodes measure
    differently, and ranking on that noise would fill one of them before the
    next instead of sharing the load. A health verdict below 1 scales the
    node's load instead of its speed: a node that answered probes slowly
    because it is busy is not a slower kind of node, and ranking it below
    every healthy one would push still more load onto those until their
    probes slow down too. Speed itself is what the node measurably does.
    """

    name = "jffc"
    cache_hold_share = 0.0
    bounds_backlog = False
    fast_forwards = 0

    def __init__(self) -> None:
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = snapshot.free()
        if not free:
            return None
        return self._rotation.best(free, lambda c: (-c.node.speed, c.load, -c.node.health_weight))

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        tied = chains.least("-speed", "load", "-health")
        return self._rotation.among(tied) if tied else None


class JffcPerRequest:
    """The free chain where THIS request costs least: its own completion, plus the delay it imposes.

    Expected completion = queue wait (no slot wait: only free chains
    qualify; but the prefill backlog this balancer already sent there, which
    delays this request's first token) + prefill(uncached prompt tokens) +
    decode(output tokens at the chain's batch once it joins), at each node's
    own step time and measured speed. A two-node chain is costed as two
    nodes: the prefill node's backlog and prompt, then the KV transfer over
    the link (`remote_prefill_s`), then decode on the decode node.
    The router keeps a request waiting, briefly, for a busy chain that
    caches much more of its prompt than any free one (`cache_hold_share`,
    `Router.holds_for_cache`): the one exception to free chains only.
    Imposed delay: what its prefill and decode steps add to the requests
    already running there (`StepModel.imposed_seconds`), times
    `imposed_delay_weight`; without it a request takes the node where it
    alone finishes first even when that slows a full batch. A request with
    a LoRA adapter adds the adapter's load there (`ChainState.adapter_load_s`:
    none in a batch slot, a copy from host memory, or a fetch and load), and a
    request run on a prefix pulled from another node the pull's seconds
    (`ChainState.pull_s`, its `cached_blocks` counting the prefix).
    The sum is divided by the node's health weight.
    """

    name = "jffc_per_request"
    # The router offers it only free chains where the request's first token
    # (the prefill backlog, then its own uncached prompt) comes within
    # `Degradation.backlog_bound_s`: its own wait is part of its cost, but with
    # only free chains to compare it would still take a slot behind seconds of
    # prefill (a node busy with long prompts, or a slow one with its whole prompt
    # to prefill) over waiting briefly for another.
    bounds_backlog = True
    fast_forwards = 0

    def __init__(self, imposed_delay_weight: float = JffcPerRequestSettings().imposed_delay_weight,
                 cache_hold_share: float = JffcPerRequestSettings().cache_hold_share) -> None:
        self._imposed_weight = imposed_delay_weight
        # The router leaves a request queued for a busy node caching this much more of its prompt (`Router.holds_for_cache`).
        self.cache_hold_share: float = cache_hold_share
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = snapshot.free()
        if not free:
            return None
        return self._rotation.best(free, lambda c: self.expected_seconds(request, c))

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        tied = chains.cheapest(request.prompt_tokens, request.max_tokens, self._imposed_weight)
        return self._rotation.among(tied) if tied else None

    def expected_seconds_indexed(self, request: RouteRequest, chains: Decision) -> np.ndarray:
        """`expected_seconds` of every row at once (compiled; equal to it value for value, tests/unit/test_chain_index.py)."""
        return chains.request_seconds(request.prompt_tokens, request.max_tokens, self._imposed_weight)

    def expected_seconds(self, request: RouteRequest, chain: ChainState) -> float:
        node = chain.node
        if chain.remote_prefill_s is not None:
            # Two nodes: the prompt is ready when the prefill node has run it; this node only decodes.
            uncached, waiting_s = 0, chain.remote_prefill_s
        else:
            uncached, waiting_s = chain.uncached_tokens(request.prompt_tokens), chain.prefill_backlog_s
        present = chain.in_flight + node.growth_penalty
        seconds = waiting_s + node.model.request_seconds(
            uncached_tokens=uncached,
            prompt_tokens=request.prompt_tokens,
            output_tokens=request.max_tokens,
            batch=present + 1,
            node_kv_tokens=node.kv_blocks_used * node.block_size,
            factor=1.0,
        )
        if self._imposed_weight:
            seconds += self._imposed_weight * node.model.imposed_seconds(
                uncached_tokens=uncached, prompt_tokens=request.prompt_tokens, output_tokens=request.max_tokens,
                running=present,
            )
        return (seconds + chain.adapter_load_s + chain.pull_s) / node.health_weight
