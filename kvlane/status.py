"""`kvlane status`: ask a balancer for its view and print it as tables."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import nats.errors
from rich.console import Console
from rich.table import Table

from contracts import subjects
from contracts.balancer import BalancerStatus, BalancerStatusReply, BalancerStatusRequest


class StatusError(RuntimeError):
    pass


async def fetch_status(nats_url: str, model: str = "", timeout: float = 5.0) -> BalancerStatus:
    try:
        nc = await asyncio.wait_for(
            nats.connect(nats_url, connect_timeout=timeout, allow_reconnect=False, error_cb=_quiet), timeout
        )
    except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
        raise StatusError(f"cannot reach NATS at {nats_url}: {exc!r}") from exc
    try:
        payload = msgspec.msgpack.encode(BalancerStatusRequest(model=model))
        try:
            msg = await nc.request(subjects.BALANCER_STATUS, payload, timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise StatusError("no balancer is running") from exc
        except nats.errors.TimeoutError as exc:
            raise StatusError(f"no balancer answered within {timeout:.0f}s") from exc
    finally:
        await nc.close()
    reply = msgspec.msgpack.decode(msg.data, type=BalancerStatusReply)
    if not isinstance(reply, BalancerStatus):
        raise StatusError(f"balancer error: {reply.message}")
    return reply


async def _quiet(exc: Exception) -> None:
    # fetch_status reports the failure itself, once.
    return None


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}s"


def render_status(status: BalancerStatus, console: Console) -> None:
    nodes = Table(title=f"kvlane nodes (policy {status.policy}, slots in {status.slot_store})")
    for column in ("worker", "role", "running", "waiting", "slots", "kv used", "speed", "health", "queue growth", "req/s per slot"):
        nodes.add_column(column, justify="left" if column == "worker" else "right")
    for chain in status.chains:
        speed = f"{chain.speed:.2f}x" + ("" if chain.speed_measured else " (assumed)")
        nodes.add_row(
            chain.worker_id, chain.role, str(chain.running), str(chain.waiting), f"{chain.slots_used}/{chain.slots_total}",
            f"{chain.kv_usage:.0%}", speed, f"{chain.health_weight:.2f}", f"{chain.queue_growth_per_s:+.2f}/s",
            f"{chain.rate_per_slot:.2f}",
        )
    console.print(nodes)
    summary = Table(title=f"balancer {status.balancer_id}", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    queue = ", ".join(f"p{q.priority}: {q.length}" for q in status.queue) or "empty"
    rows = [
        ("central queue", f"{status.queue_length} ({queue})"),
        ("oldest wait", f"{status.oldest_wait_s:.2f}s"),
        ("arrivals", f"{status.arrival_rate_per_s:.2f}/s"),
        ("reservations held here", str(status.reservations_held)),
        ("fast-forwards", str(status.fast_forwards)),
        ("JFFC mean response, lower bound", _seconds(status.bound_lower_s)),
        ("JFFC mean response, upper bound", _seconds(status.bound_upper_s)),
        (
            "recommended slots per chain",
            "n/a" if status.recommended_slots_per_chain is None
            else f"{status.recommended_slots_per_chain} (lower bound {_seconds(status.recommended_lower_s)})",
        ),
    ]
    for row in rows:
        summary.add_row(*row)
    console.print(summary)
