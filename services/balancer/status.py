"""What `kvlane status` shows: chains, slots, queue, policy and the JFFC bounds (pure)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from contracts.balancer import BalancerStatus, ChainStatus, QueueClass
from contracts.messages import Heartbeat
from services.balancer.bounds import ChainRate, recommend_slots, response_bounds
from services.balancer.router import Router
from services.balancer.snapshot import GENERATING_ROLES, NodeFacts
from shared.config import SlotSettings


class SlotRates:
    """Per-slot service rate of a chain for a typical request, at a given occupancy."""

    def __init__(self, slots: SlotSettings) -> None:
        self._prompt = slots.typical_prompt_tokens
        self._output = slots.typical_output_tokens

    def rate(self, facts: NodeFacts, occupied_slots: int) -> float:
        batch = max(1, occupied_slots)
        seconds = facts.model.request_seconds(
            uncached_tokens=self._prompt,
            prompt_tokens=self._prompt,
            output_tokens=self._output,
            batch=batch,
            node_kv_tokens=(batch - 1) * (self._prompt + self._output / 2),
            factor=1.0,
        )
        return 1.0 / seconds if seconds > 0 else math.inf


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def build_status(
    *,
    balancer_id: str,
    slot_store: str,
    router: Router,
    heartbeats: Sequence[Heartbeat],
    rates: SlotRates,
    arrival_rate: float,
    now: float,
    fast_forwards: int,
    model: str = "",
    block_hashes: list[int] | None = None,
) -> BalancerStatus:
    cached = router.index.match(block_hashes, touch_blocks=False) if block_hashes else {}
    chains: list[ChainStatus] = []
    facts_by_chain: dict[str, NodeFacts] = {}
    for heartbeat in heartbeats:
        if model and heartbeat.registration.model != model:
            continue
        facts = router.builder.facts(heartbeat)
        facts_by_chain[facts.chain_id] = facts
        used = router.table.used(facts.chain_id)
        chains.append(
            ChainStatus(
                chain_id=facts.chain_id,
                worker_id=facts.worker_id,
                model=heartbeat.registration.model,
                role=facts.role,
                running=facts.running,
                waiting=facts.waiting,
                slots_used=used,
                slots_total=facts.slots_total if facts.role in GENERATING_ROLES else 0,
                kv_usage=facts.kv_blocks_used / facts.kv_blocks_total if facts.kv_blocks_total else 0.0,
                speed=facts.speed,
                speed_measured=facts.speed_measured,
                health_weight=facts.health_weight,
                queue_growth_per_s=facts.queue_growth_per_s,
                rate_per_slot=rates.rate(facts, facts.slots_total),
                cached_blocks=cached.get(facts.worker_id, 0),
            )
        )
    chains.sort(key=lambda c: c.worker_id)
    # Prefill nodes are listed but hold no slots: the bounds are over the chains that generate.
    generating = [c for c in chains if c.role in GENERATING_ROLES and c.health_weight > 0]
    status = BalancerStatus(
        balancer_id=balancer_id,
        policy=router.policy.name,
        slot_store=slot_store,
        chains=chains,
        queue=[QueueClass(p, n) for p, n in sorted(router.queue.lengths().items(), reverse=True)],
        queue_length=len(router.queue),
        queued_per_model=dict(Counter(entry.request.model for entry in router.queue.in_order())),
        oldest_wait_s=max(0.0, now - (router.queue.oldest_enqueued_at() or now)),
        arrival_rate_per_s=arrival_rate,
        reservations_held=len(router.table),
        fast_forwards=fast_forwards,
    )
    if not generating or arrival_rate <= 0:
        return status
    bounds = response_bounds([ChainRate(c.chain_id, c.slots_total, c.rate_per_slot) for c in generating], arrival_rate)
    status.bound_lower_s, status.bound_upper_s = _finite(bounds.lower_s), _finite(bounds.upper_s)
    recommendation = recommend_slots(
        [(c.chain_id, c.slots_total) for c in generating],
        lambda chain_id, slots: rates.rate(facts_by_chain[chain_id], slots),
        arrival_rate,
    )
    if recommendation is not None:
        status.recommended_slots_per_chain = recommendation[0]
        status.recommended_lower_s = _finite(recommendation[1].lower_s)
    return status
