"""The balancer's decisions around the routing core (pure, synchronous): events in, effects out.

Each event method (`route`, `confirmed`, `finished`, `withdrawn`, `tick`...)
updates the `Router` and returns the effects its caller carries out: replies
to route requests, reservations and releases in the global slot store, drains
of the central queue. The service carries them out over NATS and Redis, the
simulator against its in-memory stores; both feed the store's answers back
(`confirmed`, `released`, `counted`).

A route request is placed at once or queued. Each placement is a `Reserve`:
its slot (and KV lease) must be taken in the store. Refused, the placement
is undone, its chain taken as full, and the request placed again, at most
once per chain; a queued request is put back instead (`Requeued`), and the
caller drains the queue again once the pass's reservations are answered.
Every route request gets exactly one reply: `Placed` or `Refused`, at once
or, once it is `Waiting`, when a slot frees, its deadline passes, a higher
class takes its place, or the client withdraws it.

Effects are carried out in the order given. Of the effects of `route` and
`confirmed`, the last is the request's own (its reservation, reply or wait),
so a `Reserve` always comes last and its answer's effects follow it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Union

from msgspec import Struct

from contracts.health import HealthVerdict
from contracts.messages import ErrorReply, Heartbeat, KvEvents, RouteRequest
from services.balancer.central_queue import QueuedRequest
from services.balancer.from_zero import FromZero, WakeAutoscaler
from services.balancer.fair_share import SharedCounters, TenantCharge
from services.balancer.router import Placement, Queued, Router
from services.balancer.slot_store import worker_of

# --- effects ---------------------------------------------------------------------------------
# Not tracked by the garbage collector (`gc=False`): one or two per route request, and none is part of a cycle.


class Placed(Struct, gc=False):
    """Reply to the route request: run it on `placement` (its slot and lease are taken). `entry`: it had waited."""

    placement: Placement
    entry: QueuedRequest | None


class Refused(Struct, gc=False):
    """Reply to route request `request_id` with an error."""

    request_id: str
    reply: ErrorReply


class Waiting(Struct, gc=False):
    """The route request waits in the central queue: its reply comes with a later event."""

    entry: QueuedRequest


class Reserve(Struct, gc=False):
    """Take the placement's slot (and KV lease) in the global store, then tell `BalancerCore.confirmed`.

    `heartbeats`, `now`, `tries`: what placing the request again needs (admits still allowed after this one).
    """

    placement: Placement
    entry: QueuedRequest | None = None
    heartbeats: Sequence[Heartbeat] = ()
    now: float = 0.0
    tries: int = 0


class Requeued(Struct, gc=False):
    """A queued request's reservation was refused and it waits again: drain once more after this pass."""

    entry: QueuedRequest


class Release(Struct, gc=False):
    """The request is over: free its slot (and KV lease) in the store, then tell `BalancerCore.released`.

    `worker_id` None: this balancer placed it nowhere it knows of (a store that finds slots by node has nothing to free).
    """

    request_id: str
    worker_id: str | None
    chain_id: str | None


class ReleaseEarlier(Struct, gc=False):
    """The request routes again: free what its earlier attempt holds in the store, (request, node) pairs,
    with the chain of each where known. Nothing to report: the request is placed again at once."""

    releases: list[tuple[str, str]]
    chains: list[str | None] | None


class Abort(Struct, gc=False):
    """Tell the worker to stop the request (it may have been handed over before the client left)."""

    request_id: str
    worker_id: str


class Preempted(Struct, gc=False):
    """The request's KV lease was taken for another: it must leave its node (and is routed again)."""

    request_id: str


class NodesGone(Struct, gc=False):
    """Nodes that stopped heartbeating and are forgotten: whatever they held is void."""

    worker_ids: list[str]


class ReadUsage(Struct, gc=False):
    """Read the store's count of these chains' slots, then tell `BalancerCore.counted`."""

    chains: list[str]


class Charge(Struct, gc=False):
    """Add to a tenant's shared counter in the store (placed: its expected service; finished: the difference the
    output made). Nothing to report; a store shared by no other replica has nothing to do."""

    charge: TenantCharge


class Drain(Struct, gc=False):
    """Slots may have freed: call `BalancerCore.dispatch` soon (once for any number of these)."""


DRAIN = Drain()

Effect = Union[Placed, Refused, Waiting, Reserve, Requeued, Release, ReleaseEarlier, Abort, Preempted, NodesGone,
               ReadUsage, Charge, WakeAutoscaler, Drain]

_WITHDRAWN = ErrorReply(code="withdrawn", message="the client left", status=499)


class BalancerCore:
    """`routable(model)`: the model's nodes a request may go to now; `live()`: every live node, draining or not;
    `shares_counters`: the tenants' counters are shared with other replicas through the store (`Charge`)."""

    def __init__(self, router: Router, routable: Callable[[str], Sequence[Heartbeat]],
                 live: Callable[[], Sequence[Heartbeat]], from_zero: FromZero | None = None,
                 shares_counters: bool = False) -> None:
        self.router = router
        self._shares_counters = shares_counters and router.shares is not None
        # Models whose requests wait while no worker serves them (their pool scales from zero).
        self.from_zero = from_zero or FromZero()
        self._routable = routable
        self._live = live
        # Chains whose global count a reservation's reply gave since the last tick: the tick's read would tell no
        # more, so it reads only the others (under load, reading every chain was most of the tick).
        self._counted: set[str] = set()
        self.decisions = 0  # placement attempts: admits and queued requests placed
        self.kv_refusals = 0  # reservations refused for want of KV room
        self.expired = 0  # reservations dropped at their deadline or with their node

    # --- routing ---------------------------------------------------------------------------

    def route(self, request: RouteRequest, now: float) -> list[Effect]:
        """A route request, at `now` on this balancer's wall clock."""
        request_id = request.request_id
        if request.timeout_s <= 0:
            return [Refused(request_id, ErrorReply(code="deadline_exceeded", message="request deadline passed before routing",
                                                   status=504))]
        if request.hand_over is not None and (refusal := _bad_hand_over(request)) is not None:
            return [Refused(request_id, refusal)]
        router = self.router
        earlier = None
        if request.exclude_workers or router.table.holder(request_id) is not None:
            # Ingress routes again after failing to reach the chosen worker: free that slot first. The store finds
            # it through its node: the chain this balancer gave it, else whichever excluded worker it was on.
            chain_id = router.table.release(request_id)
            if chain_id is not None:
                earlier = ReleaseEarlier([(request_id, worker_of(chain_id))], [chain_id])
            else:
                earlier = ReleaseEarlier([(request_id, worker_id) for worker_id in request.exclude_workers], None)
        heartbeats = self._routable(request.model)
        # No worker serves the model, but its pool can start one: the request waits for it instead of a 404.
        from_zero = self.from_zero.holds(request.model, heartbeats)
        refusal = None if from_zero else router.unroutable(request, heartbeats, self._live)
        effects = [Refused(request_id, refusal)] if refusal is not None else self._admit(request, heartbeats, now, len(heartbeats) + 1)
        if from_zero and isinstance(effects[-1], Waiting):
            held = lambda: sum(1 for entry in router.queue.in_order() if entry.request.model == request.model)  # noqa: E731
            if (wake := self.from_zero.held(request.model, now, held)) is not None:
                effects.insert(len(effects) - 1, wake)
        if earlier is not None:
            effects.insert(0, earlier)
        return effects

    def _admit(self, request: RouteRequest, heartbeats: Sequence[Heartbeat], now: float, tries: int) -> list[Effect]:
        """Place or queue `request`, with `tries` placements allowed (each refused one marks a chain full)."""
        outcome = self.router.admit(request, heartbeats, now)
        self.decisions += 1
        if isinstance(outcome, Placement):
            return [Reserve(outcome, None, heartbeats, now, tries - 1)]
        if isinstance(outcome, Queued):
            if outcome.evicted is None:
                return [Waiting(outcome.entry)]
            evicted = outcome.evicted
            return [Refused(evicted.request_id, self.router.degradation.evicted_reply(evicted)), Waiting(outcome.entry)]
        return [Refused(request.request_id, outcome)]

    def confirmed(self, reserve: Reserve, taken: bool, used: int = -1, leased: bool = True,
                  preempted: Sequence[str] = ()) -> list[Effect]:
        """The store's reply to `reserve`: the slot `taken` or not, the chain's global count after (-1: unknown),
        the KV lease granted or not (a slot the store took without its lease it has given back), and the requests
        whose leases were taken to make room."""
        router = self.router
        placement, entry = reserve.placement, reserve.entry
        chain = placement.chain
        effects: list[Effect] = []
        for victim in preempted:
            router.table.release(victim)
            effects.append(Preempted(victim))
        if used >= 0:
            self._counted.add(chain.chain_id)
            if taken and leased:
                router.table.set_global_used(chain.chain_id, used)
        if taken and leased:
            shares = router.shares
            if shares is not None and (charge := shares.placed(placement.request)) is not None and self._shares_counters:
                effects.append(Charge(charge))
            effects.append(Placed(placement, entry))
            return effects
        if taken:
            # No KV room there now: the chain counts as full until the next usage refresh, which must read it.
            self.kv_refusals += 1
            router.undo(placement, chain.node.slots_total, entry)
            self._counted.discard(chain.chain_id)
        else:  # another balancer holds the chain's last slot
            router.undo(placement, used, entry)
        if entry is not None:
            effects.append(Requeued(entry))
        elif reserve.tries > 0:
            effects += self._admit(placement.request, reserve.heartbeats, reserve.now, reserve.tries)
        else:
            effects.append(Refused(placement.request_id, router.refusal("no_capacity", "other reservations took every free slot")))
        return effects

    def dispatch(self) -> list[Reserve]:
        """Free slots for queued requests: the reservations to make (`Drain`)."""
        placed = self.router.dispatch_queued(self._routable)
        self.decisions += len(placed)
        return [Reserve(placement, entry) for entry, placement in placed]

    def queue_deadline(self, entry: QueuedRequest) -> Refused:
        """`entry` waited until its deadline (the caller's own timer, between ticks): the reply."""
        self.router.queue.remove(entry.request_id)
        return Refused(entry.request_id, self._timed_out(entry, f"no slot freed within {entry.deadline - entry.enqueued_at:.1f}s"))

    # --- events ----------------------------------------------------------------------------

    def finished(self, request_id: str, worker_id: str, output_tokens: int | None = None) -> list[Effect]:
        """`RequestFinished` from `worker_id`, with the output it gave where known. The last effect is the `Release`."""
        router = self.router
        effects: list[Effect] = []
        if output_tokens is not None and router.shares is not None:
            # Before the slot is freed, which forgets what the request was charged.
            settled = router.shares.finished(request_id, output_tokens)
            if settled is not None and self._shares_counters:
                effects.append(Charge(settled))
        chain_id = router.finished(request_id, worker_id)
        if chain_id is None and router.table.holder(request_id) is not None and (
                self._is_prefill_node(worker_id) or router.pull_source(request_id) == worker_id):
            # A prefill node (or a prefix pull's source) ends a request only when it never handed it over: the slot
            # and the KV lease are its decode node's, which will never run it. (From any other node, this is the late
            # end of an attempt resumed elsewhere, whose slot and lease the resumed attempt holds.)
            chain_id = router.table.release(request_id)
            assert chain_id is not None
            worker_id = worker_of(chain_id)
        effects.append(Release(request_id, worker_id, chain_id))
        return effects

    def _is_prefill_node(self, worker_id: str) -> bool:
        return any(hb.registration.worker_id == worker_id and hb.registration.role == "prefill" for hb in self._live())

    def withdrawn(self, request_id: str) -> list[Effect]:
        """`RouteWithdrawn`: the client left (every balancer hears it: the one queueing it, the one holding its slot)."""
        effects: list[Effect] = []
        if self.router.queue.remove(request_id) is not None:
            effects.append(Refused(request_id, _WITHDRAWN))
        chain_id = self.router.table.release(request_id)
        if chain_id is None:
            # Not placed by this balancer: the one that placed it hears the same and knows its node.
            effects.append(Release(request_id, None, None))
            return effects
        worker_id = worker_of(chain_id)
        effects.append(Release(request_id, worker_id, chain_id))
        effects.append(Abort(request_id, worker_id))
        return effects

    def unanswered(self, request_id: str) -> list[Effect]:
        """The client stopped waiting for a reply that placed its request: free the slot."""
        chain_id = self.router.table.release(request_id)
        return [] if chain_id is None else [Release(request_id, worker_of(chain_id), chain_id)]

    def released(self, counts: Iterable[tuple[str, int] | None]) -> list[Effect]:
        """The store freed `Release`s: each chain's count after (None where it freed nothing)."""
        table = self.router.table
        for chain_used in counts:
            if chain_used is not None:
                table.set_global_used(*chain_used)
        return self._drain()

    def heartbeat(self, heartbeat: Heartbeat) -> list[Effect]:
        self.router.observe(heartbeat)
        return self._drain()

    def health(self, verdict: HealthVerdict) -> list[Effect]:
        self.router.builder.set_health_weight(verdict.worker_id, verdict.weight)
        return self._drain()

    def kv_events(self, events: KvEvents) -> None:
        """A node's cache changes: no effects."""
        self.router.index.apply(events.worker_id, events.stored, events.removed, events.cleared)

    def worker_left(self, worker_id: str) -> None:
        """`WorkerLeft`: forget the node now rather than when its heartbeats lapse; no effects."""
        self.router.forget([worker_id])

    def tick(self, now: float) -> list[Effect]:
        """Expire reservations and queued requests, forget nodes that left, and read the global count of the
        chains no reservation counted since the last tick."""
        router = self.router
        live = self._live()
        released, gone = router.prune(now, live)
        self.expired += released
        effects: list[Effect] = [NodesGone(gone)] if gone else []
        for entry in router.queue.expire(now):
            effects.append(Refused(entry.request_id, self._timed_out(entry, "no slot freed before the deadline")))
        if router.shares is not None:
            router.shares.forget_idle(router.queue.waiting_per_tenant())
        facts = router.builder.facts
        unknown = {facts(hb).chain_id for hb in live}
        unknown -= self._counted
        self._counted = set()
        effects.append(ReadUsage(sorted(unknown)))
        return effects

    def counted(self, usage: Mapping[str, int], counters: SharedCounters | None = None) -> list[Effect]:
        """The store's answer to `ReadUsage`: slots in use per chain (those it could read), and the tenants' shared
        counters where the store keeps them."""
        table = self.router.table
        for chain_id, used in usage.items():
            table.set_global_used(chain_id, used)
        if counters is not None and self.router.shares is not None:
            self.router.shares.read(counters)
        return self._drain()

    def _timed_out(self, entry: QueuedRequest, no_slot: str) -> ErrorReply:
        """The 503 for `entry` at its deadline: it waited for a worker to start, or for a slot (`no_slot` says so)."""
        no_worker = self.from_zero.timed_out(entry, self._routable(entry.request.model))
        if no_worker is not None:
            return self.router.refusal("scaling_from_zero", no_worker)
        return self.router.refusal("queue_timeout", no_slot)

    def _drain(self) -> list[Effect]:
        return [DRAIN] if len(self.router.queue) else []


def _bad_hand_over(request: RouteRequest) -> ErrorReply | None:
    """Why a route request's `hand_over` cannot be sent on as it is, or None."""
    hand_over = request.hand_over
    assert hand_over is not None
    if not hand_over.accept_to:
        problem = "a hand_over needs an accept_to"
    elif hand_over.request_id != request.request_id or hand_over.model != request.model:
        problem = "the hand_over is for another request or model"
    elif hand_over.kv_ref is not None:
        problem = "a hand_over runs the whole request: no kv_ref"
    else:
        return None
    return ErrorReply(code="bad_request", message=problem, status=400)
