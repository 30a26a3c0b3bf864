"""A kvlane fleet in virtual time: clients, ingress, one balancer, the KV ledger, health, and N sim nodes.

Everything that decides is kvlane's own code: the ingress's request
preparation (`services.ingress.prompts.prepare`: chat template, context
limits, block hashes) and its request state machine
(`services.ingress.flight.RequestFlight`: routing again, resumptions and
their bounds), the balancer's `Router` with its policies, slot
table and central queue, the cache-manager's allocation and preemption
core (`shared.kv.allocation`), the health prober's verdict state machine,
and one `SimScheduler` per node. What is modelled instead of run is the
I/O between them: every message takes `Latencies.hop_s`, every route
decision `decision_s`, or, where `Latencies.spreads` has a measured
distribution for one, a delay drawn per request (per message) from it with
the run's seeded generators; heartbeats, KV-event batches and health
probes come at the live intervals (`cluster.*`, `health.*`), so routing
sees signals exactly as stale as it would live.

Clients follow `loadtest.bench.driver`: open loop (sessions at their arrival
times) or closed loop, turns of a session one after another, a
conversation's next prompt holding the answers it received. Each request
ends exactly once, as a `RequestRecord` whose times are simulated seconds.

A session with a LoRA adapter (`Session.adapter`) names it as ingress
resolves one: its prompt's block hashes chain from the adapter's root, the
balancer is told the adapter, and the node runs the request with it; nodes
get `worker.lora`'s slots, and the adapter loads their schedulers do are
counted (`counters["adapter_loads"]`, and from the warm-up's end on).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from contracts import subjects
from contracts.messages import ErrorReply, RouteRequest, StepTime, WorkerRegistration, WorkerRole
from contracts.model_files import ADAPTER_PREFIX, AdapterRef
from contracts.openai_api import ChatCompletionRequest, CompletionRequest
from launch.fleet_mix import FleetNode
from loadtest.bench.client import RequestRecord
from loadtest.bench.driver import CANCELLED, DriveLimits, request_body
from loadtest.bench.metrics import WorkerRun
from loadtest.simulation.balancer import SimBalancer
from loadtest.simulation.ceiling import PrefixOracle, Served
from loadtest.simulation.delays import Delays, Latencies
from loadtest.simulation.events import EventQueue
from loadtest.simulation.ledger import MemoryLedger, SimAllocator
from loadtest.simulation.node import SimNode
from loadtest.simulation.scaling import ScalingTimeline, SimScaler
from loadtest.bench.workloads import Session, WorkloadSpec, sessions
from services.balancer.router import Placement
from services.health_prober.health import NodeHealth
from services.ingress.errors import ApiError
from services.ingress.flight import Fail, Route, RequestFlight, StreamInterrupted
from services.ingress.prompts import PreparedRequest, prepare
from services.worker.sim import SimRequest, StepOutcome
from shared.kv.links import advertised_kv_transfer, get_link
from shared.kv.step_profile import get_profile
from shared.config import AutoscalerSettings, IngressSettings, KvlaneConfig
from shared.tokenizer import SimTokenizer


@dataclass(frozen=True)
class NodeChange:
    """A node that fails (`profile` empty) or joins (a new node of `profile` at `speed`) at `at_s`."""

    at_s: float
    worker_id: str
    profile: str = ""
    speed: float = 1.0


@dataclass(frozen=True)
class SimulationSpec:
    config: KvlaneConfig
    nodes: tuple[FleetNode, ...]
    workload: WorkloadSpec
    limits: DriveLimits
    request_timeout_s: float
    latencies: Latencies = Latencies()
    changes: tuple[NodeChange, ...] = ()
    # Assert slot and KV capacity after every event (tests; slows the run).
    check_invariants: bool = False
    # Nodes join and drain as the autoscaler decides (None: the fleet stays as given); a
    # joining node serves `node_start_s` after the decision, as an engine takes to start.
    autoscaling: AutoscalerSettings | None = None
    node_start_s: float = 5.0
    # Client seconds of warm-up (requests scheduled before are served, not measured): counters named
    # `*_measured` count from then on.
    warmup_s: float = 0.0


@dataclass
class SimulationResult:
    records: list[RequestRecord]
    runs: dict[str, WorkerRun]
    simulated_s: float
    events: int
    wall_s: float
    counters: dict[str, int] = field(default_factory=dict)
    scaling: ScalingTimeline | None = None
    # Requests served to their end, as the throughput ceiling sees them (with a `PrefixOracle` only).
    served: list[Served] = field(default_factory=list)

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0


class InvariantBroken(AssertionError):
    pass


# What the balancer's preemption of a request looks like to ingress (its node says "preempted").
_PREEMPTED = StreamInterrupted("preempted to make room", None, preempted=True)


def _http_error(error: ApiError) -> str:
    """An error ingress answers, as the load-test client records an HTTP error."""
    return f"http_{error.status}: {error.message}"[:200]


class _Flight:
    """One request from the client's side: its record, where it runs now, and ingress's decisions about it
    (`ingress`: attempts, exclusions, bounds, the tokens it has)."""

    __slots__ = ("record", "session", "turn", "history", "prepared", "ingress", "worker_id", "decode_id",
                 "accepted_at", "done", "stream_s", "delays")

    def __init__(self, record: RequestRecord, session: Session, turn: int, history: list[tuple[str, str]],
                 prepared: PreparedRequest, settings: IngressSettings) -> None:
        self.record = record
        self.session = session
        self.turn = turn
        self.history = history
        self.prepared = prepared
        self.ingress = RequestFlight(settings, prepared.sampling.max_tokens, prepared.sampling.n)
        self.worker_id: str | None = None  # the node running it now (its prefill node, first, on a two-node chain)
        self.decode_id = ""  # the decode node of a two-node chain
        self.accepted_at = 0.0
        self.done = False
        # Its tokens' way to the client, drawn at its first token: they arrive in the order they were made.
        self.stream_s: float | None = None
        # Its control-plane delays, where they are drawn per request together (`Delays.for_request`).
        self.delays: dict[str, float] | None = None

    @property
    def output(self) -> Sequence[int]:
        """The tokens it has produced, over all its attempts."""
        return self.ingress.produced


class Simulation:
    def __init__(self, spec: SimulationSpec, on_record: Callable[[RequestRecord], None] = lambda record: None,
                 oracle: PrefixOracle | None = None) -> None:
        self._spec = spec
        # Sees every prompt and output, for the throughput ceiling (`SimulationResult.served`).
        self._oracle = oracle
        self._served: list[Served] = []
        self._config = spec.config
        self._lat = spec.latencies
        self._delay = Delays(spec.latencies, spec.workload.seed, lambda: len(self._flights))
        self._on_record = on_record
        self._events = EventQueue()
        self._tokenizer = SimTokenizer()
        self._rng = random.Random(f"{spec.workload.seed}:simulation")
        allocator = SimAllocator(MemoryLedger(), spec.config.cache_manager) if spec.config.balancer.allocate_kv else None
        self._allocator = allocator
        self.balancer = SimBalancer(spec.config, self._events, allocator, self._generated, self)
        self.nodes: dict[str, SimNode] = {}
        self._health: dict[str, NodeHealth] = {}
        self._link = get_link(spec.config.worker.sim.kv_link)
        self._flights: dict[str, _Flight] = {}
        self._records: list[RequestRecord] = []
        self._runs: dict[str, WorkerRun] = {}
        self._request_seq = 0
        self._open_sessions = 0
        self._arrivals_done = False
        self._sessions: Iterator[Session] = iter(())
        self._origin = 0.0
        self.scaler: SimScaler | None = None
        self.counters = {"migrations": 0, "dispatch_retries": 0, "node_failures": 0, "node_joins": 0,
                         "kv_hand_offs": 0, "adapter_loads": 0, "adapter_loads_measured": 0, "prefix_pulls": 0,
                         "prefix_pull_tokens": 0}
        # When each source's link is through with the transfers already on it.
        self._link_free_at: dict[str, float] = {}

    # --- the run --------------------------------------------------------------------

    def run(self) -> SimulationResult:
        started = time.perf_counter()
        spec, events = self._spec, self._events
        for node in spec.nodes:
            self._add_node(node.worker_id, node.profile, node.speed, node.role)
        for change in spec.changes:
            events.at(change.at_s, self._change, change)
        self.balancer.start()
        if spec.autoscaling is not None:
            kinds = {node.role: node for node in reversed(spec.nodes)}  # each pool grows with nodes of its first kind
            self.scaler = SimScaler(spec.autoscaling, events, self.nodes, kinds, self.balancer.view,
                                    lambda: len(self.balancer.router.queue), self._add_node, self._now, spec.node_start_s,
                                    self._config.worker.model)
            self.scaler.start()
        self._sessions = sessions(spec.workload)
        # Clients start once every node has been heard (the live bench waits for a served request too).
        start = self._config.cluster.heartbeat_interval_s + 2 * self._lat.hop_s
        self._origin = start
        if spec.limits.concurrency is None:
            events.at(start, self._next_arrival)
        else:
            for _ in range(spec.limits.concurrency):
                self._open_sessions += 1
                events.at(start, self._closed_client_next)
        check = self._check_invariants if spec.check_invariants else None
        events.run(until=start + spec.limits.hard_stop_s, done=self._all_done, after_each=check)
        for flight in list(self._flights.values()):
            self._fail(flight, CANCELLED)
        simulated_s = events.now - start
        # Messages still on their way (the last RequestFinished) land, so the final state is settled.
        longest = self._delay.longest
        events.run(until=events.now + 4 * longest("hop") + longest("decision") + longest("handover") + longest("stream"),
                   after_each=check)
        if self.scaler is not None:
            self.scaler.finish()
        return SimulationResult(self._records, self._runs, simulated_s, events.processed,
                                time.perf_counter() - started,
                                self.counters | {"route_decisions": self.balancer.decisions,
                                                 "kv_refusals": self.balancer.kv_refusals,
                                                 "cache_holds": self.balancer.router.cache_holds,
                                                 "lease_preemptions": self._allocator.preemptions if self._allocator else 0,
                                                 "kv_blocks_evicted": self._blocks_evicted()},
                                self.scaler.timeline if self.scaler is not None else None, self._served)

    def _all_done(self) -> bool:
        return self._arrivals_done and self._open_sessions == 0

    def _now(self) -> float:
        """Client time: seconds since the clients started."""
        return self._events.now - self._origin

    # --- nodes ----------------------------------------------------------------------

    def _add_node(self, worker_id: str, profile_name: str, speed: float, role: WorkerRole = "aggregated") -> None:
        sim, lora = self._config.worker.sim, self._config.worker.lora
        profile = get_profile(profile_name)
        registration = WorkerRegistration(
            worker_id=worker_id, role=role, model=self._config.worker.model, engine="sim",
            inbox=subjects.worker_inbox(worker_id), block_size=sim.block_size, max_model_len=sim.max_model_len,
            tokenizer="sim", started_at=self._events.now, host="simulated", max_num_seqs=sim.max_num_seqs,
            # As a live sim worker advertises its profile (`services.worker.main.advertised_step_time`).
            step_time=StepTime(a=profile.a, b=profile.b, c=profile.c, d=profile.d, per_request=profile.per_request),
            # Its KV moves over the fleet's link at the link's own speed (`_hand_off`), whatever the node's.
            kv_transfer=advertised_kv_transfer(profile.kv_bytes_per_token, self._link),
            # As a live worker registers them (`services.worker.main`); only aggregated workers run adapters.
            max_loras=lora.max_loras if role == "aggregated" else 0,
            max_cpu_loras=max(lora.max_cpu_loras, lora.max_loras) if role == "aggregated" else 0,
            kv_share=self._config.worker.kv_share and role == "aggregated",
        )
        node = SimNode(registration, profile, speed, sim, self._tokenizer.output_token_range, self._events, self._on_step,
                       self._lat.step_overhead_s, lora if role == "aggregated" else None)
        self.nodes[worker_id] = node
        self._health[worker_id] = NodeHealth(worker_id, self._config.health, self._events.now)
        self._events.after(0.0, self._beat, node)
        # Live probes are out of phase with each other; so are these, reproducibly.
        self._events.after(self._rng.uniform(0, self._config.health.probe_interval_s), self._probe, node)

    def _blocks_evicted(self) -> int:
        """Cached KV blocks the nodes' engines reclaimed for new ones: what a full prefix cache costs."""
        return sum(node.scheduler.stats().blocks_evicted for node in self.nodes.values())

    def _change(self, change: NodeChange) -> None:
        if change.profile:
            self.counters["node_joins"] += 1
            self._add_node(change.worker_id, change.profile, change.speed)
            return
        node = self.nodes.get(change.worker_id)
        if node is None or not node.alive:
            return
        self.counters["node_failures"] += 1
        for request_id in node.fail():
            flight = self._flights.get(request_id)
            if flight is not None and flight.worker_id == node.worker_id:
                # Ingress notices at its next liveness check of the worker.
                self._events.after(self._config.ingress.liveness_check_s, self._worker_lost, flight, node.worker_id)

    def _beat(self, node: SimNode) -> None:
        if not node.alive:
            return
        heartbeat = node.heartbeat()
        self._events.after(self._delay("hop"), self.balancer.on_heartbeat, heartbeat)
        self._events.after(self._config.cluster.heartbeat_interval_s, self._beat, node)

    def _flush_kv(self, node: SimNode) -> None:
        node.kv_batch_due = False
        if not node.alive:
            return
        batch = node.kv_events()
        if batch is not None:
            self._events.after(self._delay("hop"), self.balancer.on_kv_events, batch)

    def _probe(self, node: SimNode) -> None:
        """The health prober's one-token probe: it waits for the step under way, then takes one step."""
        settings = self._config.health
        health = self._health[node.worker_id]
        now = self._events.now
        if node.alive:
            stats = node.scheduler.stats()
            step = node.profile.step_seconds(1, stats.running + 1, stats.blocks_used * node.registration.block_size,
                                             new_requests=1, emitted_tokens=stats.running + 1)
            latency: float | None = node.busy_for() + step / node.speed + 2 * self._lat.hop_s
            if latency > settings.probe_timeout_s:
                latency = float("inf")
            health.observe_probe(latency, now, queued=stats.waiting > 0)
        else:
            health.observe_probe(None, now)
        self._events.after(self._delay("hop"), self.balancer.on_health, health.verdict(now))
        if node.alive or health.state != "unhealthy":
            self._events.after(settings.probe_interval_s, self._probe, node)

    def _on_step(self, node: SimNode, outcome: StepOutcome) -> None:
        now = self._events.now
        if outcome.adapter_loads:
            self.counters["adapter_loads"] += outcome.adapter_loads
            # Counted when the step that did them ends, as its tokens are.
            if now - self._origin >= self._spec.warmup_s:
                self.counters["adapter_loads_measured"] += outcome.adapter_loads
        if not node.kv_batch_due:
            # Workers batch their cache changes every kv_events_interval_s; a node that did not step has none.
            node.kv_batch_due = True
            interval = self._config.cluster.kv_events_interval_s
            self._events.at((now // interval + 1) * interval, self._flush_kv, node)
        flights = self._flights
        prefill_node = node.registration.role == "prefill"
        for info in outcome.finished_info:
            flight = flights.get(info.request_id)
            if flight is not None and _first_of_two(flight, node):
                self._events.after(self._delay("hop"), self._hand_off, flight, node, flight.decode_id, info.prompt_tokens)
            elif prefill_node:
                node.scheduler.release_held(info.request_id)
        if prefill_node:
            return
        for request_id, token in outcome.emitted:
            flight = flights.get(request_id)
            if flight is None or flight.worker_id != node.worker_id or _first_of_two(flight, node):
                continue
            flight.ingress.on_tokens((token,))
            record = flight.record
            if flight.stream_s is None:
                flight.stream_s = self._delay("stream", flight.delays)
            seen = now + flight.stream_s - self._origin
            if record.first_token_s is None:
                record.first_token_s = seen
            record.token_times_s.append(seen)
        for info in outcome.finished_info:
            flight = flights.get(info.request_id)
            if flight is None or flight.worker_id != node.worker_id or _first_of_two(flight, node):
                continue
            record = flight.record
            stream = flight.stream_s if flight.stream_s is not None else self._delay("stream", flight.delays)
            record.end_s = now + stream - self._origin
            record.status = 200
            record.finish_reason = "length"
            record.completion_tokens = len(flight.output)
            record.cached_tokens = info.cached_prompt_tokens
            self._runs[info.request_id] = WorkerRun(node.worker_id, now - flight.accepted_at, "length")
            self._events.after(self._delay("hop"), self.balancer.on_finished, info.request_id, node.worker_id,
                              len(flight.output))
            self._end(flight, client_delay=stream)

    def _generated(self, request_id: str) -> int:
        flight = self._flights.get(request_id)
        return len(flight.output) if flight is not None else 0

    # --- clients --------------------------------------------------------------------

    def _next_arrival(self) -> None:
        session = next(self._sessions, None)
        if session is None or session.arrival_s > self._spec.limits.issue_for_s:
            self._arrivals_done = True
            return
        self._events.at(self._origin + session.arrival_s, self._arrive, session)

    def _arrive(self, session: Session) -> None:
        self._open_sessions += 1
        self._start_turn(session, 0, [], session.arrival_s)
        self._next_arrival()

    def _closed_client_next(self) -> None:
        session = next(self._sessions, None) if self._now() < self._spec.limits.issue_for_s else None
        if session is None:
            self._arrivals_done = True
            self._open_sessions -= 1
            return
        self._start_turn(session, 0, [], self._now())

    def _session_over(self) -> None:
        if self._spec.limits.concurrency is None:
            self._open_sessions -= 1
        else:
            self._closed_client_next()

    def _start_turn(self, session: Session, turn: int, history: list[tuple[str, str]], scheduled_s: float) -> None:
        spec = session.turns[turn]
        record = RequestRecord(session.session_id, session.group, turn, session.api, spec.max_tokens, scheduled_s,
                               priority=session.priority, tenant=session.tenant,
                               model=session.adapter or self._config.worker.model)
        record.sent_s = self._now()
        self._records.append(record)
        self._request_seq += 1
        record.request_id = f"sim-{self._request_seq}"
        body = request_body(session, history, spec.text) | {
            "model": self._config.worker.model, "max_tokens": spec.max_tokens, "stream": True,
            "stream_options": {"include_usage": True},
        }
        # As ingress resolves a `model` that names an adapter: the base model's workers run it with the adapter.
        adapter = AdapterRef(session.adapter, f"{ADAPTER_PREFIX}{session.adapter}/sim") if session.adapter else None
        try:
            request = msgspec.convert(body, ChatCompletionRequest if session.api == "chat" else CompletionRequest)
            prepared = prepare(request, self._registration(), self._tokenizer, self._config.ingress.max_tokens_default,
                               adapter=adapter)
        except ApiError as exc:
            record.status = exc.status
            record.error = f"http_{exc.status}: {exc.message}"[:200]
            self._on_record(record)
            self._session_over()
            return
        flight = _Flight(record, session, turn, history, prepared, self._config.ingress)
        record.prompt_tokens = len(prepared.prompt_token_ids)
        if self._oracle is not None:
            self._oracle.started(record.request_id, prepared.block_hashes, record.prompt_tokens, session.adapter)
        self._flights[record.request_id] = flight
        self._events.after(self._spec.request_timeout_s, self._time_out, flight)
        flight.delays = self._delay.for_request()
        self._events.after(self._delay("ingress", flight.delays), self._route_unless_done, flight, flight.ingress.start())

    def _registration(self) -> WorkerRegistration:
        return next(iter(self.nodes.values())).registration

    def _route(self, flight: _Flight, attempt: Route) -> None:
        prepared, produced = flight.prepared, len(attempt.produced)
        route = RouteRequest(
            request_id=flight.record.request_id or "",
            model=prepared.model,
            prompt_tokens=len(prepared.prompt_token_ids) + produced,
            max_tokens=prepared.sampling.max_tokens - produced,
            # Time left, as ingress sends it: the balancer turns it into a moment on its own clock.
            timeout_s=max(0.0, self._origin + flight.record.sent_s + self._spec.request_timeout_s - self._events.now),
            block_hashes=prepared.block_hashes,
            exclude_workers=list(attempt.exclude),
            priority=prepared.priority,
            adapter=flight.session.adapter,
            tenant=flight.session.tenant,
            tenant_weight=flight.session.tenant_weight,
        )
        flight.worker_id = None
        self._events.after(self._delay("hop", flight.delays) + self._delay("decision", flight.delays), self.balancer.route,
                           route)

    # RouteListener: what the balancer answers.

    def placed(self, placement: Placement) -> None:
        flight = self._flights.get(placement.request_id)
        if self._spec.check_invariants and placement.chain.slots_used >= placement.chain.node.slots_total:
            raise InvariantBroken(f"{placement.request_id} placed on full chain {placement.chain.chain_id}")
        if flight is None:
            # The client left while the decision was being made.
            self.balancer.withdraw(placement.request_id)
            return
        # The decision goes back to ingress, which hands the request to the worker (or its prefill node).
        handing = flight.ingress.on_decision(placement.request.max_tokens)
        if handing.capped:  # degraded under overload, as ingress applies it
            sampling = msgspec.structs.replace(flight.prepared.sampling, max_tokens=handing.max_tokens)
            flight.prepared = msgspec.structs.replace(flight.prepared, sampling=sampling)
        first, prefix_tokens = placement.prefill.worker_id if placement.prefill is not None else None, 0
        if placement.pull is not None:
            first, prefix_tokens = placement.pull.source.worker_id, placement.pull.exposed_tokens
        self._events.after(self._delay("handover", flight.delays), self._dispatch, flight, placement.chain.worker_id,
                           first, prefix_tokens)

    def refused(self, request_id: str, reply: ErrorReply) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            self._events.after(self._delay("hop"), self._fail, flight, f"http_{reply.status}: {reply.code}", reply.status)

    def preempted(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is None or flight.worker_id is None or flight.ingress.over:
            return
        node = self.nodes[flight.worker_id]
        self._events.after(self._lat.hop_s, node.abort, request_id)
        resume = flight.ingress.on_interrupted(_PREEMPTED)
        if isinstance(resume, Fail):
            self._events.after(2 * self._lat.hop_s, self._fail, flight, _http_error(resume.error), resume.error.status)
            return
        flight.worker_id = None
        self._events.after(2 * self._lat.hop_s, self._route_unless_done, flight, resume)

    def _route_unless_done(self, flight: _Flight, route: Route) -> None:
        if not flight.done:
            self._route(flight, route)

    def _dispatch(self, flight: _Flight, worker_id: str, prefill_id: str | None = None, prefix_tokens: int = 0) -> None:
        """Hand the request to its node; on a two-node chain to its first node: a prefill node, which runs the
        prompt, or a prefix pull's source, which runs only the `prefix_tokens` it caches."""
        if flight.done or flight.ingress.over:
            self.balancer.withdraw(flight.record.request_id or "")
            return
        node = self.nodes[prefill_id or worker_id]
        if not node.alive:
            # No responders on its inbox: ingress routes again without it.
            elsewhere = flight.ingress.on_refused(node.worker_id)
            if isinstance(elsewhere, Fail):
                self._fail(flight, _http_error(elsewhere.error), elsewhere.error.status)
                return
            self.counters["dispatch_retries"] += 1
            self._route(flight, elsewhere)
            return
        if prefill_id is not None and prefix_tokens:
            flight.decode_id = worker_id
            self._start(flight, node, max_tokens=1, hold_kv=True, prompt_tokens=prefix_tokens)
        elif prefill_id is not None:
            # The prompt runs on the prefill node, which keeps its KV for the decode node to pull.
            flight.decode_id = worker_id
            self._start(flight, node, max_tokens=len(flight.output) + 1, hold_kv=True)
        else:
            flight.decode_id = ""
            self._start(flight, node)

    def _start(self, flight: _Flight, node: SimNode, max_tokens: int | None = None, hold_kv: bool = False,
               prompt_tokens: int = 0) -> None:
        """Run the request on `node`; with `prompt_tokens`, only that prefix of its prompt (a prefix pull's source)."""
        prepared = flight.prepared
        seed = self._config.worker.sim.seed if prepared.sampling.seed is None else prepared.sampling.seed
        prompt = prepared.prompt_token_ids[:prompt_tokens] if prompt_tokens else prepared.prompt_token_ids
        try:
            node.add(SimRequest(flight.record.request_id or "", prompt,
                                max_tokens or prepared.sampling.max_tokens, seed, [] if prompt_tokens else list(flight.output),
                                hold_kv, adapter=flight.session.adapter))
        except ValueError as exc:
            self._fail(flight, f"http_400: {exc}"[:200], 400)
            return
        flight.worker_id = node.worker_id
        flight.accepted_at = self._events.now

    def _hand_off(self, flight: _Flight, source: SimNode, decode_id: str, prompt_tokens: int) -> None:
        """The decode node pulls the prompt's KV from `source` (one round trip, then the transfer), then generates."""
        decode = self.nodes[decode_id]
        request_id = flight.record.request_id or ""
        if flight.done or not decode.alive:
            source.scheduler.release_held(request_id)
            self._lost_on(flight, decode_id)
            return
        if prompt_tokens < len(flight.prepared.prompt_token_ids):
            # A prefix pull: the runner pulls the blocks of the prefix it does not cache itself.
            prefix = flight.prepared.prompt_token_ids[:prompt_tokens]
            moved = max(0, prompt_tokens - decode.scheduler.cached_prefix_tokens(prefix))
            self.counters["prefix_pulls"] += 1
            self.counters["prefix_pull_tokens"] += moved
        else:
            moved = prompt_tokens + len(flight.output)
            self.counters["kv_hand_offs"] += 1
        # Transfers from one source share its link: each starts when the ones before it are through.
        now = self._events.now
        start = max(now + 2 * self._lat.hop_s, self._link_free_at.get(source.worker_id, 0.0))
        done = start + self._link.transfer_seconds(moved * source.profile.kv_bytes_per_token)
        self._link_free_at[source.worker_id] = done
        self._events.after(done - now, self._pulled, flight, source, decode, prompt_tokens)

    def _pulled(self, flight: _Flight, source: SimNode, decode: SimNode, prompt_tokens: int) -> None:
        if flight.done or not decode.alive:
            if source.alive:
                source.scheduler.release_held(flight.record.request_id or "")
            self._lost_on(flight, decode.worker_id)
            return
        if source.alive:
            known = flight.prepared.prompt_token_ids + flight.output
            decode.scheduler.import_prefix(known[:prompt_tokens] if prompt_tokens < len(flight.prepared.prompt_token_ids) else known)
            source.scheduler.release_held(flight.record.request_id or "")
        flight.decode_id = ""
        # A source that died meanwhile has nothing to pull: the decode node computes the prompt itself.
        self._start(flight, decode)

    def _lost_on(self, flight: _Flight, worker_id: str) -> None:
        """The node `flight` was being handed to is gone: as if it had died running it."""
        if not flight.done:
            flight.worker_id = worker_id
            self._worker_lost(flight, worker_id)

    def _worker_lost(self, flight: _Flight, worker_id: str) -> None:
        if flight.done or flight.ingress.over or flight.worker_id != worker_id:
            return
        # Every migration here follows a node's death: both bounds apply (`migration_attempts`, `node_loss_resumes`).
        resume = flight.ingress.on_interrupted(
            StreamInterrupted(f"worker {worker_id} is gone", "timeout", worker_id, node_lost=True))
        if isinstance(resume, Fail):
            self._fail(flight, "stream_error: worker_lost")
            return
        self.counters["migrations"] += 1
        self._route(flight, resume)

    def _time_out(self, flight: _Flight) -> None:
        if not flight.done:
            self._fail(flight, f"timeout after {self._spec.request_timeout_s:g}s")

    def _fail(self, flight: _Flight, error: str, status: int | None = None) -> None:
        if flight.done:
            return
        record = flight.record
        record.error = error
        record.status = status if status is not None else record.status or (200 if flight.output else None)
        request_id = record.request_id or ""
        if flight.worker_id is not None:
            node = self.nodes[flight.worker_id]
            if node.alive:
                node.abort(request_id)
        self.balancer.withdraw(request_id)
        self._end(flight)

    def _end(self, flight: _Flight, client_delay: float = 0.0) -> None:
        """The request is over; its client goes on `client_delay` later, when it hears so."""
        flight.done = True
        record = flight.record
        del self._flights[record.request_id or ""]
        record.text = "".join(self._tokenizer.token_text(t) for t in flight.output)
        if self._oracle is not None:
            prepared = flight.prepared
            served = self._oracle.ended(record.request_id or "", record.scheduled_s, prepared.prompt_token_ids,
                                        prepared.block_hashes, flight.output, flight.session.adapter)
            if record.ok:
                self._served.append(served)
        self._on_record(record)
        if self.scaler is not None:
            self.scaler.served(record)
        session, turn = flight.session, flight.turn + 1
        if record.ok and turn < len(session.turns):
            history = flight.history + [(session.turns[flight.turn].text, record.text)]
            self._events.after(client_delay + session.think_time_s, self._next_turn, session, turn, history)
        else:
            self._events.after(client_delay, self._session_over)

    def _next_turn(self, session: Session, turn: int, history: list[tuple[str, str]]) -> None:
        self._start_turn(session, turn, history, self._now())

    # --- checks ---------------------------------------------------------------------

    def _check_invariants(self) -> None:
        policy = self._config.cache_manager
        for worker_id, node in self.nodes.items():
            stats = node.scheduler.stats()
            if stats.blocks_used > stats.blocks_total:
                raise InvariantBroken(f"{worker_id}: {stats.blocks_used} KV blocks used of {stats.blocks_total}")
            if self._allocator is not None:
                general, short = self._allocator.ledger.used(worker_id)
                short_total = int(stats.blocks_total * policy.short_pool_share)
                if general > stats.blocks_total - short_total or short > short_total:
                    raise InvariantBroken(f"{worker_id}: leases of {general}+{short} blocks exceed the pools")


def _first_of_two(flight: _Flight, node: SimNode) -> bool:
    """Whether `node` runs `flight` as the first node of a two-node chain (a prefill node, a prefix pull's source)."""
    return bool(flight.decode_id) and flight.worker_id == node.worker_id and flight.decode_id != node.worker_id


def result_summary(result: SimulationResult) -> dict[str, Any]:
    return {"simulated_s": result.simulated_s, "events": result.events, "wall_s": result.wall_s,
            "events_per_s": result.events_per_s, **result.counters}
