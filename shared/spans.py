"""kvlane's own span attributes (`kvlane.*`) for what several services describe alike."""

from __future__ import annotations

from opentelemetry.trace import Span

from contracts.cache import Allocation
from contracts.messages import ErrorReply
from shared.telemetry import set_error


def annotate_allocation(span: Span, allocation: Allocation | ErrorReply, source: str, block_size: int | None,
                        lease_ttl_s: float | None = None) -> None:
    """What a KV allocation reserved (or why it did not), on its span."""
    span.set_attribute("kvlane.kv.source", source)
    if isinstance(allocation, ErrorReply):
        set_error(span, allocation.code, allocation.message)
        return
    attributes = {
        "kvlane.worker.id": allocation.worker_id,
        "kvlane.kv.blocks": allocation.blocks,
        "kvlane.kv.cached_blocks": allocation.cached_blocks,
        "kvlane.kv.pool": allocation.pool,
        "kvlane.kv.lease_ttl_s": allocation.lease_ttl_s,
    }
    if block_size:
        attributes["kvlane.kv.tokens"] = allocation.blocks * block_size  # token room reserved
    if lease_ttl_s is not None:
        attributes["kvlane.kv.lease_ttl_s"] = lease_ttl_s
    if allocation.preempted:
        attributes["kvlane.kv.preempted"] = allocation.preempted
    span.set_attributes(attributes)
