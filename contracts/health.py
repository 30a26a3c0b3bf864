"""Health verdicts and client feedback (msgpack on NATS, JSON in Redis)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from contracts.messages import EpochSeconds, RequestId, WorkerId

HealthState = Literal["healthy", "suspect", "unhealthy"]
FeedbackKind = Literal["error", "timeout", "slow"]


class NodeFeedback(Struct, tag="feedback", tag_field="type"):
    """A client-side observation about one node (published by ingress)."""

    worker_id: WorkerId
    kind: FeedbackKind
    request_id: RequestId | None = None
    detail: str = ""
    # When the process complained about started (`GenerateAccepted.started_at`, or `RouteDecision.started_at` for a
    # node that never answered; 0: not known): a complaint about a process since restarted is not held against the new one.
    started_at: EpochSeconds = 0.0


class HealthVerdict(Struct, tag="verdict", tag_field="type"):
    worker_id: WorkerId
    state: HealthState
    # Multiplies the node's attractiveness in routing: 1 healthy, 0 unhealthy.
    weight: Annotated[float, Meta(ge=0.0, le=1.0)]
    reason: str
    since: float
    probe_latency_s: float | None = None
    baseline_latency_s: float | None = None
    feedback_in_window: int = 0
