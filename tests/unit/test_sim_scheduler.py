"""Continuous-batching sim scheduler, its step-time profiles and its token stream."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.worker.engines.sim import StepStats
from services.worker.sim import (
    NAMED_PROFILES,
    SimRequest,
    SimScheduler,
    StepOutcome,
    StepTimeProfile,
    get_profile,
    output_token,
    prompt_digest,
)

TOKEN_RANGE = (1000, 2**31)
UNIT_PROFILE = StepTimeProfile(name="unit", a=1.0, b=0.01, c=0.1, d=0.001)


def make_scheduler(**overrides: object) -> SimScheduler:
    options: dict = {
        "num_blocks": 64,
        "block_size": 4,
        "max_num_seqs": 8,
        "max_batched_tokens": 64,
        "profile": UNIT_PROFILE,
        "output_token_range": TOKEN_RANGE,
    }
    options.update(overrides)
    return SimScheduler(**options)


def expected_tokens(request: SimRequest) -> list[int]:
    digest = prompt_digest(request.prompt_token_ids)
    return [output_token(request.seed, digest, k, TOKEN_RANGE) for k in range(request.max_tokens)]


def run_all(scheduler: SimScheduler, max_steps: int = 100_000) -> tuple[dict[str, list[int]], list[StepOutcome]]:
    emitted: dict[str, list[int]] = {}
    outcomes = []
    for _ in range(max_steps):
        if not scheduler.has_work():
            return emitted, outcomes
        outcome = scheduler.step()
        outcomes.append(outcome)
        for request_id, token in outcome.emitted:
            emitted.setdefault(request_id, []).append(token)
    raise AssertionError("scheduler did not drain")


# --- tokens --------------------------------------------------------------------


def test_output_tokens_are_deterministic_and_in_range() -> None:
    digest = prompt_digest([1, 2, 3])
    tokens = [output_token(7, digest, k, (5, 9)) for k in range(200)]
    assert tokens == [output_token(7, digest, k, (5, 9)) for k in range(200)]
    assert set(tokens) == {5, 6, 7, 8}
    assert output_token(8, digest, 0, (0, 2**31)) != output_token(7, digest, 0, (0, 2**31))
    assert prompt_digest([1, 2, 3]) != prompt_digest([1, 2, 4])
    # Pinned values: the stream must never change, since a request migrated
    # to a node running another build must continue the same tokens.
    assert prompt_digest([1, 2, 3]) == 0x9010AE5EF1711841
    assert [output_token(7, 0x9010AE5EF1711841, k, (0, 2**31)) for k in range(3)] == [
        1402036749,
        1609436027,
        578809810,
    ]
    with pytest.raises(ValueError):
        output_token(0, digest, 0, (3, 3))


# --- profiles ------------------------------------------------------------------


def test_profiles_cover_the_named_set_and_do_nothing_for_an_empty_step() -> None:
    required = (
        "zero",
        "tiny-cpu",
        "a100-80g-llama3-8b",
        "h100-80g-llama3-8b",
        "a100-80g-llama3-70b-tp4",
        "h100-80g-llama3-70b-tp4",
    )
    for name in required:
        profile = get_profile(name)
        assert profile.name == name
        assert profile.step_seconds(0, 0, 0) == 0.0
    assert get_profile("zero").step_seconds(100, 10, 1000) == 0.0
    tiny = get_profile("tiny-cpu")
    assert tiny.step_seconds(100, 10, 5000) == pytest.approx(2e-3 + 100 * 2e-5 + 10 * 2e-4)
    assert UNIT_PROFILE.step_seconds(3, 2, 10) == pytest.approx(1.0 + 0.03 + 0.2 + 0.01)
    # The named profiles have no per-request terms: new requests and emitted tokens cost nothing extra.
    assert tiny.step_seconds(100, 10, 5000, new_requests=3, emitted_tokens=12) == tiny.step_seconds(100, 10, 5000)
    with_requests = msgspec.structs.replace(UNIT_PROFILE, per_request=0.5, per_output_token=0.25)
    assert with_requests.step_seconds(3, 2, 10, new_requests=1, emitted_tokens=3) == pytest.approx(1.24 + 0.5 + 0.75)


def test_gpu_profiles_are_ordered_as_the_hardware() -> None:
    h100, a100 = get_profile("h100-80g-llama3-8b"), get_profile("a100-80g-llama3-8b")
    assert 0 < h100.a < a100.a and 0 < h100.b < a100.b and 0 < h100.d < a100.d
    big = get_profile("h100-80g-llama3-70b-tp4")
    assert big.a > h100.a
    # A 2k-token prefill on an 8B model takes tens of milliseconds on an H100.
    assert 0.02 < h100.step_seconds(2048, 0, 2048) < 0.2


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="tiny-cpu"):
        get_profile("nope")
    with pytest.raises(TypeError):
        NAMED_PROFILES["x"] = NAMED_PROFILES["zero"]  # type: ignore[index]
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"name":"x","a":1,"b":1,"c":1,"e":1}', type=StepTimeProfile)


# --- scheduling ----------------------------------------------------------------


def test_single_request_prefills_then_decodes_one_token_per_step() -> None:
    scheduler = make_scheduler()
    request = SimRequest("r", list(range(10)), max_tokens=3, seed=1)
    scheduler.add(request)
    first = scheduler.step()
    assert first.prefill_tokens == 10 and first.decode_seqs == 0
    assert first.kv_tokens == 10
    assert first.emitted == [("r", expected_tokens(request)[0])]
    assert first.duration_s == pytest.approx(UNIT_PROFILE.step_seconds(10, 0, 10))
    second = scheduler.step()
    assert (second.prefill_tokens, second.decode_seqs, second.kv_tokens) == (0, 1, 11)
    third = scheduler.step()
    assert third.finished == ["r"]
    assert [info.completion_tokens for info in third.finished_info] == [3]
    assert [t for _, t in first.emitted + second.emitted + third.emitted] == expected_tokens(request)
    assert not scheduler.has_work()
    assert scheduler.stats().blocks_used == 0
    idle = scheduler.step()
    assert idle.duration_s == 0.0 and idle.emitted == []


def test_per_request_terms_charge_the_step_that_admits_and_the_step_that_emits() -> None:
    profile = msgspec.structs.replace(UNIT_PROFILE, per_request=0.5, per_output_token=0.25)
    scheduler = make_scheduler(profile=profile, max_batched_tokens=12)
    scheduler.add(SimRequest("a", list(range(8)), max_tokens=3))
    scheduler.add(SimRequest("b", list(range(100, 108)), max_tokens=3))
    # Both admitted; a's prefill ends (one token), b's first chunk does not.
    first = scheduler.step()
    assert (first.new_requests, len(first.emitted), first.prefill_tokens) == (2, 1, 12)
    assert first.duration_s == pytest.approx(UNIT_PROFILE.step_seconds(12, 0, 12) + 2 * 0.5 + 0.25)
    # b is not admitted again: its prefill ends beside a's decode, two tokens.
    second = scheduler.step()
    assert (second.new_requests, len(second.emitted)) == (0, 2)
    assert second.duration_s == pytest.approx(
        UNIT_PROFILE.step_seconds(second.prefill_tokens, second.decode_seqs, second.kv_tokens) + 2 * 0.25
    )


def test_a_preempted_request_pays_its_per_request_cost_once() -> None:
    requests = [SimRequest(f"r{i}", [i % 3] * 5 + [i] * 3, max_tokens=20, seed=i) for i in range(6)]
    scheduler = make_scheduler(num_blocks=12, max_num_seqs=6)
    for request in requests:
        scheduler.add(request)
    _, outcomes = run_all(scheduler)
    assert scheduler.stats().preemptions > 0
    assert sum(o.new_requests for o in outcomes) == len(requests)


def test_lone_first_step_runs_the_first_of_a_burst_alone_when_idle() -> None:
    def burst_to_idle(profile: StepTimeProfile) -> SimScheduler:
        scheduler = make_scheduler(profile=profile, num_blocks=200)
        for i in range(3):
            scheduler.add(SimRequest(f"r{i}", [i] * 4, max_tokens=5))
        return scheduler

    assert [rid for rid, _ in burst_to_idle(UNIT_PROFILE).step().emitted] == ["r0", "r1", "r2"]
    scheduler = burst_to_idle(msgspec.structs.replace(UNIT_PROFILE, lone_first_step=True))
    assert [rid for rid, _ in scheduler.step().emitted] == ["r0"]
    # The rest of the burst joins the next step.
    assert [rid for rid, _ in scheduler.step().emitted] == ["r0", "r1", "r2"]
    # Requests that arrive while the engine is busy are all taken in together.
    scheduler.add(SimRequest("busy0", [7] * 4, max_tokens=1))
    scheduler.add(SimRequest("busy1", [8] * 4, max_tokens=1))
    assert scheduler.step().new_requests == 2
    run_all(scheduler)
    # Idle again: the next burst starts alone again.
    scheduler.add(SimRequest("late0", [9] * 4, max_tokens=1))
    scheduler.add(SimRequest("late1", [10] * 4, max_tokens=1))
    assert scheduler.step().finished == ["late0"]
    assert scheduler.step().finished == ["late1"]


def test_wake_latency_charges_the_first_step_after_reaching_idle_and_b2_every_prefill() -> None:
    profile = msgspec.structs.replace(UNIT_PROFILE, wake_latency=0.75, b2=0.001)
    scheduler = make_scheduler(profile=profile, num_blocks=200)
    scheduler.add(SimRequest("r0", [1] * 4, max_tokens=2))
    scheduler.add(SimRequest("r1", [2] * 6, max_tokens=2))
    first = scheduler.step()
    assert first.wakes and first.prefill_tokens == 10
    assert first.duration_s == pytest.approx(UNIT_PROFILE.step_seconds(10, 0, 10) + 0.001 * 10**2 + 0.75)
    # A request arriving at a busy engine wakes nothing.
    scheduler.add(SimRequest("busy", [3] * 3, max_tokens=1))
    second = scheduler.step()
    assert not second.wakes
    assert second.duration_s == pytest.approx(
        UNIT_PROFILE.step_seconds(second.prefill_tokens, second.decode_seqs, second.kv_tokens)
        + 0.001 * second.prefill_tokens**2
    )
    run_all(scheduler)
    scheduler.add(SimRequest("late", [4] * 4, max_tokens=1))
    assert scheduler.step().wakes


@settings(max_examples=60, deadline=None)
@given(
    bursts=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=6), min_size=1, max_size=4),
    max_batched_tokens=st.integers(4, 64),
    lone_first_step=st.booleans(),
)
def test_the_new_terms_add_exactly_their_share_to_each_step(
    bursts: list[list[int]], max_batched_tokens: int, lone_first_step: bool
) -> None:
    """Same requests with and without b2 and wake_latency: identical steps, durations apart by those terms alone."""
    base = msgspec.structs.replace(UNIT_PROFILE, lone_first_step=lone_first_step)
    extended = msgspec.structs.replace(base, b2=1e-3, wake_latency=0.5)

    def run(profile: StepTimeProfile) -> list[StepOutcome]:
        scheduler = make_scheduler(profile=profile, num_blocks=1000, max_batched_tokens=max_batched_tokens)
        outcomes = []
        for b, lengths in enumerate(bursts):  # each burst reaches an idle engine
            for i, length in enumerate(lengths):
                scheduler.add(SimRequest(f"b{b}-{i}", [b * 50 + i] * length, max_tokens=3))
            outcomes += run_all(scheduler)[1]
        return outcomes

    plain, with_terms = run(base), run(extended)
    assert [(o.prefill_tokens, o.decode_seqs, o.emitted) for o in plain] == [
        (o.prefill_tokens, o.decode_seqs, o.emitted) for o in with_terms
    ]
    assert sum(o.wakes for o in with_terms) == len(bursts)
    for p, w in zip(plain, with_terms, strict=True):
        assert w.duration_s - p.duration_s == pytest.approx(1e-3 * p.prefill_tokens**2 + 0.5 * w.wakes)


def test_chunked_prefill_respects_the_token_budget() -> None:
    scheduler = make_scheduler(max_batched_tokens=4)
    request = SimRequest("r", list(range(10)), max_tokens=2)
    scheduler.add(request)
    chunks = [scheduler.step() for _ in range(3)]
    assert [o.prefill_tokens for o in chunks] == [4, 4, 2]
    assert [o.kv_tokens for o in chunks] == [4, 8, 10]
    assert [o.emitted for o in chunks[:2]] == [[], []]
    assert len(chunks[2].emitted) == 1


def test_a_request_counts_as_prefilling_until_its_prompt_is_computed_and_the_heartbeat_says_so() -> None:
    scheduler = make_scheduler(max_batched_tokens=4, max_num_seqs=1)
    scheduler.add(SimRequest("long", list(range(10)), max_tokens=3))
    scheduler.add(SimRequest("next", [7, 8], max_tokens=1))
    counts = []
    for _ in range(3):
        scheduler.step()
        stats = scheduler.stats()
        counts.append((stats.running, stats.waiting, stats.prefilling))
    # Admitted and still prefilling in chunks for two steps, then decoding while "next" waits.
    assert counts == [(1, 1, 2), (1, 1, 2), (1, 1, 1)]
    heartbeat_stats = StepStats(scheduler, now=0.0).take(now=1.0)
    assert (heartbeat_stats.waiting, heartbeat_stats.prefilling) == (1, 1)
    run_all(scheduler)
    assert scheduler.stats().prefilling == 0
    assert StepStats(scheduler, now=0.0).take(now=1.0).prefilling == 0


def test_token_budget_and_max_num_seqs_bound_every_step() -> None:
    scheduler = make_scheduler(max_num_seqs=3, max_batched_tokens=7, num_blocks=200)
    requests = [SimRequest(f"r{i}", [i] * (3 + i), max_tokens=4, seed=i) for i in range(8)]
    for request in requests:
        scheduler.add(request)
    emitted, outcomes = run_all(scheduler)
    for outcome in outcomes:
        assert outcome.prefill_tokens + outcome.decode_seqs <= 7
        assert len({rid for rid, _ in outcome.emitted}) == len(outcome.emitted) <= 3
    assert emitted == {r.request_id: expected_tokens(r) for r in requests}


def test_prefix_cache_hits_are_reported_and_cost_no_prefill() -> None:
    scheduler = make_scheduler()
    prompt = list(range(20))
    scheduler.add(SimRequest("a", prompt, max_tokens=1))
    first = scheduler.step()
    assert first.finished_info[0].cached_prompt_tokens == 0
    scheduler.add(SimRequest("b", prompt + [99], max_tokens=2))
    second = scheduler.step()
    assert second.prefill_tokens == 1  # 20 of 21 tokens were cached
    assert scheduler.cached_prompt_tokens("b") == 20
    stats = scheduler.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (41, 20)
    done = scheduler.step()
    assert done.finished_info[0].cached_prompt_tokens == 20
    with pytest.raises(KeyError):
        scheduler.cached_prompt_tokens("b")


def test_a_follow_up_turn_hits_the_blocks_filled_during_decode() -> None:
    scheduler = make_scheduler()
    first = SimRequest("turn1", list(range(6)), max_tokens=9)
    scheduler.add(first)
    emitted, _ = run_all(scheduler)
    # KV exists for the prompt and all answer tokens but the last one: 14 tokens.
    follow_up = list(range(6)) + emitted["turn1"] + [7, 7, 7]
    scheduler.add(SimRequest("turn2", follow_up, max_tokens=1))
    outcome = scheduler.step()
    assert outcome.finished_info[0].cached_prompt_tokens == 12


def test_waiting_requests_are_admitted_fifo_without_skipping_ahead() -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_batched_tokens=100)
    scheduler.add(SimRequest("big0", list(range(20)), max_tokens=4))  # 5 blocks, up to 6
    scheduler.add(SimRequest("big1", list(range(100, 124)), max_tokens=4))  # 6 blocks: must wait
    scheduler.add(SimRequest("small", [7, 8], max_tokens=4))  # would fit, but queues behind big1
    outcome = scheduler.step()
    assert [rid for rid, _ in outcome.emitted] == ["big0"]
    assert scheduler.stats().waiting == 2
    order = []
    while scheduler.has_work():
        for rid, _ in scheduler.step().emitted:
            if rid not in order:
                order.append(rid)
    assert order == ["big0", "big1", "small"]


def test_preemption_under_block_pressure_keeps_outputs_identical() -> None:
    requests = [SimRequest(f"r{i}", [i % 3] * 5 + [i] * 3, max_tokens=20, seed=i) for i in range(6)]
    roomy = make_scheduler(num_blocks=200, max_num_seqs=6)
    tight = make_scheduler(num_blocks=12, max_num_seqs=6)
    for scheduler in (roomy, tight):
        for request in requests:
            scheduler.add(request)
    roomy_out, _ = run_all(roomy)
    tight_out, outcomes = run_all(tight)
    assert roomy.stats().preemptions == 0
    assert tight.stats().preemptions > 0
    assert any(o.preempted for o in outcomes)
    assert tight_out == roomy_out == {r.request_id: expected_tokens(r) for r in requests}
    infos = [info for o in outcomes for info in o.finished_info]
    assert sum(info.num_preemptions for info in infos) == tight.stats().preemptions
    assert tight.stats().blocks_used == 0


def test_the_latest_admitted_sequence_is_preempted_first() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=4)
    scheduler.add(SimRequest("old", [1, 2], max_tokens=6))
    scheduler.add(SimRequest("new", [3, 4], max_tokens=6))
    preempted = []
    while scheduler.has_work():
        preempted += scheduler.step().preempted
    assert preempted and set(preempted) == {"new"}


def test_same_inputs_give_the_same_outcomes() -> None:
    def run() -> list[StepOutcome]:
        scheduler = make_scheduler(num_blocks=16, max_num_seqs=4, max_batched_tokens=10)
        for i in range(10):
            scheduler.add(SimRequest(f"r{i}", [i % 2] * 6 + [i], max_tokens=5 + i, seed=i))
        outcomes = []
        for step in range(1000):
            if step == 5:
                scheduler.abort("r3")
            if not scheduler.has_work():
                break
            outcomes.append(scheduler.step())
        return outcomes

    assert run() == run()


def test_abort_frees_blocks_and_reports_unknown_ids() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(SimRequest("running", list(range(10)), max_tokens=50))
    scheduler.add(SimRequest("waiting", list(range(10)), max_tokens=50))
    scheduler.step()
    assert scheduler.stats().blocks_used > 0
    assert scheduler.abort("waiting")
    assert scheduler.abort("running")
    assert not scheduler.abort("running")
    assert not scheduler.abort("never-seen")
    assert not scheduler.has_work()
    assert scheduler.stats().blocks_used == 0
    # An id may be reused once the earlier request is gone.
    scheduler.add(SimRequest("running", [1], max_tokens=1))


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (SimRequest("e", [], max_tokens=1), "empty"),
        (SimRequest("m", [1], max_tokens=0), "max_tokens"),
        (SimRequest("big", [1] * 30, max_tokens=11), "capacity"),
        (SimRequest("neg", [1, -2], max_tokens=1), "token ids"),
        (SimRequest("huge", [2**32], max_tokens=1), "token ids"),
    ],
)
def test_add_rejects_bad_requests(request_: SimRequest, message: str) -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=4)
    with pytest.raises(ValueError, match=message):
        scheduler.add(request_)
    assert not scheduler.has_work()


def test_add_rejects_duplicate_ids_and_accepts_an_exact_fit() -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=4)
    scheduler.add(SimRequest("fits", [1] * 30, max_tokens=10))
    with pytest.raises(ValueError, match="already"):
        scheduler.add(SimRequest("fits", [2], max_tokens=1))
    emitted, _ = run_all(scheduler)
    assert len(emitted["fits"]) == 10


def test_constructor_rejects_bad_settings() -> None:
    for overrides in (
        {"max_num_seqs": 0},
        {"max_batched_tokens": 0},
        {"num_blocks": 0},
        {"block_size": 0},
        {"output_token_range": (5, 5)},
        {"output_token_range": (-1, 5)},
        {"output_token_range": (0, 2**33)},
    ):
        with pytest.raises(ValueError):
            make_scheduler(**overrides)


def test_kv_events_follow_the_prefix_cache() -> None:
    scheduler = make_scheduler(record_kv_events=True)
    scheduler.add(SimRequest("r", list(range(9)), max_tokens=1))
    scheduler.step()
    events = scheduler.drain_kv_events()
    assert [e.kind for e in events] == ["stored", "stored"]
    assert scheduler.drain_kv_events() == []


# --- property: random workloads ----------------------------------------------------

PREFIXES = ([], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9] * 6)


class SchedulerMachine(RuleBasedStateMachine):
    """add/abort/step in any order: accounting holds, and every request that
    is not aborted ends with exactly its expected tokens, preempted or not."""

    @initialize(
        num_blocks=st.integers(3, 24),
        block_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 5),
        max_batched_tokens=st.integers(1, 24),
        lone_first_step=st.booleans(),
    )
    def setup(
        self, num_blocks: int, block_size: int, max_num_seqs: int, max_batched_tokens: int, lone_first_step: bool
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.capacity = num_blocks * block_size
        self.scheduler = make_scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_batched_tokens=max_batched_tokens,
            profile=msgspec.structs.replace(UNIT_PROFILE, lone_first_step=lone_first_step),
        )
        self.requests: dict[str, SimRequest] = {}
        self.emitted: dict[str, list[int]] = {}
        self.live: set[str] = set()
        self.finished: set[str] = set()
        self.aborted: set[str] = set()

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 40), max_size=6),
        max_tokens=st.integers(1, 10),
        seed=st.integers(0, 2),
    )
    def add(self, prefix: list[int], suffix: list[int], max_tokens: int, seed: int) -> None:
        prompt = prefix + suffix or [0]
        request = SimRequest(f"r{len(self.requests)}", prompt, max_tokens=max_tokens, seed=seed)
        if len(prompt) + max_tokens > self.capacity:
            with pytest.raises(ValueError):
                self.scheduler.add(request)
            return
        self.scheduler.add(request)
        self.requests[request.request_id] = request
        self.emitted[request.request_id] = []
        self.live.add(request.request_id)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        assert self.scheduler.abort(request_id) == (request_id in self.live)
        if request_id in self.live:
            self.live.discard(request_id)
            self.aborted.add(request_id)

    @rule()
    def step(self) -> None:
        self._step_once()

    def _step_once(self) -> StepOutcome:
        had_work = self.scheduler.has_work()
        outcome = self.scheduler.step()
        ids = [rid for rid, _ in outcome.emitted]
        assert len(ids) == len(set(ids)), "at most one token per sequence per step"
        for request_id, token in outcome.emitted:
            assert request_id in self.live
            self.emitted[request_id].append(token)
        for request_id in outcome.preempted:
            assert request_id in self.live
        assert [info.request_id for info in outcome.finished_info] == outcome.finished
        for request_id in outcome.finished:
            assert len(self.emitted[request_id]) == self.requests[request_id].max_tokens
            self.live.discard(request_id)
            self.finished.add(request_id)
        if had_work:
            assert outcome.emitted or outcome.preempted or outcome.prefill_tokens, "a step with work makes progress"
        return outcome

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        stats = self.scheduler.stats()
        pool = self.scheduler._pool  # the pool's own counters are the invariant under test
        assert stats.blocks_used <= stats.blocks_total
        assert pool.num_used + pool.num_free == pool.num_blocks
        assert stats.running <= self.max_num_seqs
        assert stats.running + stats.waiting == len(self.live)
        assert stats.waiting <= stats.prefilling <= stats.running + stats.waiting
        assert 0 <= stats.prefix_hit_tokens <= stats.prefix_query_tokens
        for request_id in self.live | self.aborted | self.finished:
            # Tokens so far are a prefix of the expected stream: no gaps, no repeats.
            expected = expected_tokens(self.requests[request_id])
            assert self.emitted[request_id] == expected[: len(self.emitted[request_id])]

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        for _ in range(10_000):
            if not self.scheduler.has_work():
                break
            self._step_once()
        assert not self.scheduler.has_work()
        for request_id in self.finished | self.live:
            assert self.emitted[request_id] == expected_tokens(self.requests[request_id])
        assert self.finished == set(self.requests) - self.aborted
        stats = self.scheduler.stats()
        assert stats.blocks_used == 0
        assert (stats.running, stats.waiting, stats.prefilling) == (0, 0, 0)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


def test_resumed_request_continues_the_same_token_sequence() -> None:
    """A request replayed elsewhere with its produced tokens finishes exactly as an uninterrupted run."""

    def run(request: SimRequest) -> list[int]:
        scheduler = SimScheduler(
            num_blocks=64, block_size=16, max_num_seqs=4, max_batched_tokens=256,
            profile=get_profile("zero"), output_token_range=(16, 4112),
        )
        scheduler.add(request)
        tokens = []
        while scheduler.has_work():
            tokens += [t for rid, t in scheduler.step().emitted if rid == request.request_id]
        return tokens

    whole = run(SimRequest("r", list(range(100, 140)), max_tokens=30, seed=5))
    rest = run(SimRequest("r", list(range(100, 140)), max_tokens=30, seed=5, resume_output=whole[:12]))
    assert rest == whole[12:]
    with pytest.raises(ValueError, match="nothing left"):
        run(SimRequest("r", [1, 2], max_tokens=3, resume_output=[20, 21, 22]))
