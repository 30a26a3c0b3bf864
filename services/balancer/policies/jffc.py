"""Join-the-Fastest-Free-Chain, with chain speed or with per-request completion time.

Both only ever pick a chain with a free slot (None otherwise: the request
waits in the central queue), which keeps JFFC work-conserving; that is what
its throughput optimality rests on. Waiting for a busy chain that would be
faster for this request (say, the one holding its cache) is deliberately
not done: a wrong estimate of when that chain frees would leave the request
waiting beside an idle slot.
"""

from __future__ import annotations

import numpy as np

from contracts.messages import RouteRequest
from services.balancer.chain_index import Decision
from services.balancer.policies.base import Rotation
from services.balancer.snapshot import ChainState, ClusterSnapshot


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

    def __init__(self) -> None:
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = snapshot.free()
        if not free:
            return None
        return self._rotation.best(free, lambda c: (-c.node.speed, c.load, -c.node.health_weight))

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        if not len(chains.free_rows):
            return None
        index = chains.index
        return self._rotation.among(chains.lowest(-index.speed, index.load, -index.health))


class JffcPerRequest:
    """The free chain where THIS request costs least: its own completion, plus the delay it imposes.

    Expected completion = queue wait (no slot wait: only free chains
    qualify; but the prefill backlog this balancer already sent there, which
    delays this request's first token) + prefill(uncached prompt tokens) +
    decode(output tokens at the chain's batch once it joins), at each node's
    own step time and measured speed. A two-node chain is costed as two
    nodes: the prefill node's backlog and prompt, then the KV transfer over
    the link (`remote_prefill_s`), then decode on the decode node.
    Imposed delay: what its prefill and decode steps add to the requests
    already running there (`StepModel.imposed_seconds`), times
    `imposed_delay_weight`; without it a request takes the node where it
    alone finishes first even when that slows a full batch. The sum is
    divided by the node's health weight.
    """

    name = "jffc_per_request"

    def __init__(self, imposed_delay_weight: float = 1.0) -> None:
        self._imposed_weight = imposed_delay_weight
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = snapshot.free()
        if not free:
            return None
        return self._rotation.best(free, lambda c: self.expected_seconds(request, c))

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        if not len(chains.free_rows):
            return None
        return self._rotation.among(chains.lowest(self.expected_seconds_indexed(request, chains)))

    def expected_seconds_indexed(self, request: RouteRequest, chains: Decision) -> np.ndarray:
        """`expected_seconds` of every row at once: the same operations in the same order, on columns.

        Kept equal to it value for value (tests/unit/test_chain_index.py);
        busy rows get a figure too, which costs less than selecting the free ones first.
        """
        index = chains.index
        prompt, output = request.prompt_tokens, request.max_tokens
        a, b = index.a, index.b
        # StepModel.request_seconds at factor 1, with `a + c * batch` kept per row. Rows caching none
        # of the prompt prefill all of it; the few that cache some are priced one by one.
        prefill_cost = b * prompt  # b * uncached tokens
        prefill = a + prefill_cost if prompt > 0 else np.zeros(len(a))
        for row, uncached in chains.uncached_tokens(prompt).items():
            prefill_cost[row] = b[row] * uncached
            prefill[row] = a[row] + prefill_cost[row] if uncached > 0 else 0.0
        # Without a KV term on any node (d = 0), `x + d * kv` is x: those operations are skipped.
        kv_term = index.has_kv_term()
        if kv_term:
            kv_tokens = (index.kv_tokens + prompt) + output / 2
            decode = output * (index.step_at_batch + index.d * kv_tokens)
        else:
            decode = output * index.step_at_batch
        seconds = ((index.per_request + prefill) if index.has_overhead() else prefill) + decode
        backlog_s = chains.backlog_s()
        if backlog_s is not None:
            seconds = backlog_s + seconds
        if self._imposed_weight:
            # StepModel.imposed_seconds: none on an idle node.
            per_decode_step = index.c + index.d * (prompt + output / 2) if kv_term else index.c
            imposed = index.present * (prefill_cost + per_decode_step * output / 2)
            if self._imposed_weight != 1.0:
                imposed = self._imposed_weight * imposed
            seconds = seconds + np.where(index.busy, imposed, 0.0)
        return seconds / index.health if index.has_weights() else seconds

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
        return seconds / node.health_weight
