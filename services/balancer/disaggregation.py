"""Which prefill node, if any, runs a request's prompt (pure).

The routing policy picks the node that generates (an aggregated node, or
a decode node whose slots bound what the chain may run). For a decode
node this step completes the chain:

* conditional disaggregation: when the prompt part the decode node lacks
  in its prefix cache is shorter than `min_remote_prefill_tokens`, the
  decode node prefills it itself (the hand-off would cost more than it
  saves, as Dynamo and llm-d also decide);
* otherwise the prefill node that would have the prompt ready on the
  decode node first: its backlog of prefill work plus the prompt part it
  does not hold cached, at its own step time and measured speed, then the
  prompt's KV over the slower of the two nodes' links. Prefill nodes are a
  pipeline stage, not slot holders: their KV is held only until the decode
  node pulls it.

No live prefill node means local prefill: a chain degrades to one node
rather than failing. So does a saturated prefill pool: when the best
prefill node would have the prompt ready only after
`prefill_saturated_s`, and the decode node itself sooner, the decode node
prefills it rather than queueing behind the pool.

The KV transfer counts the whole prompt (and any output a resumed request
carries), as the decode node pulls it all.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.balancer.snapshot import ChainState
from shared.config import DisaggregationSettings
from shared.kv.links import hand_off_seconds


def prefill_finish_s(candidate: ChainState, prompt_tokens: int) -> float:
    """When `candidate` would have prefilled the prompt, from now."""
    return candidate.prefill_backlog_s + candidate.uncached_tokens(prompt_tokens) * candidate.node.model.b


def kv_transfer_s(prefill: ChainState, decode: ChainState, prompt_tokens: int, settings: DisaggregationSettings) -> float:
    """Seconds the prompt's KV takes from `prefill` to `decode` (0 when not costed or not known)."""
    if not settings.cost_kv_transfer:
        return 0.0
    return hand_off_seconds(prompt_tokens, prefill.node.kv_transfer, decode.node.kv_transfer)


def remote_prompt_ready_s(prefill: ChainState, decode: ChainState, prompt_tokens: int, settings: DisaggregationSettings) -> float:
    """When the decode node would hold the prompt's KV, from now, if `prefill` runs the prompt."""
    return prefill_finish_s(prefill, prompt_tokens) + kv_transfer_s(prefill, decode, prompt_tokens, settings)


def choose_prefill(
    chain: ChainState,
    prompt_tokens: int,
    candidates: Sequence[ChainState],
    settings: DisaggregationSettings,
) -> ChainState | None:
    """The prefill node for a request placed on `chain`; None: `chain` runs it all."""
    if chain.node.role != "decode" or not candidates:
        return None
    if chain.uncached_tokens(prompt_tokens) < settings.min_remote_prefill_tokens:
        return None
    # Idle nodes all finish "now": the one with less in hand wins, not the first by name.
    best = min(candidates, key=lambda c: (remote_prompt_ready_s(c, chain, prompt_tokens, settings),
                                          c.node.running + c.node.waiting, c.worker_id))
    if settings.local_prefill_when_saturated and prefill_saturated(best, chain, prompt_tokens, settings):
        return None
    return best


def prefill_saturated(best: ChainState, chain: ChainState, prompt_tokens: int, settings: DisaggregationSettings) -> bool:
    """Whether even the best prefill node is backed up past `prefill_saturated_s`, and `chain` would have the prompt sooner itself."""
    remote = remote_prompt_ready_s(best, chain, prompt_tokens, settings)
    return remote > settings.prefill_saturated_s and prefill_finish_s(chain, prompt_tokens) < remote
