"""`kvlane status`: ask every balancer replica for its view and print it as tables."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import nats
import nats.errors
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from contracts import subjects
from contracts.balancer import BalancerStatus, BalancerStatusReply, BalancerStatusRequest
from shared.config import NatsSettings
from shared.credentials import nats_options


class StatusError(RuntimeError):
    pass


async def fetch_statuses(
    nats_url: str | NatsSettings, model: str = "", timeout: float = 5.0, settle_s: float = 0.3
) -> list[BalancerStatus]:
    """Every balancer replica's status, by balancer id (`nats_url`: a URL, or settings with credentials).

    Replicas answer one broadcast; nothing says how many there are, so once
    the first has answered the others get `settle_s` more (they answer within
    milliseconds of each other unless one is stuck).
    """
    settings = NatsSettings(url=nats_url) if isinstance(nats_url, str) else nats_url
    try:
        nc = await asyncio.wait_for(
            nats.connect(**nats_options(settings), connect_timeout=timeout, allow_reconnect=False, error_cb=_quiet), timeout
        )
    except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
        raise StatusError(f"cannot reach NATS at {settings.url}: {exc!r}") from exc
    replies: list[BalancerStatusReply] = []
    try:
        inbox = nc.new_inbox()
        subscription = await nc.subscribe(inbox)
        await nc.publish(subjects.BALANCER_STATUS_ALL, msgspec.msgpack.encode(BalancerStatusRequest(model=model)), reply=inbox)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(nats.errors.TimeoutError):
                msg = await subscription.next_msg(timeout=left if not replies else min(left, settle_s))
                if (msg.headers or {}).get("Status") == "503":
                    raise StatusError("no balancer is running")
                replies.append(msgspec.msgpack.decode(msg.data, type=BalancerStatusReply))
                continue
            break
    finally:
        await nc.close()
    if not replies:
        raise StatusError(f"no balancer answered within {timeout:.0f}s")
    statuses = sorted((r for r in replies if isinstance(r, BalancerStatus)), key=lambda s: s.balancer_id)
    if not statuses:
        raise StatusError(f"balancer error: {replies[0].message}")
    return statuses


async def _quiet(exc: Exception) -> None:
    # fetch_statuses reports the failure itself, once.
    return None


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}s"


def status_tables(statuses: list[BalancerStatus]) -> Group:
    """The nodes as the first replica sees them (all share the slot store and the heartbeats), then each replica's own figures."""
    first = statuses[0]
    nodes = Table(title=f"kvlane nodes (policy {first.policy}, slots in {first.slot_store})")
    for column in ("worker", "role", "running", "waiting", "slots", "kv used", "speed", "health", "queue growth", "req/s per slot"):
        nodes.add_column(column, justify="left" if column == "worker" else "right")
    for chain in first.chains:
        speed = f"{chain.speed:.2f}x" + ("" if chain.speed_measured else " (assumed)")
        nodes.add_row(
            chain.worker_id, chain.role, str(chain.running), str(chain.waiting), f"{chain.slots_used}/{chain.slots_total}",
            f"{chain.kv_usage:.0%}", speed, f"{chain.health_weight:.2f}", f"{chain.queue_growth_per_s:+.2f}/s",
            f"{chain.rate_per_slot:.2f}",
        )
    balancers = Table(title=f"{len(statuses)} balancer replica(s)")
    balancers.add_column("what")
    for status in statuses:
        balancers.add_column(status.balancer_id, justify="right")

    def recommended(status: BalancerStatus) -> str:
        if status.recommended_slots_per_chain is None:
            return "n/a"
        return f"{status.recommended_slots_per_chain} (lower bound {_seconds(status.recommended_lower_s)})"

    rows = {
        "policy": lambda s: s.policy,
        "central queue": lambda s: f"{s.queue_length} ({', '.join(f'p{q.priority}: {q.length}' for q in s.queue) or 'empty'})",
        "oldest wait": lambda s: f"{s.oldest_wait_s:.2f}s",
        "arrivals": lambda s: f"{s.arrival_rate_per_s:.2f}/s",
        "reservations held here": lambda s: str(s.reservations_held),
        "fast-forwards": lambda s: str(s.fast_forwards),
        "JFFC mean response, lower bound": lambda s: _seconds(s.bound_lower_s),
        "JFFC mean response, upper bound": lambda s: _seconds(s.bound_upper_s),
        "recommended slots per chain": recommended,
    }
    for what, cell in rows.items():
        balancers.add_row(what, *(cell(status) for status in statuses))
    return Group(nodes, balancers)


def render_status(statuses: list[BalancerStatus], console: Console) -> None:
    console.print(status_tables(statuses))


async def watch_status(nats_url: str | NatsSettings, model: str, timeout: float, interval_s: float, console: Console) -> None:
    """Refresh the tables in place every `interval_s` until interrupted; a failed fetch shows as a line, and the watch goes on."""
    with Live(console=console, auto_refresh=False) as live:
        while True:
            try:
                shown = status_tables(await fetch_statuses(nats_url, model, timeout))
            except StatusError as exc:
                shown = f"[red]{exc}[/] (retrying every {interval_s:g}s)"
            live.update(shown, refresh=True)
            await asyncio.sleep(interval_s)
