"""The most any routing could serve: a throughput ceiling for one workload on one fleet.

Capacity is measured per policy; this says how far above the best of them a
perfect router could go. It is built from two floors, each generous to the
router, so that no policy on the simulated fleet can pass it:

* A prompt's uncached tokens (`PrefixOracle`): at least those not computed
  before by any earlier request anywhere in the fleet, as if every node held
  every block any node ever computed. A block counts once an earlier request
  started with it in its prompt, or ended with it in its prompt and output
  (the next turn of a conversation); at least one token is always computed,
  as the engine does.
* A node's seconds for a request (`request_seconds`): the request's own terms
  of the step-time model (its uncached prefill, the context it attends at
  each step, its decode) plus its share of the steps' fixed cost. A step
  runs at most `max_num_seqs` sequences besides those that finish in it (the
  scheduler admits into the slots that frees within the step), so the steps
  number at least the sum of (output tokens - 1) over `max_num_seqs`.
  Queueing, preemption, chunked prefill and the TTFT and TPOT targets only
  add to it.
* A LoRA adapter's loads (`PrefixOracle`, `NodeCost.adapter_load_s`): every
  adapter is fetched into some node's host memory and copied into a batch
  slot at least once, since every node starts without any, and the batch
  waits for it; so the first request of each adapter in the run carries
  one full load (`Served.adapter_loads`). Later loads depend on how
  requests interleave on the slots; a perfect router is granted none.
  Adapter KV is the adapter's own: prompts chain from its root
  (`shared.kv.block_hash.adapter_root`), so no prefix is shared across
  adapters.

The fleet's ceiling is the rate at which its node-seconds cover those floors
when each request runs on whichever kind of node suits it: the linear
program min T such that every kind's nodes finish their share within T. It
is bounded from its dual, any weighting `z` of the kinds giving a valid
lower bound on T (`_dual_seconds`), so the ceiling stays an upper bound
however loosely `z` is searched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from shared.kv.block_hash import adapter_root, chained_block_hashes
from shared.kv.step_profile import StepTimeProfile


@dataclass(frozen=True)
class Served:
    """One request as the ceiling sees it."""

    request_id: str
    scheduled_s: float  # when the workload scheduled it (the warm-up is judged on this)
    prompt_tokens: int
    uncached_tokens: int  # the oracle's floor, 1 to prompt_tokens
    output_tokens: int
    adapter_loads: int = 0  # 1 for the first request of its LoRA adapter in the run: its load is this request's


@dataclass(frozen=True)
class NodeCost:
    """A kind of node, as the ceiling costs it: its step-time terms, batch bound and how many there are."""

    profile: StepTimeProfile
    speed: float
    max_num_seqs: int
    count: int
    step_overhead_s: float = 0.0  # wall time each step takes beyond the profile's (`Latencies.step_overhead_s`)
    # Profile seconds one LoRA adapter's load takes from storage into a batch slot (the step waits for it).
    adapter_load_s: float = 0.0


class PrefixOracle:
    """The fewest uncached tokens each prompt could have, whatever node it ran on, and the LoRA adapter loads
    no routing avoids (each adapter's first)."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._block_size = block_size
        self._seen: set[int] = set()
        self._uncached: dict[str, int] = {}
        self._adapters_seen: set[str] = set()
        self._first_of_adapter: set[str] = set()

    def started(self, request_id: str, block_hashes: Sequence[int], prompt_tokens: int, adapter: str = "") -> None:
        """`block_hashes` chain from `adapter`'s root when it has one (as ingress computes them)."""
        if adapter and adapter not in self._adapters_seen:
            self._adapters_seen.add(adapter)
            self._first_of_adapter.add(request_id)
        seen = self._seen
        hits = 0
        for value in block_hashes:
            if value not in seen:
                break
            hits += 1
        self._uncached[request_id] = max(1, prompt_tokens - hits * self._block_size)
        seen.update(block_hashes)

    def ended(self, request_id: str, scheduled_s: float, prompt_token_ids: Sequence[int],
              block_hashes: Sequence[int], output: Sequence[int], adapter: str = "") -> Served:
        """The request ran to its end: its output's blocks may serve later prompts."""
        size = self._block_size
        parent = block_hashes[-1] if block_hashes else adapter_root(adapter) if adapter else None
        tail = list(prompt_token_ids[len(block_hashes) * size:]) + list(output)
        self._seen.update(chained_block_hashes(tail, size, parent))
        # A first request that failed leaves its load uncounted: the bound only loosens.
        first = request_id in self._first_of_adapter
        self._first_of_adapter.discard(request_id)
        return Served(request_id, scheduled_s, len(prompt_token_ids), self._uncached.pop(request_id), len(output),
                      int(first))


def request_seconds(kind: NodeCost, request: Served) -> float:
    """A floor on the seconds one node of `kind` is busy with `request` (see the module doc)."""
    p, length, out = kind.profile, request.prompt_tokens, request.output_tokens
    # Its last prefill chunk attends the whole prompt and emits the first token; decode step j attends length + j.
    attended = out * length + out * (out - 1) // 2
    own = (p.b * request.uncached_tokens + p.c * (out - 1) + p.d * attended + p.per_request
           + p.per_output_token * out + kind.adapter_load_s * request.adapter_loads) / kind.speed
    fixed = (p.a / kind.speed + kind.step_overhead_s) * (out - 1) / kind.max_num_seqs
    return own + fixed


def throughput_ceiling(kinds: Sequence[NodeCost], requests: Iterable[Served]) -> float:
    """Requests per second: the highest rate of `requests` (their mix, as given) the fleet of `kinds` could sustain."""
    kinds = [k for k in kinds if k.count > 0]
    if not kinds:
        raise ValueError("a fleet needs at least one node")
    seconds = np.array([[request_seconds(kind, r) for kind in kinds] for r in requests], dtype=float)
    if seconds.size == 0:
        raise ValueError("no requests to bound")
    counts = np.array([kind.count for kind in kinds], dtype=float)
    return len(seconds) / _dual_seconds(seconds, counts, _best_weights(seconds, counts))


def _dual_seconds(seconds: np.ndarray, counts: np.ndarray, weights: np.ndarray) -> float:
    """A lower bound on the time the fleet needs for all requests, for kind weights summing to 1.

    With y = weights / counts (so that sum(y * counts) = 1), any split x of the
    requests over the kinds that finishes within T has
    sum_r min_k y_k s_rk <= sum_k y_k sum_r x_rk s_rk <= sum_k y_k counts_k T = T.
    """
    return float((seconds * (weights / counts)).min(axis=1).sum())


def _best_weights(seconds: np.ndarray, counts: np.ndarray, sweeps: int = 4, steps: int = 48) -> np.ndarray:
    """Weights that make `_dual_seconds` large: golden-section moves of weight between pairs of kinds.

    The bound is concave in the weights; any weights give a valid bound, the search only tightens it.
    """
    kinds = len(counts)
    weights = np.full(kinds, 1.0 / kinds)
    if kinds == 1:
        return weights
    ratio = (5 ** 0.5 - 1) / 2
    for _ in range(sweeps if kinds > 2 else 1):
        for i in range(kinds):
            for j in range(i + 1, kinds):
                pool = weights[i] + weights[j]

                def value(share: float, i: int = i, j: int = j, pool: float = pool) -> float:
                    trial = weights.copy()
                    trial[i], trial[j] = share * pool, (1 - share) * pool
                    return _dual_seconds(seconds, counts, trial)

                low, high = 0.0, 1.0
                for _ in range(steps):
                    left, right = high - ratio * (high - low), low + ratio * (high - low)
                    if value(left) < value(right):
                        low = left
                    else:
                        high = right
                share = (low + high) / 2
                if value(share) >= value(weights[i] / pool if pool else 0.5):
                    weights[i], weights[j] = share * pool, (1 - share) * pool
    return weights
