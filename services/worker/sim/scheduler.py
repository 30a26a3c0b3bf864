"""Continuous-batching scheduler of the sim engine (modelled on vLLM v1).

``SimScheduler.step()`` decides what one forward pass would run, advances
every sequence in it, and returns the tokens that pass produced together
with how long it would have taken on the profiled GPU. It never sleeps: the
async worker shell waits ``duration_s`` (scaled) and delivers the tokens.

One step:

1. Running sequences, oldest admission first. A prefilling sequence takes
   the next chunk of its prompt (at most the remaining token budget); a
   decoding one takes one token. A decoding sequence that needs a new KV
   block when none is free preempts the most recently admitted running
   sequence (possibly itself): its blocks are freed and it goes back to
   the FRONT of the waiting queue, keeping its generated tokens.
2. If nothing was preempted in this step, waiting requests are admitted in
   FIFO order while there is room (``max_num_seqs``, token budget, blocks).
   A request that does not fit blocks the queue (no skipping ahead). On
   admission all of its known tokens (prompt, plus output generated before
   a preemption) get KV slots at once; leading blocks found in the prefix
   cache count as computed and cost no prefill tokens. With the profile's
   ``lone_first_step``, the first step after requests reach an idle
   scheduler admits only the first of them; that step also pays the
   profile's ``wake_latency``.

A sequence emits its next output token in the step that finishes its
prefill, then one per decode step. A resumed sequence re-prefills prompt +
output and continues at the next position, so nothing is emitted twice.
KV slots follow vLLM: a sampled token gets its slot when it is fed back in
the next step, so a request needs at most ``prompt + max_tokens - 1`` slots.
"""

from __future__ import annotations

from collections import deque

import msgspec

from services.worker.sim.adapter_slots import AdapterSlots
from shared.kv.block_hash import adapter_root, chained_block_hashes
from services.worker.sim.blocks import BlockPool, KvCacheEvent
from shared.kv.step_profile import StepTimeProfile
from services.worker.sim.tokens import prompt_digest, stream_key, token_at


class SimRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    seed: int = 0
    # Output a previous run already produced (a request resumed on another
    # node): generation continues at position len(resume_output), with the
    # same tokens an uninterrupted run would produce. Counts toward max_tokens.
    resume_output: list[int] = []
    # Keep the KV blocks when the request finishes (a prefill node holds them
    # for a decode node to pull) until `release_held`.
    hold_kv: bool = False
    # The answer's exact tokens when the request constrains its output (a tool
    # call, a JSON schema; see `responder`): position p emits script[p], and the
    # request finishes after the last of them (or at max_tokens, if sooner).
    # Empty: free tokens from the stream key.
    script: list[int] = []
    # The LoRA adapter it runs with ("": the base model). An adapter's blocks are its own (they chain from
    # `shared.kv.block_hash.adapter_root`), and so are its tokens (the root goes into the stream key).
    adapter: str = ""


class FinishedInfo(msgspec.Struct, frozen=True):
    """Usage of a request that finished in this step (what an API response reports)."""

    request_id: str
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens served from the prefix cache at first admission
    # (usage.prompt_tokens_details.cached_tokens).
    cached_prompt_tokens: int
    num_preemptions: int


class StepOutcome(msgspec.Struct):
    duration_s: float
    # (request_id, token_id); at most one per sequence, in batch order.
    emitted: list[tuple[str, int]]
    # Requests that reached max_tokens (or the end of their script); their last token is in `emitted`.
    finished: list[str]
    # Requests pushed back to waiting in this step.
    preempted: list[str]
    prefill_tokens: int
    decode_seqs: int
    kv_tokens: int
    # One entry per `finished` id, same order.
    finished_info: list[FinishedInfo] = []
    # Requests admitted for the first time (a re-admission after a preemption
    # is not counted: the engine took the request in once).
    new_requests: int = 0
    # The first step after requests reached an idle scheduler (charged the profile's wake_latency).
    wakes: bool = False
    # Seconds this step spent loading LoRA adapters for the requests it admitted (vLLM loads them before the
    # forward pass, so the whole batch waits), and how many it loaded.
    adapter_load_s: float = 0.0
    adapter_loads: int = 0


class SchedulerStats(msgspec.Struct):
    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_cached: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    steps: int
    blocks_held: int = 0
    blocks_evicted: int = 0
    # Requests whose prompt is not fully computed: the waiting ones, and running ones still prefilling in chunks.
    prefilling: int = 0
    # LoRA adapters in batch slots, those running requests hold, and those only in host memory (`AdapterSlots`);
    # loads into a slot, and those of them from storage (not in host memory), with their seconds.
    adapters_active: list[str] = []
    adapters_running: list[str] = []
    adapters_cached: list[str] = []
    adapter_loads: int = 0
    adapter_fetches: int = 0
    adapter_fetch_seconds: float = 0.0


class _Sequence:
    """Mutable scheduling state of one request."""

    __slots__ = (
        "request",
        "request_id",
        "prompt_block_hashes",
        "resume_block_hashes",
        "stream_key",
        "output",
        "num_computed",
        "prefill_end",
        "is_running",
        "cached_prompt_tokens",
        "num_preemptions",
        "holds_adapter",
    )

    def __init__(self, request: SimRequest, prompt_block_hashes: list[int], key: int) -> None:
        self.request = request
        self.request_id = request.request_id
        self.prompt_block_hashes = prompt_block_hashes
        # Hashes of prompt + output for a re-admission after a preemption,
        # kept while the sequence waits so retries do not rehash.
        self.resume_block_hashes: list[int] | None = None
        self.stream_key = key
        self.output: list[int] = []
        # Tokens whose KV is computed in the current admission.
        self.num_computed = 0
        # Token count the current admission must prefill before decoding.
        self.prefill_end = 0
        self.is_running = False
        self.cached_prompt_tokens: int | None = None
        self.num_preemptions = 0
        # Whether it holds a batch slot of its LoRA adapter (from admission to its end or preemption).
        self.holds_adapter = False

    def known_tokens(self) -> list[int]:
        prompt = self.request.prompt_token_ids
        return prompt + self.output if self.output else prompt


class SimScheduler:
    """Continuous batching over a ``BlockPool``; see the module docstring."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_batched_tokens: int,
        profile: StepTimeProfile,
        output_token_range: tuple[int, int],
        record_kv_events: bool = False,
        adapters: AdapterSlots | None = None,
        adapter_activate_s: float = 0.0,
        adapter_load_s: float = 0.0,
    ) -> None:
        """`adapters`: the LoRA adapter slots (None: no adapter runs here); loading one into a slot costs its step
        `adapter_activate_s`, plus `adapter_load_s` when it is not in host memory either."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {max_batched_tokens}")
        low, high = output_token_range
        # Output tokens are hashed into KV blocks, which packs them as uint32.
        if not 0 <= low < high <= 1 << 32:
            raise ValueError(
                f"output_token_range must be a non-empty range within [0, 2**32), got {output_token_range}"
            )
        self._pool = BlockPool(num_blocks=num_blocks, block_size=block_size, record_events=record_kv_events)
        self._block_size = block_size
        self._max_num_seqs = max_num_seqs
        self._max_batched_tokens = max_batched_tokens
        self._profile = profile
        self._token_low = low
        self._token_span = high - low
        self._live: dict[str, _Sequence] = {}
        self._waiting: deque[_Sequence] = deque()
        # Admission order: the last one is the first to be preempted.
        self._running: list[_Sequence] = []
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._preemptions = 0
        self._steps = 0
        # Finished requests whose blocks stay allocated: request id -> block count.
        self._held: dict[str, int] = {}
        self._imports = 0
        # Requests reached an idle scheduler since the last step (see `lone_first_step`).
        self._woken_by_arrival = False
        self._adapters = adapters
        self._adapter_activate_s = adapter_activate_s
        self._adapter_load_s = adapter_load_s
        self._adapter_loads = 0
        self._adapter_fetches = 0
        self._adapter_fetch_seconds = 0.0

    # --- requests ----------------------------------------------------------------

    def add(self, request: SimRequest) -> None:
        """Queue a request at the back of the waiting queue."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError(f"request {request.request_id!r}: prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be >= 1, got {request.max_tokens}")
        capacity = self._pool.num_blocks * self._block_size
        if len(prompt) + request.max_tokens > capacity:
            raise ValueError(
                f"request {request.request_id!r}: prompt ({len(prompt)} tokens) + max_tokens "
                f"({request.max_tokens}) exceeds the KV capacity of {capacity} tokens"
            )
        if request.request_id in self._live or request.request_id in self._held:
            raise ValueError(f"request {request.request_id!r} is already queued or running")
        if len(request.resume_output) >= request.max_tokens:
            raise ValueError(
                f"request {request.request_id!r}: resumes after {len(request.resume_output)} tokens, "
                f"nothing left of max_tokens ({request.max_tokens})"
            )
        if request.script and len(request.resume_output) >= len(request.script):
            raise ValueError(
                f"request {request.request_id!r}: resumes after {len(request.resume_output)} tokens, "
                f"past the end of its scripted answer ({len(request.script)} tokens)"
            )
        if request.adapter and self._adapters is None:
            raise ValueError(f"request {request.request_id!r}: this node serves no LoRA adapter, and {request.adapter!r} is one")
        try:
            root = adapter_root(request.adapter) if request.adapter else None
            hashes = chained_block_hashes(prompt, self._block_size, root)
            digest = prompt_digest(prompt) ^ (root or 0)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"request {request.request_id!r}: token ids must be ints in [0, 2**32)") from exc
        seq = _Sequence(request, hashes, stream_key(request.seed, digest))
        seq.output = list(request.resume_output)
        if not self.has_work():
            self._woken_by_arrival = True
        self._live[request.request_id] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a queued or running request and free its blocks; False if unknown."""
        seq = self._live.pop(request_id, None)
        if seq is None:
            return False
        if seq.is_running:
            self._pool.free(request_id)
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._release_adapter(seq)
        return True

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished `hold_kv` request kept; False if none are held."""
        if self._held.pop(request_id, None) is None:
            return False
        self._pool.free(request_id)
        return True

    @property
    def held_blocks(self) -> int:
        return sum(self._held.values())

    def import_prefix(self, token_ids: list[int]) -> int:
        """Enter the full blocks of `token_ids` into the prefix cache as if computed here.

        This is KV that arrived from another node: the next request with
        this prefix hits it. Returns the tokens now cached (0 when the pool
        has no room; the request then computes its prompt itself).
        """
        full = len(token_ids) // self._block_size * self._block_size
        if full == 0:
            return 0
        self._imports += 1
        seq_id = f"\x00import-{self._imports}"
        # One more token than the blocks: `allocate` never counts the last token as a hit.
        tokens = list(token_ids[:full]) + [0]
        if self._pool.allocate(seq_id, tokens) is None:
            return 0
        self._pool.mark_computed(seq_id, full)
        self._pool.free(seq_id)
        return full

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Leading tokens of `token_ids` (full blocks, no adapter) in the prefix cache now."""
        return self._pool.cached_prefix_blocks(chained_block_hashes(token_ids, self._block_size, None)) * self._block_size

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def live_requests(self) -> list[str]:
        """Ids of the requests queued or running, in no particular order."""
        return list(self._live)

    def cached_prompt_tokens(self, request_id: str) -> int:
        """Prompt tokens that hit the prefix cache when the request was first admitted.

        0 until then; KeyError once it has finished or been aborted (the
        finishing step's ``StepOutcome.finished_info`` carries the value).
        """
        return self._live[request_id].cached_prompt_tokens or 0

    def generated_tokens(self, request_id: str) -> list[int]:
        """Output emitted so far by a live request (a copy)."""
        return list(self._live[request_id].output)

    def stats(self) -> SchedulerStats:
        pool = self._pool
        return SchedulerStats(
            running=len(self._running),
            waiting=len(self._waiting),
            prefilling=len(self._waiting) + sum(1 for seq in self._running if seq.num_computed < seq.prefill_end),
            blocks_total=pool.num_blocks,
            blocks_used=pool.num_used,
            blocks_held=self.held_blocks,
            blocks_cached=pool.num_cached,
            blocks_evicted=pool.evicted,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            preemptions=self._preemptions,
            steps=self._steps,
            adapters_active=[] if self._adapters is None else self._adapters.in_slots(),
            adapters_running=[] if self._adapters is None else list(self._adapters.running()),
            adapters_cached=[] if self._adapters is None else self._adapters.in_host_only(),
            adapter_loads=self._adapter_loads,
            adapter_fetches=self._adapter_fetches,
            adapter_fetch_seconds=self._adapter_fetch_seconds,
        )

    def drain_kv_events(self) -> list[KvCacheEvent]:
        """Prefix-cache events since the last call (needs ``record_kv_events``)."""
        return self._pool.drain_events()

    # --- the step ------------------------------------------------------------------

    def step(self) -> StepOutcome:
        """Run one batched forward pass; an idle step returns zero duration."""
        outcome = StepOutcome(
            duration_s=0.0, emitted=[], finished=[], preempted=[], prefill_tokens=0, decode_seqs=0, kv_tokens=0
        )
        if not self.has_work():
            return outcome
        self._steps += 1
        budget = self._max_batched_tokens
        pool = self._pool
        running = self._running
        survivors: list[_Sequence] = []

        index = 0
        # `running` shrinks from the end when sequences are preempted.
        while index < len(running):
            seq = running[index]
            index += 1
            if budget == 0:
                survivors.append(seq)
                continue
            if seq.num_computed < seq.prefill_end:
                chunk = min(seq.prefill_end - seq.num_computed, budget)
                budget -= chunk
                done = self._prefill(seq, chunk, outcome)
            else:
                # The fed-back token needs a KV slot; the pool is rarely full.
                if not pool.append_token(seq.request_id, seq.output[-1]) and not self._preempt_for_slot(
                    seq, running, outcome
                ):
                    break  # it preempted itself: it was the last one
                budget -= 1
                seq.num_computed += 1
                outcome.decode_seqs += 1
                outcome.kv_tokens += seq.num_computed
                done = self._emit(seq, outcome)
            if done:
                self._finish(seq, outcome)
            else:
                survivors.append(seq)

        # As vLLM: a step that had to preempt has no room to admit.
        if not outcome.preempted:
            # vLLM's engine core starts a step as soon as the first request of
            # a burst reaches it; the serving process is still handing over the
            # others, one at a time, so they join the next step.
            lone = self._profile.lone_first_step and self._woken_by_arrival
            self._admit_waiting(survivors, budget, outcome, max_new=1 if lone else self._max_num_seqs)
        outcome.wakes = self._woken_by_arrival
        self._woken_by_arrival = False
        self._running = survivors
        outcome.duration_s = self._profile.step_seconds(
            outcome.prefill_tokens,
            outcome.decode_seqs,
            outcome.kv_tokens,
            outcome.new_requests,
            len(outcome.emitted),
            outcome.wakes,
        ) + outcome.adapter_load_s
        return outcome

    def _admit_waiting(self, running: list[_Sequence], budget: int, outcome: StepOutcome, max_new: int) -> None:
        waiting = self._waiting
        # Requests whose adapter finds no batch slot (every slot runs another adapter's requests) stay waiting,
        # in their order, while later ones go ahead: as vLLM's scheduler skips them.
        skipped: list[_Sequence] = []
        while waiting and budget > 0 and len(running) < self._max_num_seqs:
            seq = waiting[0]
            if not self._adapter_fits(seq):
                skipped.append(waiting.popleft())
                continue
            is_new = seq.cached_prompt_tokens is None
            if is_new and outcome.new_requests == max_new:
                break
            if not self._allocate(seq):
                break  # head-of-line: later requests wait behind it
            waiting.popleft()
            self._take_adapter(seq, outcome)
            if is_new:
                outcome.new_requests += 1
            # The hit is capped below the token count, so the chunk is >= 1.
            chunk = min(seq.prefill_end - seq.num_computed, budget)
            budget -= chunk
            if self._prefill(seq, chunk, outcome):
                self._finish(seq, outcome)
            else:
                running.append(seq)
        waiting.extendleft(reversed(skipped))

    def _adapter_fits(self, seq: _Sequence) -> bool:
        adapter = seq.request.adapter
        if not adapter or seq.holds_adapter:
            return True
        if self._adapters is None:
            raise ValueError(f"request {seq.request_id!r} asks for adapter {adapter!r}, and this node serves none")
        return self._adapters.can_start(adapter)

    def _take_adapter(self, seq: _Sequence, outcome: StepOutcome) -> None:
        """`seq`'s adapter takes its batch slot; loading it (when not in a slot already) lengthens this step."""
        adapter = seq.request.adapter
        if not adapter or seq.holds_adapter or self._adapters is None:
            return
        residence, _ = self._adapters.start(adapter)
        seq.holds_adapter = True
        if residence != "slot":
            seconds = self._adapter_activate_s + (self._adapter_load_s if residence == "none" else 0.0)
            outcome.adapter_load_s += seconds
            outcome.adapter_loads += 1
            self._adapter_loads += 1
            if residence == "none":
                self._adapter_fetches += 1
                self._adapter_fetch_seconds += seconds

    def _release_adapter(self, seq: _Sequence) -> None:
        if seq.holds_adapter and self._adapters is not None:
            self._adapters.finish(seq.request.adapter)
            seq.holds_adapter = False

    def _allocate(self, seq: _Sequence) -> bool:
        """KV slots for everything ``seq`` knows; False if the pool is too full."""
        tokens = seq.known_tokens()
        hashes = seq.prompt_block_hashes
        if seq.output:
            if seq.resume_block_hashes is None:
                # Continue the prompt's chain over the generated tokens (the
                # prompt's partial block merges with them).
                parent = hashes[-1] if hashes else (adapter_root(seq.request.adapter) if seq.request.adapter else None)
                rest = tokens[len(hashes) * self._block_size :]
                seq.resume_block_hashes = hashes + chained_block_hashes(rest, self._block_size, parent)
            hashes = seq.resume_block_hashes
        hit_tokens = self._pool.allocate(seq.request_id, tokens, hashes)
        if hit_tokens is None:
            return False
        seq.resume_block_hashes = None  # the output grows from here on
        seq.is_running = True
        seq.num_computed = hit_tokens
        seq.prefill_end = len(tokens)
        if seq.cached_prompt_tokens is None:
            seq.cached_prompt_tokens = hit_tokens
        self._prefix_query_tokens += len(tokens)
        self._prefix_hit_tokens += hit_tokens
        return True

    def _prefill(self, seq: _Sequence, chunk: int, outcome: StepOutcome) -> bool:
        """Run ``chunk`` prompt tokens; True if the sequence finished."""
        seq.num_computed += chunk
        outcome.prefill_tokens += chunk
        outcome.kv_tokens += seq.num_computed
        self._pool.mark_computed(seq.request_id, seq.num_computed)
        if seq.num_computed < seq.prefill_end:
            return False
        return self._emit(seq, outcome)

    def _preempt_for_slot(self, seq: _Sequence, running: list[_Sequence], outcome: StepOutcome) -> bool:
        """Preempt until the token ``seq`` feeds back gets a KV slot.

        Victims come from the end of ``running`` (latest admitted), which is
        never a sequence already served in this step. False if ``seq`` had
        to preempt itself.
        """
        while True:
            victim = running.pop()
            self._preempt(victim, outcome)
            if victim is seq:
                return False
            if self._pool.append_token(seq.request_id, seq.output[-1]):
                return True

    def _preempt(self, seq: _Sequence, outcome: StepOutcome) -> None:
        self._pool.free(seq.request_id)
        self._release_adapter(seq)
        seq.is_running = False
        seq.num_computed = 0
        seq.prefill_end = 0
        seq.num_preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(seq)
        outcome.preempted.append(seq.request_id)

    def _emit(self, seq: _Sequence, outcome: StepOutcome) -> bool:
        """Sample the next output token; True if that was the last one."""
        output = seq.output
        script = seq.request.script
        if script:
            token = script[len(output)]
            output.append(token)
            outcome.emitted.append((seq.request_id, token))
            return len(output) == seq.request.max_tokens or len(output) == len(script)
        token = token_at(seq.stream_key, len(output), self._token_low, self._token_span)
        output.append(token)
        outcome.emitted.append((seq.request_id, token))
        return len(output) == seq.request.max_tokens

    def _finish(self, seq: _Sequence, outcome: StepOutcome) -> None:
        if seq.request.hold_kv:
            self._held[seq.request_id] = self._pool.blocks_held_by(seq.request_id)
        else:
            self._pool.free(seq.request_id)
        seq.is_running = False
        self._release_adapter(seq)
        del self._live[seq.request_id]
        outcome.finished.append(seq.request_id)
        outcome.finished_info.append(
            FinishedInfo(
                request_id=seq.request_id,
                prompt_tokens=len(seq.request.prompt_token_ids),
                completion_tokens=len(seq.output),
                cached_prompt_tokens=seq.cached_prompt_tokens or 0,
                num_preemptions=seq.num_preemptions,
            )
        )
