"""The routing core (pure, synchronous): policy + slots + central queue.

`admit` places a new request on a chain with a free slot (reserving it in
the `SlotTable`), or queues it, or refuses it when the queue is full.
`dispatch_queued` hands freed slots to queued requests in priority/FIFO
order; the service calls it after every event that can free a slot, so no
request waits while a slot it could use is free. The service confirms each
placement with the global slot store and calls `undo` when another replica
got the slot first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

import msgspec

from msgspec import Struct

from contracts.messages import ErrorReply, Heartbeat, RouteRequest
from services.balancer.adapters import AdapterPlacement
from services.balancer.central_queue import CentralQueue, QueuedRequest
from services.balancer.chain_index import ChainIndex
from services.balancer.degradation import Degradation
from services.balancer.fair_share import TenantShares
from services.balancer.policies import RoutingPolicy
from services.balancer.prefix_pull import PrefixPull, PrefixPulls, PullCandidate, merged_cached
from services.balancer.slot_table import SlotTable
from services.balancer.disaggregation import choose_prefill, prefill_saturated, remote_prompt_ready_s
from services.balancer.snapshot import GENERATING_ROLES, ChainState, ClusterSnapshot, NodeFacts, SnapshotBuilder
from shared.balancer_settings import AdapterRoutingSettings, PrefixPullSettings
from shared.config import DegradationSettings, DisaggregationSettings, QueueSettings
from shared.kv.prefix_index import PrefixIndex

HeartbeatsFor = Callable[[str], Sequence[Heartbeat]]
_NO_PULLS: Mapping[str, PrefixPull] = {}
K = TypeVar("K")


class Placement(Struct, frozen=True):
    request: RouteRequest
    chain: ChainState
    # When the reservation lapses unless released first: the request's deadline, on this balancer's wall clock.
    expires_at: float
    # The prefill node of a two-node chain; None when `chain` runs the prompt.
    prefill: ChainState | None = None
    # The policy sent it to the node caching its prefix rather than to its best-scored node.
    fast_forward: bool = False
    # `chain` runs it on a prefix pulled from another node (whose id is then the chain's first node).
    pull: PrefixPull | None = None
    # With a pull on offer for some node: "pull", "recompute" or "run_on_source" (`PrefixPulls.chosen`); "" without.
    pull_choice: str = ""

    @property
    def request_id(self) -> str:
        return self.request.request_id


class Queued(Struct, frozen=True):
    entry: QueuedRequest
    # A request of a lower class that gave its place in a full queue: it is to be refused (`Degradation.evicted_reply`).
    evicted: QueuedRequest | None = None


class Router:
    def __init__(
        self,
        policy: RoutingPolicy,
        builder: SnapshotBuilder,
        index: PrefixIndex,
        table: SlotTable,
        queue: CentralQueue,
        queue_settings: QueueSettings,
        disaggregation: DisaggregationSettings | None = None,
        degradation: DegradationSettings | None = None,
        use_index: bool = True,
        adapters: AdapterPlacement | None = None,
        pulls: PrefixPulls | None = None,
    ) -> None:
        """`use_index=False` decides every request on a fresh snapshot (the reference the index is checked against)."""
        self.policy = policy
        self.builder = builder
        self.index = index
        self.table = table
        self.queue = queue
        self._queue_settings = queue_settings
        self._disaggregation = disaggregation or DisaggregationSettings()
        self.degradation = Degradation(degradation or DegradationSettings(), queue_settings.retry_after_s,
                                       queue_settings.fair_share)
        # Queued request id -> younger requests of its class served before it (cache-aware dequeue).
        self._overtaken: dict[str, int] = {}
        # Queued request id -> its place in the last dequeue order before cache-aware reordering.
        self._rank: dict[str, int] = {}
        # Requests left waiting for a busy node caching their prompt (`holds_for_cache`): counted once each,
        # however often a queued one is held again; and those of them still queued.
        self.cache_holds = 0
        self._held: set[str] = set()
        self._known_workers: set[str] = set()
        # Decisions are made on the chain index whenever it can index the fleet (`RoutingPolicy`).
        self.chains = ChainIndex(builder, table) if use_index else None
        # Where LoRA adapters are loaded, and what loading one costs on each node; it counts a placed request's
        # adapter on its node until the request's slot is freed, however that happens.
        self.adapters = adapters or AdapterPlacement(AdapterRoutingSettings())
        # Prefix pulls between kv_share nodes, and the source each placed request pulls from until its slot is freed.
        self.pulls = pulls or PrefixPulls(PrefixPullSettings(enabled=False), 0.0)
        self._pull_sources: dict[str, str] = {}
        # Each tenant's service so far, for the queue's order within a class (None: arrival order).
        self.shares = (TenantShares(queue_settings.fair_share_prompt_cost, queue_settings.fair_share_output_cost)
                       if queue_settings.fair_share else None)
        table.on_release = self._slot_freed

    def place(self, request: RouteRequest, heartbeats: Sequence[Heartbeat], expires_at: float,
              backlog_bound: float = math.inf, may_hold: bool = False) -> Placement | None:
        """Choose a chain with a free slot and reserve it locally until `expires_at`; None when the policy finds none.

        Chains with more than `backlog_bound` seconds of prefill backlog are left out (`backlog_bound_s`),
        less the prefill their cached prefix of the prompt saves: elsewhere the request would prefill it.
        With `may_hold`, None also when the request is to wait for a busy node caching its prompt (`holds_for_cache`).
        """
        cached = self.index.match(request.block_hashes) if request.block_hashes else {}
        loading = self.adapters.load_seconds(request.adapter, heartbeats) if request.adapter else None
        pulls = (self._pull_offers(request, heartbeats, cached) if cached and loading is None and self.pulls.enabled
                 else _NO_PULLS)
        if pulls:
            cached = merged_cached(cached, pulls)
        # Synced whatever the fleet, so that the index stays current when it becomes indexable again.
        if self.chains is not None and self.chains.sync(heartbeats):
            decision = self.chains.decision(request, cached, loading, {w: p.seconds for w, p in pulls.items()} if pulls else None)
            if backlog_bound < math.inf:
                decision.limit_backlog(backlog_bound, request.prompt_tokens)
            if may_hold and self.holds_for_cache(request, decision.cached, decision.eligible.item, decision.free.item):
                return None
            fast_forwards = self.policy.fast_forwards
            row = self.policy.choose_indexed(request, decision)
            if decision.settled:
                if row is None:
                    return None
                return self._reserve(request, decision.state(row), None, expires_at, fast_forwards, heartbeats, cached, pulls)
        return self._place_on_snapshot(request, heartbeats, expires_at, backlog_bound, may_hold, cached, loading, pulls)

    def _place_on_snapshot(self, request: RouteRequest, heartbeats: Sequence[Heartbeat], expires_at: float,
                           backlog_bound: float, may_hold: bool, cached: Mapping[str, int],
                           loading: Mapping[str, float | None] | None, pulls: Mapping[str, PrefixPull]) -> Placement | None:
        """`place` on a fresh snapshot: for a fleet with decode nodes, each paired with its prefill node."""
        snapshot = self.builder.snapshot(request, heartbeats, self.table.used, cached)
        if loading is not None:
            snapshot = msgspec.structs.replace(snapshot, chains=tuple(
                msgspec.structs.replace(c, adapter_load_s=seconds) if seconds else c
                for c in snapshot.chains if (seconds := loading.get(c.worker_id)) is not None))
        if pulls:
            snapshot = msgspec.structs.replace(snapshot, chains=tuple(
                msgspec.structs.replace(c, pull_s=pull.seconds) if (pull := pulls.get(c.worker_id)) is not None else c
                for c in snapshot.chains))
        prefill_for: dict[str, ChainState] = {}
        if any(c.node.role == "decode" for c in snapshot.chains):
            snapshot, prefill_for = self._with_prefill_nodes(request, snapshot, heartbeats, cached)
        holding = may_hold and self.policy.cache_hold_share > 0
        cached_chains = {c.chain_id: c.cached_blocks for c in snapshot.chains if c.cached_blocks} if holding else {}
        if backlog_bound < math.inf:
            # Waiting instead ends in a prefill of the whole prompt, at best on the fastest node (`Decision.limit_backlog`).
            # A two-node chain's wait is its prefill node's, already in `remote_prefill_s`.
            bound = backlog_bound + request.prompt_tokens * snapshot.fastest_prefill_per_token_s()
            snapshot = msgspec.structs.replace(snapshot, chains=tuple(
                c for c in snapshot.chains
                if c.remote_prefill_s is not None or c.first_token_wait_s(request.prompt_tokens) <= bound))
        # Two-node chains prefill on another node, whose cache the decode chains' figures do not show.
        if cached_chains and not prefill_for:
            free = {c.chain_id for c in snapshot.free()}
            # Every chain still in the snapshot before the backlog bound is one the request may take.
            if self.holds_for_cache(request, cached_chains, None, free.__contains__):
                return None
        fast_forwards = self.policy.fast_forwards
        chain = self.policy.choose(request, snapshot)
        if chain is None:
            return None
        return self._reserve(request, chain, prefill_for.get(chain.chain_id), expires_at, fast_forwards, heartbeats, cached,
                             pulls)

    def _reserve(self, request: RouteRequest, chain: ChainState, prefill: ChainState | None, expires_at: float,
                 fast_forwards: int, heartbeats: Sequence[Heartbeat], cached: Mapping[str, int],
                 pulls: Mapping[str, PrefixPull]) -> Placement:
        """Reserve a slot on the chosen chain; `fast_forwards`: the policy's count before it chose."""
        if chain.free_slots <= 0 or not self.table.reserve(request.request_id, chain.chain_id, chain.node.slots_total, expires_at):
            raise RuntimeError(f"policy {self.policy.name} chose full chain {chain.chain_id}")
        if prefill is None and chain.node.role == "decode" and self._prefill_saturated(chain, request, heartbeats, cached):
            self.degradation.counts["local_prefill"] += 1
        self.builder.note_sent(prefill or chain, request)
        self.adapters.note_placed(request.request_id, chain.worker_id, request.adapter, self.builder.clock())
        pull = pulls.get(chain.worker_id)
        choice = ""
        if pulls:
            choice = self.pulls.chosen(chain.worker_id, pull, next(iter(pulls.values())).source.worker_id, self.builder.clock())
        if pull is not None:
            self._pull_sources[request.request_id] = pull.source.worker_id
        return Placement(request, chain, expires_at, prefill, fast_forward=self.policy.fast_forwards > fast_forwards, pull=pull,
                         pull_choice=choice)

    def _pull_offers(self, request: RouteRequest, heartbeats: Sequence[Heartbeat], cached: Mapping[str, int]
                     ) -> Mapping[str, PrefixPull]:
        """The runners where `request` would run on a prefix pulled from the kv_share node caching most of it."""
        # Per decision: most fleets have no kv_share node, so look first at the few nodes caching the prompt
        # (a node whose facts are not read yet may be one).
        for worker_id in cached:
            facts = self.builder.cached_facts(worker_id)
            if facts is None or facts.kv_share:
                break
        else:
            return _NO_PULLS
        candidates = []
        excluded = request.exclude_workers
        for heartbeat in heartbeats:
            if not heartbeat.registration.kv_share:
                continue
            facts = self.builder.facts(heartbeat)
            if facts.kv_share and facts.health_weight > 0 and facts.worker_id not in excluded:
                in_flight = max(self.table.used(facts.chain_id), facts.running + facts.waiting)
                candidates.append(PullCandidate(facts, cached.get(facts.worker_id, 0), in_flight + facts.growth_penalty))
        return self.pulls.offers(request.prompt_tokens, candidates, self.builder.clock())

    def pull_source(self, request_id: str) -> str | None:
        """The node the request placed here pulls its prefix from, until its slot is freed (None: no pull)."""
        return self._pull_sources.get(request_id)

    def holds_for_cache(self, request: RouteRequest, cached: Mapping[K, int], eligible: Callable[[K], bool] | None,
                        free: Callable[[K], bool]) -> bool:
        """Whether `request` waits for a busy node that caches its prompt rather than take a free one that caches less.

        `cached`: leading prompt blocks per chain (row) that holds any;
        `eligible`: whether the request may take that chain at all (None: every one may), `free`:
        whether it may take it now. A policy's `cache_hold_share` (0: never)
        is the share of the prompt by which the best eligible chain must
        cache more than the best free one. Prefilling that part again elsewhere
        costs the whole fleet: the prefill delays every request in that
        node's batch, and a prompt copied there evicts others' prefixes,
        whose next turns then miss too. Waiting costs no compute, and under
        load a slot on the caching node frees about as soon as one elsewhere;
        the caller bounds the wait (`may_hold` in `place`).
        """
        share = self.policy.cache_hold_share
        if not share or not cached or not request.block_hashes:
            return False
        bar = share * len(request.block_hashes)
        # Mostly the chain caching the most is free: a free one within `bar` of the most cached settles it at once.
        most = max(cached.values())
        if most < bar or any(free(key) for key, blocks in cached.items() if blocks > most - bar):
            return False
        if eligible is not None:  # the most cached chain may be one the request may not take
            best = max((blocks for key, blocks in cached.items() if eligible(key)), default=0)
            if best < bar or any(free(key) for key, blocks in cached.items() if blocks > best - bar):
                return False
        if request.request_id not in self._held:
            self._held.add(request.request_id)
            self.cache_holds += 1
        return True

    def backlog_bound_s(self, request: RouteRequest, now: float) -> float:
        """The most prefill backlog a free chain may have to take `request` now (`Degradation.backlog_bound_s`).

        Only for a policy that costs the request's own wait (`bounds_backlog`):
        it would otherwise place a request behind any backlog rather than
        leave it queued, since it sees only free chains.
        """
        if not self.policy.bounds_backlog or request.adapter:
            # A request with an adapter may wait for one of its adapter's slots, which frees much later than the
            # queue's predicted wait for any slot: behind a backlog it is served sooner.
            return math.inf
        return self.degradation.backlog_bound_s(self.queue, request, now)

    def _with_prefill_nodes(
        self, request: RouteRequest, snapshot: ClusterSnapshot, heartbeats: Sequence[Heartbeat], cached: Mapping[str, int],
    ) -> tuple[ClusterSnapshot, dict[str, ChainState]]:
        """The snapshot with each decode chain's prefill node and when it would have the prompt ready.

        A two-node chain is costed as two nodes: the policy sees, per decode
        chain, the prefill node's backlog plus the prompt at that node's speed,
        then the prompt's KV over the link to the decode node.
        """
        candidates = self.builder.prefill_candidates(request, heartbeats, cached)
        prefill_for: dict[str, ChainState] = {}
        chains = []
        for chain in snapshot.chains:
            prefill = None
            if chain.node.role == "decode":
                prefill = choose_prefill(chain, request.prompt_tokens, candidates, self._disaggregation)
            if prefill is None:
                chains.append(chain)
                continue
            prefill_for[chain.chain_id] = prefill
            ready_s = remote_prompt_ready_s(prefill, chain, request.prompt_tokens, self._disaggregation)
            chains.append(msgspec.structs.replace(chain, remote_prefill_s=ready_s))
        return msgspec.structs.replace(snapshot, chains=tuple(chains)), prefill_for

    def _prefill_saturated(self, chain: ChainState, request: RouteRequest, heartbeats: Sequence[Heartbeat],
                           cached: Mapping[str, int]) -> bool:
        """Whether `chain` prefills `request` itself because the prefill pool is backed up (for the metrics)."""
        settings = self._disaggregation
        if not settings.local_prefill_when_saturated or chain.uncached_tokens(request.prompt_tokens) < settings.min_remote_prefill_tokens:
            return False
        candidates = self.builder.prefill_candidates(request, heartbeats, cached)
        best = choose_prefill(chain, request.prompt_tokens, candidates,
                              msgspec.structs.replace(settings, local_prefill_when_saturated=False))
        return best is not None and prefill_saturated(best, chain, request.prompt_tokens, settings)

    def admit(self, request: RouteRequest, heartbeats: Sequence[Heartbeat], now: float) -> Placement | Queued | ErrorReply:
        # A re-route of the same request (ingress could not hand it to the
        # chosen worker) gives back whatever the earlier attempt held.
        self.table.release(request.request_id)
        self.queue.remove(request.request_id)
        self._held.discard(request.request_id)
        if self.shares is not None:
            self.shares.arrived(request.tenant, self.queue.waiting_per_tenant())
        # The time left the request arrived with, as a moment on this balancer's clock.
        request_deadline = now + request.timeout_s
        # With no room to wait, a request that could be held for its cache takes a free chain instead of a refusal.
        placement = self.place(request, heartbeats, request_deadline, self.backlog_bound_s(request, now),
                               may_hold=not self.queue.full)
        if placement is not None:
            return placement
        deadline = min(request_deadline, now + self._queue_settings.max_wait_s)
        # A request held for its cache waits by choice, not for want of a slot: nothing to shed or shorten.
        held = request.request_id in self._held
        waiting = request if held else self.degradation.before_queueing(request, self.queue, deadline, now)
        if isinstance(waiting, ErrorReply):
            return waiting
        evicted = self.degradation.make_room(waiting, self.queue) if self.queue.full else None
        if evicted is None and self.queue.full and self.shares is not None:
            evicted = self._fair_room(waiting)
        if self.queue.full:
            if evicted is not None:
                # Still full (requests put back after a refused reservation may overfill it): the victim keeps its place.
                self.queue.restore(evicted)
                self.degradation.counts["evicted"] -= 1
            return self.refusal("queue_full", f"all slots busy and {len(self.queue)} requests already waiting")
        entry = self.queue.push(waiting, now, deadline)
        assert entry is not None
        return Queued(entry, evicted)

    def dispatch_queued(self, heartbeats_for: HeartbeatsFor) -> list[tuple[QueuedRequest, Placement]]:
        """Give free slots to queued requests, highest class first; within a class see `dequeue_order`.

        A request that no free chain suits (all free chains excluded for it)
        is skipped, not blocking those behind it; a model whose chains are
        all full is skipped at once.
        """
        placed = []
        exhausted: set[str] = set()
        heartbeats_cache: dict[str, Sequence[Heartbeat]] = {}

        def heartbeats_of(model: str) -> Sequence[Heartbeat]:
            heartbeats = heartbeats_cache.get(model)
            if heartbeats is None:
                heartbeats = heartbeats_cache[model] = heartbeats_for(model)
            return heartbeats

        now, bound = self.builder.clock(), self.overtake_bound()
        self._held = {r for r in self._held if r in self.queue}
        order = self.dequeue_order(heartbeats_of, bound)
        for entry in order:
            model = entry.request.model
            if model in exhausted:
                continue
            heartbeats = heartbeats_of(model)
            if not self._any_free(entry.request, heartbeats):
                exhausted.add(model)
                continue
            # A request waits for its cache no longer than it may be overtaken (`dequeue_order`).
            may_hold = now - entry.enqueued_at < self._hold_limit_s(entry.request) and not self._overdue(entry, bound)
            placement = self.place(entry.request, heartbeats, entry.enqueued_at + entry.request.timeout_s,
                                   self.backlog_bound_s(entry.request, now), may_hold)
            if placement is not None:
                self.queue.remove(entry.request_id)
                self._held.discard(entry.request_id)
                self._count_overtaken(entry, order)
                placed.append((entry, placement))
        return placed

    def dequeue_order(self, heartbeats_for: HeartbeatsFor, bound: float | None = None) -> list[QueuedRequest]:
        """Queued requests in the order freed slots go to them.

        Oldest first; or, with `queue.cache_aware_dequeue`, per priority
        class: the requests overtaken `bound` times (default: `overtake_bound`), oldest first;
        then the oldest `cache_aware_window` others, those whose prompt
        prefix a node with a free slot caches best first (ties: oldest); then
        the rest, oldest first. Under load, slots free one at a time, and the
        slot then goes to a request its node can serve from cache.
        """
        entries = list(self.queue.in_order(self.shares))
        settings = self._queue_settings
        if not settings.cache_aware_dequeue or len(entries) < 2:
            return entries
        # Overtaking is counted against this order, not arrival: with tenants' shares, serving the least-served
        # tenant first is not an overtake of the busier tenant's older requests.
        self._rank = {entry.request_id: rank for rank, entry in enumerate(entries)}
        self._overtaken = {r: n for r, n in self._overtaken.items() if r in self.queue}
        free_nodes: dict[str, list[str]] = {}

        def cached_share(entry: QueuedRequest) -> float:
            request = entry.request
            if not request.block_hashes:
                return 0.0
            free = free_nodes.get(request.model)
            if free is None:
                free = free_nodes[request.model] = [f.worker_id for f in self._free_nodes(heartbeats_for(request.model))]
            cached = self.index.match(request.block_hashes)
            return max((cached.get(w, 0) for w in free), default=0) / len(request.block_hashes)

        if bound is None:
            bound = self.overtake_bound()
        ordered: list[QueuedRequest] = []
        for _, group in itertools.groupby(entries, key=lambda e: e.request.priority):
            waiting = list(group)
            due = [e for e in waiting if self._overdue(e, bound)]
            rest = [e for e in waiting if not self._overdue(e, bound)]
            window, tail = rest[: settings.cache_aware_window], rest[settings.cache_aware_window :]
            scores = {e.request_id: cached_share(e) for e in window}
            if self.shares is None:
                window.sort(key=lambda e: -scores[e.request_id])  # stable: ties stay oldest first
                ordered += due + window + tail
            else:
                # The tenants' turns stay as fair share gave them: within its own turns, a tenant's overdue
                # requests go first, then its best cached.
                rank = {e.request_id: (0, 0.0) for e in due} | {e.request_id: (1, -scores[e.request_id]) for e in window}
                ordered += _within_tenant_turns(waiting, lambda e: rank.get(e.request_id, (2, 0.0)))
        return ordered

    def overtake_bound(self) -> float:
        """How often younger requests may be served before a queued one: `cache_aware_max_skips`, or more under load.

        Each overtake delays the request by about one departure, so up to
        `cache_aware_max_delay_s` worth of departures (times the slots freed
        per second) keeps its extra wait about that long at any fleet size
        and rate. A fixed count meant ever less time as the fleet grew (16
        overtakes pass in 0.1 s at 160 departures per second), and a long
        queue then served nearly everything as due, oldest first, without
        regard to the cache.
        """
        departures_per_s = self.degradation.departures.per_s(self.builder.clock())
        settings = self._queue_settings
        return max(settings.cache_aware_max_skips, settings.cache_aware_max_delay_s * departures_per_s)

    def _overdue(self, entry: QueuedRequest, bound: float) -> bool:
        """Younger requests have overtaken `entry` as often as `bound` allows: it goes first, and waits for no cache."""
        return self._overtaken.get(entry.request_id, 0) >= bound

    def _count_overtaken(self, served: QueuedRequest, order: Sequence[QueuedRequest]) -> None:
        """Every request of `served`'s class ahead of it in the order (before cache-aware reordering) and still
        waiting has been overtaken once more."""
        if not self._queue_settings.cache_aware_dequeue:
            return
        rank = self._rank
        served_rank = rank.get(served.request_id, -1)
        for entry in order:
            if (rank.get(entry.request_id, served_rank) < served_rank and entry.request.priority == served.request.priority
                    and entry.request_id in self.queue):
                self._overtaken[entry.request_id] = self._overtaken.get(entry.request_id, 0) + 1

    def unroutable(
        self, request: RouteRequest, routable: Sequence[Heartbeat], live: Callable[[], Sequence[Heartbeat]],
    ) -> ErrorReply | None:
        """Why `request` cannot be routed at all, given its model's routable nodes, or None when it can.

        `live` (every live node, draining or not) is read only when no node is routable.
        """
        if not routable:
            if not any(hb.registration.model == request.model for hb in live()):
                return ErrorReply(code="model_not_found", message=f"no live worker serves model {request.model!r}", status=404)
            return self.refusal("no_capacity", "every worker for this model is draining")
        if request.adapter and not self.adapters.serves_adapters(routable):
            return self.refusal("adapter_unavailable", f"no worker of model {request.model!r} serves LoRA adapters now")
        if request.exclude_workers:
            excluded = set(request.exclude_workers)
            if all(hb.registration.worker_id in excluded for hb in routable):
                return self.refusal("no_capacity", "no other live worker to retry on")
        # No node could ever run it: refused now, not queued until its deadline (ingress checks
        # the same per model; a resumed request keeps prompt + max_tokens as first asked).
        needed = request.prompt_tokens + request.max_tokens
        if all(needed > hb.registration.max_model_len for hb in routable):
            longest = max(hb.registration.max_model_len for hb in routable)
            return ErrorReply(code="context_length_exceeded", status=400,
                              message=f"{needed} tokens (prompt and completion) exceed every node's context ({longest})")
        return None

    def observe(self, heartbeat: Heartbeat) -> None:
        """A heartbeat arrived: feed the trackers; the node is known until it leaves."""
        self.builder.observe(heartbeat)
        self.adapters.observe(heartbeat)
        self._known_workers.add(heartbeat.registration.worker_id)

    def forget(self, worker_ids: Sequence[str]) -> None:
        """Nodes that left: drop what the trackers and the prefix index hold of them."""
        self.builder.forget(worker_ids)
        self.adapters.forget(worker_ids)
        self.pulls.links.forget(worker_ids)
        for worker_id in worker_ids:
            self.index.remove_node(worker_id)
            self._known_workers.discard(worker_id)

    def prune(self, now: float, live: Sequence[Heartbeat]) -> tuple[int, list[str]]:
        """Release reservations past their deadline or on chains that left, and forget nodes that left.

        Returns the reservations released and the nodes forgotten.
        """
        if self.chains is None:
            # Nobody reads what changed: drop it, so the sets stay small.
            self.builder.take_changed()
            self.table.take_changed()
        expired = self.table.expire(now)
        dropped = self.table.retain_chains({self.builder.facts(hb).chain_id for hb in live})
        gone = sorted(self._known_workers - {hb.registration.worker_id for hb in live})
        if gone:
            self.forget(gone)
        return len(expired) + len(dropped), gone

    def finished(self, request_id: str, worker_id: str) -> str | None:
        """`request_id` ended on `worker_id`: free its slot there; returns the chain, None if it held none there."""
        chain_id = self.table.release(request_id, worker_id)
        if chain_id is not None:
            self.builder.note_finished(worker_id)
            self.degradation.departures.note(self.builder.clock())
        return chain_id

    def undo(self, placement: Placement, chain_used: int, entry: QueuedRequest | None = None) -> None:
        """The global store refused the placement: note the chain as `chain_used` full and requeue `entry`."""
        self.table.release(placement.request_id)
        self.table.set_global_used(placement.chain.chain_id, chain_used)
        self.builder.note_undone(placement.prefill or placement.chain, placement.request)
        if placement.pull_choice:
            self.pulls.undone(placement.pull_choice, placement.pull, self.builder.clock())
        if entry is not None:
            self.queue.restore(entry)

    def _hold_limit_s(self, request: RouteRequest) -> float:
        """How long a queued request may wait for a busy node caching its prompt (`holds_for_cache`).

        With fair share, a request of a tenant with fewer requests waiting than the tenants waiting have on
        average is held no longer than the TTFT target: such a tenant is served at least as fast as it asks, so
        its request is soon in turn, and a longer hold would spend its latency for everyone's cache (and, with its
        requests kept waiting, have it held again). A busier tenant's requests wait for their turns anyway, and
        their holds cost nobody else. Measured at 2x overload (docs/benchmarks.md, "Fair share"): with the full
        2 s for all, the light tenant met its SLO for 0.93 of its requests; never held, 1.0 but the fleet served
        5% fewer tokens (its prompts missed the cache); held up to 0.5 s, 0.97 at arrival order's throughput.
        """
        limit = self._queue_settings.cache_aware_max_delay_s
        if self.shares is not None:
            waiting = self.queue.waiting_per_tenant()
            if waiting.get(request.tenant, 0) * len(waiting) < len(self.queue):
                return min(limit, self.degradation.ttft_target_s)
        return limit

    def _fair_room(self, request: RouteRequest) -> QueuedRequest | None:
        """Take the newest waiting request of the tenant with the most waiting in `request`'s class out of a full
        queue, when that tenant has more waiting than `request`'s would with it (it is refused), as fair queuing
        drops from the longest queue: a tenant filling the queue cannot lock the others out of it."""
        waiting = self.queue.tenants_of(request.priority)
        if not waiting:
            return None
        longest = max(waiting, key=waiting.__getitem__)
        if waiting[longest] <= waiting.get(request.tenant, 0) + 1:
            return None
        victim = self.queue.newest_of_tenant(longest, request.priority)
        if victim is not None:
            self.queue.remove(victim.request_id)
            self.degradation.counts["evicted"] += 1
        return victim

    def _slot_freed(self, request_id: str) -> None:
        self.adapters.released(request_id, self.builder.clock())
        self._pull_sources.pop(request_id, None)
        if self.shares is not None:
            self.shares.released(request_id)

    def refusal(self, code: str, message: str) -> ErrorReply:
        return ErrorReply(code=code, message=message, status=503, retry_after_s=self._queue_settings.retry_after_s)

    def _any_free(self, request: RouteRequest, heartbeats: Sequence[Heartbeat]) -> bool:
        # Cheaper than a snapshot: most drains find every chain full.
        return next(self._free_nodes(heartbeats), None) is not None

    def _free_nodes(self, heartbeats: Sequence[Heartbeat]) -> Iterator[NodeFacts]:
        """Generating nodes in routing with a free slot."""
        for heartbeat in heartbeats:
            if heartbeat.registration.role not in GENERATING_ROLES:
                continue
            facts = self.builder.facts(heartbeat)
            if facts.health_weight > 0 and self.table.used(facts.chain_id) < facts.slots_total:
                yield facts


def _within_tenant_turns(entries: list[QueuedRequest], key: Callable[[QueuedRequest], tuple[int, float]]) -> list[QueuedRequest]:
    """`entries` with each tenant's requests sorted by `key` (stably), in the places the tenant's requests held."""
    own: dict[str, list[QueuedRequest]] = {}
    for entry in entries:
        own.setdefault(entry.request.tenant, []).append(entry)
    turns = {tenant: iter(sorted(mine, key=key)) for tenant, mine in own.items()}
    return [next(turns[entry.request.tenant]) for entry in entries]
