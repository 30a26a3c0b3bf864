"""What the autoscaler reads and decides (msgpack on NATS, JSON in Redis)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from contracts.messages import NonNegativeInt, RequestId

Pool = Literal["aggregated", "prefill", "decode"]
POOLS: tuple[Pool, ...] = ("aggregated", "prefill", "decode")
NonNegativeSeconds = Annotated[float, Meta(ge=0.0)]


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


class ScalingDecision(Struct, tag="scaling", tag_field="type"):
    autoscaler_id: str
    decided_at: float
    pools: list[PoolDecision]

    def desired(self) -> dict[str, int]:
        return {p.pool: p.desired for p in self.pools}
