"""One simulated node: the sim engine's real `SimScheduler`, stepping in virtual time.

As the live sim engine's loop: a step is decided when it starts (the batch
is what was admitted by then), lasts the profile's step time divided by the
node's speed, and its tokens are delivered when it ends; a request that
arrives meanwhile joins the next step. The node also keeps what its worker
would report: heartbeat statistics (rates since the previous heartbeat)
and prefix-cache changes since the previous KV-event batch. With LoRA
settings that give it slots, its scheduler holds adapters as vLLM does
(`services.worker.sim.adapter_slots`) and its heartbeats say where they are.
"""

from __future__ import annotations

from collections.abc import Callable

from contracts.messages import Heartbeat, KvEvents, WorkerRegistration
from loadtest.simulation.events import EventQueue
from services.worker.engines.base import net_kv_delta
from services.worker.engines.sim import StepStats, build_scheduler
from services.worker.sim import SimRequest, StepOutcome
from shared.kv.step_profile import StepTimeProfile
from shared.config import LoraSettings, SimSettings

StepListener = Callable[["SimNode", StepOutcome], None]


class SimNode:
    def __init__(
        self,
        registration: WorkerRegistration,
        profile: StepTimeProfile,
        speed: float,
        settings: SimSettings,
        output_token_range: tuple[int, int],
        events: EventQueue,
        on_step: StepListener,
        step_overhead_s: float = 0.0,
        lora: LoraSettings | None = None,
    ) -> None:
        self.registration = registration
        self.worker_id = registration.worker_id
        self.profile = profile
        self.speed = speed
        self.scheduler = build_scheduler(settings, profile, output_token_range, lora)
        self.alive = True
        # Draining: it finishes what it runs and takes nothing new (its heartbeats say so).
        self.draining = False
        self._events = events
        self._on_step = on_step
        # Wall time a live engine's step takes beyond its simulated duration (`Latencies.step_overhead_s`).
        self._step_overhead_s = step_overhead_s
        self._stepping = False
        self._under_way: StepOutcome | None = None
        self._step_ends_at = 0.0
        self._heartbeat_seq = 0
        self._kv_batches = 0
        # A KV-event batch is scheduled (the simulation sends one per interval in which the node stepped).
        self.kv_batch_due = False
        self._step_stats = StepStats(self.scheduler, events.now)
        self.busy_s = 0.0  # simulated seconds it spent stepping

    def add(self, request: SimRequest) -> None:
        """Queue a request (ValueError when the engine can never run it) and make sure a step comes."""
        self.scheduler.add(request)
        if not self._stepping:
            self._stepping = True
            # Requests that arrive at the same instant are all queued before the first step
            # (a `lone_first_step` profile then runs only the first of them in it).
            self._events.after(0.0, self._step)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def fail(self) -> list[str]:
        """The node dies: it never steps, beats or answers again. Returns the requests it had not finished.

        Those include the ones that end in the step under way: the scheduler
        counts them done when the step starts, but nobody hears of it now.
        """
        self.alive = False
        ending = [info.request_id for info in self._under_way.finished_info] if self._under_way else []
        return self.scheduler.live_requests() + ending

    def _step(self) -> None:
        if not self.alive:
            return
        if not self.scheduler.has_work():
            self._stepping = False
            return
        outcome = self._under_way = self.scheduler.step()
        duration = outcome.duration_s / self.speed
        if duration > 0:
            duration += self._step_overhead_s
        self.busy_s += duration
        self._step_ends_at = self._events.now + duration
        self._events.after(duration, self._deliver, outcome)

    def _deliver(self, outcome: StepOutcome) -> None:
        if not self.alive:
            return
        self._under_way = None
        self._step_stats.observe(outcome)
        self._on_step(self, outcome)
        self._step()

    def busy_for(self) -> float:
        """Seconds until the step under way ends (0 when idle)."""
        return max(0.0, self._step_ends_at - self._events.now) if self._stepping else 0.0

    def heartbeat(self) -> Heartbeat:
        self._heartbeat_seq += 1
        return Heartbeat(self.registration, self._step_stats.take(self._events.now), sent_at=self._events.now,
                         seq=self._heartbeat_seq, draining=self.draining)

    def kv_events(self) -> KvEvents | None:
        """The prefix-cache changes since the last batch, as the worker publishes them; None when there are none."""
        delta = net_kv_delta((e.kind == "stored", e.block_hash) for e in self.scheduler.drain_kv_events())
        if not delta:
            return None
        self._kv_batches += 1
        return KvEvents(self.worker_id, self._kv_batches, self.registration.block_size, delta.stored, delta.removed,
                        delta.cleared)
