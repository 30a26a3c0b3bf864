"""The immutable cluster snapshot every routing policy decides on (pure).

`NodeFacts` is what one heartbeat says about a node, plus what the balancer
learnt about it (speed factor, queue growth, health weight, slot count); it
is rebuilt only when a newer heartbeat or verdict arrives. `ChainState`
adds, per decision, the chain's used slots, the request's cached prefix
blocks there, and the prefill work this balancer has sent there that the
node has probably not done yet. Aggregated and decode nodes are the chains
a policy chooses among (their slots bound what runs); prefill nodes are
offered separately, as `prefill_candidates`, to complete a decode node's chain.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from msgspec import Struct

from contracts.messages import Heartbeat, KvTransfer, RouteRequest, WorkerRegistration
from services.balancer.backlog import PrefillBacklog
from services.balancer.chains import kv_slots
from services.balancer.speed import StepModel
from services.balancer.trackers import QueueGrowth, SpeedTracker
from shared.config import BalancerSettings


# Weight of each routed request in the typical request size: about the last 50 requests.
_REQUEST_SIZE_SMOOTHING = 0.02


# Slots of a chain when admission is off (`balancer.slots.bounded = false`).
_UNBOUNDED_SLOTS = 1 << 30

# Roles whose nodes generate tokens, and so hold slots.
GENERATING_ROLES = frozenset({"aggregated", "decode"})


class NodeFacts(Struct, frozen=True):
    worker_id: str
    role: str
    chain_id: str
    inbox: str
    block_size: int
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    gpu_utilization: float | None
    slots_total: int
    # What a step costs on this node now: its advertised (or the fallback)
    # step time at its measured speed. Policies cost requests with it.
    model: StepModel
    # Comparable across nodes: the fallback profile's typical step time over this node's (2.0: twice as fast).
    speed: float
    speed_measured: bool
    health_weight: float
    queue_growth_per_s: float
    # Requests the waiting queue is expected to gain over the growth horizon.
    growth_penalty: float
    sent_at: float
    # How a prompt's KV moves to or from the node, when it says (a two-node chain's hand-off cost).
    kv_transfer: KvTransfer | None = None
    # When the node's process started (its registration's `started_at`): routes name the process they chose.
    started_at: float = 0.0
    # It exposes its cached prefixes' KV to other nodes and pulls theirs (`WorkerRegistration.kv_share`).
    kv_share: bool = False


class ChainState(Struct, frozen=True):
    node: NodeFacts
    slots_used: int
    cached_blocks: int
    # Seconds before the node can start another prefill: uncached prompt
    # tokens this balancer sent it that it has probably not prefilled yet.
    prefill_backlog_s: float = 0.0
    # Requests heard finished on the node since its last heartbeat, which still counts them.
    finished_since_heartbeat: int = 0
    # A decode chain whose prompt a prefill node runs: seconds until this
    # node holds it (that node's backlog, the prompt, then the KV transfer).
    # None: this node prefills the prompt itself.
    remote_prefill_s: float | None = None
    # Seconds the request's LoRA adapter takes to load here before its prefill (0: none, or in a batch slot).
    adapter_load_s: float = 0.0
    # Seconds until a prefix pulled from another node is here (0: none pulled; `cached_blocks` then counts it).
    pull_s: float = 0.0

    @property
    def worker_id(self) -> str:
        return self.node.worker_id

    @property
    def chain_id(self) -> str:
        return self.node.chain_id

    @property
    def free_slots(self) -> int:
        return self.node.slots_total - self.slots_used

    def uncached_tokens(self, prompt_tokens: int) -> int:
        """Prompt tokens the chain must prefill for a request whose leading `cached_blocks` it holds."""
        return max(0, prompt_tokens - self.cached_blocks * self.node.block_size)

    def first_token_wait_s(self, prompt_tokens: int) -> float:
        """The prefill backlog plus the request's own uncached prefill: when its first token comes (`Router.place`'s bound)."""
        return self.prefill_backlog_s + self.uncached_tokens(prompt_tokens) * self.node.model.b

    @property
    def in_flight(self) -> int:
        """Requests on the node now: its reservations, or its last heartbeat's count less those finished since, if more."""
        node = self.node
        return max(self.slots_used, node.running + node.waiting - self.finished_since_heartbeat)

    @property
    def load(self) -> float:
        """Requests on the node, plus queue growth, per unit of health."""
        return (self.in_flight + self.node.growth_penalty) / self.node.health_weight

    @property
    def kv_usage(self) -> float:
        node = self.node
        return node.kv_blocks_used / node.kv_blocks_total if node.kv_blocks_total else 0.0

    @property
    def utilisation(self) -> float:
        """GPU utilisation when known, else the busier of KV and slot occupancy."""
        if self.node.gpu_utilization is not None:
            return self.node.gpu_utilization
        return max(self.kv_usage, self.slots_used / self.node.slots_total if self.node.slots_total else 1.0)


class ClusterSnapshot(Struct, frozen=True):
    chains: tuple[ChainState, ...]
    request_blocks: int  # full prompt blocks of the request (len(block_hashes))

    def free(self) -> list[ChainState]:
        return [c for c in self.chains if c.free_slots > 0]

    def fastest_prefill_per_token_s(self) -> float:
        """The least prefill time per prompt token among the chains that prefill on their own node (0.0: none)."""
        fastest, found = 0.0, False
        for c in self.chains:
            b = c.node.model.b
            if c.remote_prefill_s is None and (not found or b < fastest):
                fastest, found = b, True
        return fastest


def _drain_per_s(model: StepModel) -> float:
    """Prompt tokens per second a node of this step time prefills."""
    return 1.0 / model.b if model.b > 0 else float("inf")


def chain_id_of(heartbeat: Heartbeat) -> str:
    """Slot-ledger key of a worker's chain: a restarted worker (new `started_at`) starts with no reservations."""
    registration = heartbeat.registration
    return f"{registration.worker_id}@{int(registration.started_at * 1000)}"


class SnapshotBuilder:
    """Turns heartbeats and the balancer's trackers into snapshots; caches each node's facts per heartbeat."""

    def __init__(
        self,
        settings: BalancerSettings,
        speed: SpeedTracker,
        growth: QueueGrowth,
        backlog: PrefillBacklog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._slots = settings.slots
        self._typical_tokens = float(settings.slots.typical_prompt_tokens + settings.slots.typical_output_tokens)
        self._growth_horizon_s = settings.speed.growth_horizon_s
        self._speed = speed
        self._growth = growth
        self._backlog = backlog if backlog is not None else PrefillBacklog()
        # Wall clock, as heartbeats' `sent_at`: the backlog compares the two.
        self.clock = clock
        self._health: dict[str, float] = {}
        self._facts: dict[str, tuple[float, int, NodeFacts]] = {}
        self._finished: dict[str, int] = {}
        self._version = 0  # bumps on each health verdict, invalidating every cached fact
        # Nodes whose facts, prefill backlog or finished count changed since the last `take_changed`.
        self._changed: set[str] = set()

    @property
    def version(self) -> int:
        """Bumps whenever every node's cached facts become stale (a health verdict)."""
        return self._version

    def take_changed(self) -> set[str]:
        """Nodes whose facts, prefill backlog or finished count may have changed since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def cached_facts(self, worker_id: str) -> NodeFacts | None:
        """The node's facts as last read, without reading them again."""
        cached = self._facts.get(worker_id)
        return cached[2] if cached is not None else None

    def finished_since_heartbeat(self, worker_id: str) -> int:
        return self._finished.get(worker_id, 0)

    def backlog_s(self, facts: NodeFacts, now: float) -> float:
        """Seconds of prefill this balancer sent the node that it has probably not done by `now`."""
        return self._backlog.tokens(facts.worker_id, _drain_per_s(facts.model), now) * facts.model.b

    def backlog_state(self, worker_id: str) -> tuple[float, float]:
        """(tokens left when last updated, when): what `backlog_s` drains from."""
        return self._backlog.state(worker_id)

    def observe(self, heartbeat: Heartbeat) -> None:
        """Feed the trackers; call once per heartbeat received."""
        self._speed.observe(heartbeat)
        # The node's cached facts carry its heartbeat's sent_at, so they are rebuilt at the next snapshot.
        worker_id = heartbeat.registration.worker_id
        self._changed.add(worker_id)
        self._finished.pop(worker_id, None)
        self._growth.observe(worker_id, heartbeat.sent_at, heartbeat.stats.waiting)
        drain = _drain_per_s(self._effective_model(heartbeat.registration))
        stats = heartbeat.stats
        self._backlog.observe(worker_id, heartbeat.sent_at, stats.waiting, drain, self.clock(), stats.prefilling)

    def note_sent(self, chain: ChainState, request: RouteRequest) -> None:
        """`request`'s prompt is prefilled on `chain`'s node: its uncached part joins that node's backlog."""
        self._changed.add(chain.worker_id)
        self._backlog.add(chain.worker_id, chain.uncached_tokens(request.prompt_tokens), _drain_per_s(chain.node.model), self.clock())
        if self._slots.learn_request_size:
            size = request.prompt_tokens + request.max_tokens
            self._typical_tokens += _REQUEST_SIZE_SMOOTHING * (size - self._typical_tokens)

    def note_undone(self, chain: ChainState, request: RouteRequest) -> None:
        self._changed.add(chain.worker_id)
        self._backlog.withdraw(chain.worker_id, chain.uncached_tokens(request.prompt_tokens), _drain_per_s(chain.node.model), self.clock())

    def note_finished(self, worker_id: str) -> None:
        """A request on the node finished: its next heartbeat will no longer count it."""
        self._changed.add(worker_id)
        self._finished[worker_id] = self._finished.get(worker_id, 0) + 1

    def _relative_speed(self, model: StepModel) -> float:
        reference, own = self._speed.model.reference_seconds(), model.reference_seconds()
        return reference / own if reference > 0 and own > 0 else 1.0

    def _effective_model(self, registration: WorkerRegistration) -> StepModel:
        """The node's step time at its measured speed (an unmeasured node is taken as typical)."""
        factor = self._speed.factor(registration.worker_id)
        return self._speed.model_for(registration).scaled(factor if factor is not None else self._speed.typical_factor())

    def set_health_weight(self, worker_id: str, weight: float) -> None:
        """A prober's verdict: 1.0 healthy, lower is less attractive, 0 takes the node out of routing."""
        self._health[worker_id] = max(0.0, min(1.0, weight))
        self._version += 1

    def health_weight(self, worker_id: str) -> float:
        return self._health.get(worker_id, 1.0)

    def forget(self, worker_ids: Iterable[str]) -> None:
        worker_ids = list(worker_ids)
        self._speed.forget(worker_ids)
        self._growth.forget(worker_ids)
        self._backlog.forget(worker_ids)
        self._changed.update(worker_ids)
        for worker_id in worker_ids:
            self._facts.pop(worker_id, None)
            self._health.pop(worker_id, None)
            self._finished.pop(worker_id, None)

    def facts(self, heartbeat: Heartbeat) -> NodeFacts:
        worker_id = heartbeat.registration.worker_id
        cached = self._facts.get(worker_id)
        if cached is not None and cached[0] == heartbeat.sent_at and cached[1] == self._version:
            return cached[2]
        registration, stats = heartbeat.registration, heartbeat.stats
        measured = self._speed.factor(worker_id)
        growth = self._growth.rate(worker_id)
        model = self._effective_model(registration)
        facts = NodeFacts(
            worker_id=worker_id,
            role=registration.role,
            chain_id=chain_id_of(heartbeat),
            inbox=registration.inbox,
            block_size=registration.block_size,
            running=stats.running,
            waiting=stats.waiting,
            kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_used=stats.kv_blocks_used,
            gpu_utilization=stats.gpu_utilization,
            slots_total=self._slots_of(heartbeat),
            model=model,
            speed=self._relative_speed(model),
            speed_measured=measured is not None,
            health_weight=self.health_weight(worker_id),
            queue_growth_per_s=growth,
            growth_penalty=max(0.0, growth) * self._growth_horizon_s,
            sent_at=heartbeat.sent_at,
            kv_transfer=registration.kv_transfer,
            started_at=registration.started_at,
            kv_share=registration.kv_share and registration.role == "aggregated",
        )
        self._facts[worker_id] = (heartbeat.sent_at, self._version, facts)
        self._changed.add(worker_id)
        return facts

    def _slots_of(self, heartbeat: Heartbeat) -> int:
        """Typical requests the node's KV holds, capped by its batch limit and the configured cap.

        A request beyond the engine's `max_num_seqs` only waits in that
        node's own queue, where it is bound to the node; in the central
        queue it takes whichever slot frees first.
        """
        if not self._slots.bounded:
            return _UNBOUNDED_SLOTS
        registration = heartbeat.registration
        caps = [c for c in (self._slots.max_per_chain, registration.max_num_seqs) if c > 0]
        typical = max(1, round(self._typical_tokens))
        return kv_slots(heartbeat.stats.kv_blocks_total, registration.block_size, typical, min(caps, default=0))

    def snapshot(
        self,
        request: RouteRequest,
        heartbeats: Iterable[Heartbeat],
        slots_used: Callable[[str], int],
        cached_blocks: Mapping[str, int],
    ) -> ClusterSnapshot:
        """Chains that may take `request`: aggregated or decode nodes, not excluded, health weight above 0."""
        chains = self._states(request, heartbeats, GENERATING_ROLES, slots_used, cached_blocks)
        return ClusterSnapshot(tuple(chains), len(request.block_hashes))

    def prefill_candidates(
        self, request: RouteRequest, heartbeats: Iterable[Heartbeat], cached_blocks: Mapping[str, int]
    ) -> list[ChainState]:
        """Prefill nodes that may run `request`'s prompt (they hold no slots)."""
        return self._states(request, heartbeats, frozenset({"prefill"}), lambda _: 0, cached_blocks)

    def _states(
        self,
        request: RouteRequest,
        heartbeats: Iterable[Heartbeat],
        roles: frozenset[str],
        slots_used: Callable[[str], int],
        cached_blocks: Mapping[str, int],
    ) -> list[ChainState]:
        excluded = set(request.exclude_workers)
        now = self.clock()
        states = []
        for heartbeat in heartbeats:
            registration = heartbeat.registration
            if registration.role not in roles or registration.worker_id in excluded:
                continue
            facts = self.facts(heartbeat)
            if facts.health_weight <= 0:
                continue
            states.append(self.state(facts, slots_used(facts.chain_id), cached_blocks.get(facts.worker_id, 0), now))
        return states

    def state(self, facts: NodeFacts, slots_used: int, cached_blocks: int, now: float) -> ChainState:
        """The node's chain as a policy sees it at `now`, for a request whose leading `cached_blocks` it holds."""
        return ChainState(facts, slots_used, cached_blocks, self.backlog_s(facts, now), self._finished.get(facts.worker_id, 0))
