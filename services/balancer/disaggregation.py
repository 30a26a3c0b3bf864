"""Which prefill node, if any, runs a request's prompt (pure).

The routing policy picks the node that generates (an aggregated node, or
a decode node whose slots bound what the chain may run). For a decode
node this step completes the chain:

* conditional disaggregation: when the prompt part the decode node lacks
  in its prefix cache is shorter than `min_remote_prefill_tokens`, the
  decode node prefills it itself (the hand-off would cost more than it
  saves, as Dynamo and llm-d also decide);
* otherwise the prefill node that would finish the prompt first: its
  backlog of prefill work plus the prompt part it does not hold cached,
  at its own step time and measured speed. Prefill nodes are a pipeline stage, not slot
  holders: their KV is held only until the decode node pulls it.

No live prefill node means local prefill: a chain degrades to one node
rather than failing.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.balancer.snapshot import ChainState


def prefill_finish_s(candidate: ChainState, prompt_tokens: int) -> float:
    """When `candidate` would have prefilled the prompt, from now."""
    return candidate.prefill_backlog_s + candidate.uncached_tokens(prompt_tokens) * candidate.node.model.b


def choose_prefill(
    chain: ChainState,
    prompt_tokens: int,
    candidates: Sequence[ChainState],
    min_remote_prefill_tokens: int,
) -> ChainState | None:
    """The prefill node for a request placed on `chain`; None: `chain` runs it all."""
    if chain.node.role != "decode" or not candidates:
        return None
    if chain.uncached_tokens(prompt_tokens) < min_remote_prefill_tokens:
        return None
    # Idle nodes all finish "now": the one with less in hand wins, not the first by name.
    return min(candidates, key=lambda c: (prefill_finish_s(c, prompt_tokens),
                                          c.node.running + c.node.waiting, c.worker_id))
