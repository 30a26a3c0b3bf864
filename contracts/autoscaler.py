"""What the autoscaler reads and decides (msgpack on NATS, JSON in Redis)."""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

from msgspec import Meta, Struct

from contracts.messages import NonNegativeInt, RequestId, WorkerRegistration

Pool = Literal["aggregated", "prefill", "decode"]
POOLS: tuple[Pool, ...] = ("aggregated", "prefill", "decode")
NonNegativeSeconds = Annotated[float, Meta(ge=0.0)]


class PoolKey(NamedTuple):
    """A pool is one base model's workers of one role: two models in one fleet never scale, or count, as one."""

    model: str
    role: Pool


class RequestServed(Struct, tag="served", tag_field="type", omit_defaults=True):
    """Published by the ingress once per request it answered: the latencies its client saw."""

    request_id: RequestId
    model: str
    # None: no token came (an error before the first one).
    ttft_s: NonNegativeSeconds | None
    e2e_s: NonNegativeSeconds
    output_tokens: NonNegativeInt
    # Mean time per output token after the first (None with fewer than two tokens).
    tpot_s: NonNegativeSeconds | None = None
    queued_s: NonNegativeSeconds = 0.0


class PoolDecision(Struct):
    pool: Pool
    current: NonNegativeInt
    desired: NonNegativeInt
    # The pool's worst signal over its target (1.0: exactly at target) over the stable and panic windows.
    pressure: float
    panic_pressure: float
    # The signal behind `pressure` (ttft, tpot, kv_usage, waiting) and why the count changed or not.
    signal: str
    reason: str
    panic: bool = False
    # The base model whose workers form the pool ("": a decision from before pools were per model, which knew
    # one model only: the fleet's).
    model: str = ""

    @property
    def key(self) -> PoolKey:
        return PoolKey(self.model, self.pool)


class ScalingDecision(Struct, tag="scaling", tag_field="type"):
    autoscaler_id: str
    decided_at: float
    pools: list[PoolDecision]
    # The models of pools that may scale to zero (min = 0), one registration each, the last a worker of the model
    # sent: while no worker serves such a model, ingresses take its requests as that registration says and
    # balancers hold them until a worker registers (`ScaleUpWanted` wakes the autoscaler).
    from_zero: list[WorkerRegistration] = []

    def desired(self) -> dict[PoolKey, int]:
        return {p.key: p.desired for p in self.pools}


class ScaleUpWanted(Struct, tag="scale_up_wanted", tag_field="type"):
    """Published by a balancer holding requests for `model`, which no worker serves now: its pool is to leave zero.

    Sent when the first such request arrives and again while any waits, so one lost or sent before the
    autoscaler started still wakes it.
    """

    model: str
    held: NonNegativeInt
    balancer_id: str = ""
