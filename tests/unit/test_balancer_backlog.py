"""The prefill backlog the balancer keeps per node, and how per-request JFFC uses it."""

from __future__ import annotations

import msgspec
import pytest

from contracts.messages import Heartbeat, StepTime
from services.balancer.backlog import PrefillBacklog
from services.balancer.policies.jffc import JffcPerRequest
from services.balancer.router import Placement, Queued, Router
from tests.unit.balancer_fixtures import NOW_WALL, TINY, chain, heartbeat, request, router, snapshot


def test_backlog_drains_at_the_prefill_rate() -> None:
    backlog = PrefillBacklog()
    backlog.add("a", 2000, drain_per_s=1000.0, now=10.0)
    assert backlog.tokens("a", 1000.0, 10.5) == pytest.approx(1500)
    backlog.add("a", 1000, drain_per_s=1000.0, now=11.0)
    assert backlog.tokens("a", 1000.0, 11.0) == pytest.approx(2000)
    assert backlog.tokens("a", 1000.0, 20.0) == 0.0
    assert backlog.tokens("b", 1000.0, 11.0) == 0.0
    backlog.withdraw("a", 500, 1000.0, 11.0)
    assert backlog.tokens("a", 1000.0, 11.0) == pytest.approx(1500)
    backlog.forget(["a"])
    assert backlog.tokens("a", 1000.0, 11.0) == 0.0


def test_an_empty_waiting_queue_caps_the_backlog_at_what_was_sent_since_and_what_cannot_be_prefilled_yet() -> None:
    backlog = PrefillBacklog()
    backlog.add("a", 4000, drain_per_s=100.0, now=10.0)  # the drain rate was badly underestimated then
    backlog.add("a", 300, drain_per_s=100.0, now=12.0)
    # At the node's measured rate, 1000 tokens/s, 1900 of the 4000 started at 10.0 may still be ahead.
    backlog.observe("a", sent_at=11.0, waiting=0, drain_per_s=1000.0, now=12.1)
    assert backlog.tokens("a", 1000.0, 12.1) == pytest.approx(1900 + 300)
    # Once the node could have prefilled them all, only what the heartbeat could not see is left.
    backlog.observe("a", sent_at=12.1, waiting=0, drain_per_s=1000.0, now=14.0)
    assert backlog.tokens("a", 1000.0, 14.0) == pytest.approx(300)
    backlog.observe("a", sent_at=14.5, waiting=0, drain_per_s=1000.0, now=14.5)
    assert backlog.tokens("a", 1000.0, 14.5) == 0.0
    # A heartbeat with requests waiting says nothing about their prompts: the estimate stands.
    backlog.add("a", 1000, drain_per_s=1000.0, now=14.5)
    backlog.observe("a", sent_at=14.6, waiting=3, drain_per_s=1000.0, now=14.7)
    assert backlog.tokens("a", 1000.0, 14.7) == pytest.approx(1000 - 200)
    # The cap never raises the estimate.
    backlog.observe("a", sent_at=14.6, waiting=0, drain_per_s=1000.0, now=30.0)
    assert backlog.tokens("a", 1000.0, 30.0) == 0.0


def test_a_long_prompt_that_has_started_still_holds_the_node_after_a_heartbeat_without_waiting_requests() -> None:
    """An engine prefills a long prompt in chunks: admitted (waiting 0) is not prefilled."""
    backlog = PrefillBacklog()
    backlog.add("a", 28_000, drain_per_s=10_000.0, now=0.0)
    backlog.observe("a", sent_at=1.0, waiting=0, drain_per_s=10_000.0, now=1.0)
    assert backlog.tokens("a", 10_000.0, 1.0) == pytest.approx(18_000)
    backlog.add("a", 500, drain_per_s=10_000.0, now=1.5)
    backlog.observe("a", sent_at=2.0, waiting=0, drain_per_s=10_000.0, now=2.0)
    assert backlog.tokens("a", 10_000.0, 2.0) == pytest.approx(8_500)
    backlog.observe("a", sent_at=3.0, waiting=0, drain_per_s=10_000.0, now=3.0)
    assert backlog.tokens("a", 10_000.0, 3.0) == 0.0


def test_a_heartbeat_with_nothing_prefilling_caps_the_backlog_at_the_prompts_sent_after_it() -> None:
    """The node's measured speed is ten times too slow: its fluid estimate would hold 26,000 tokens for seconds."""
    backlog = PrefillBacklog()
    backlog.add("a", 28_000, drain_per_s=1000.0, now=0.0)
    backlog.add("a", 700, drain_per_s=1000.0, now=1.9)  # too close to the heartbeat for it to vouch for
    backlog.observe("a", sent_at=2.0, waiting=0, drain_per_s=1000.0, now=2.0, prefilling=0)
    assert backlog.tokens("a", 1000.0, 2.0) == pytest.approx(700)
    # The next one vouches for the 700 too.
    backlog.observe("a", sent_at=3.0, waiting=0, drain_per_s=1000.0, now=3.0, prefilling=0)
    assert backlog.tokens("a", 1000.0, 3.0) == 0.0
    # The cap never raises the estimate.
    backlog.add("a", 500, drain_per_s=1000.0, now=3.0)
    backlog.observe("a", sent_at=2.0, waiting=0, drain_per_s=1000.0, now=3.0, prefilling=0)
    assert backlog.tokens("a", 1000.0, 3.0) == pytest.approx(500)


@pytest.mark.parametrize("prefilling", [1, None])
def test_a_heartbeat_with_a_prompt_still_prefilling_or_none_reported_keeps_the_fluid_estimate(prefilling: int | None) -> None:
    backlog = PrefillBacklog()
    backlog.add("a", 28_000, drain_per_s=10_000.0, now=0.0)
    backlog.add("a", 700, drain_per_s=10_000.0, now=0.9)
    backlog.observe("a", sent_at=1.0, waiting=0, drain_per_s=10_000.0, now=1.0, prefilling=prefilling)
    assert backlog.tokens("a", 10_000.0, 1.0) == pytest.approx(18_000 + 700)
    backlog.observe("a", sent_at=3.0, waiting=0, drain_per_s=10_000.0, now=3.0, prefilling=prefilling)
    assert backlog.tokens("a", 10_000.0, 3.0) == 0.0


@pytest.mark.parametrize(("prefilling", "backlog_s"), [(0, 0.0), (1, TINY.b * 100_000 - 1.0), (None, TINY.b * 100_000 - 1.0)])
def test_the_snapshot_takes_the_heartbeats_count_of_requests_prefilling(prefilling: int | None, backlog_s: float) -> None:
    clock = [NOW_WALL]
    r = router("jffc_per_request")
    r.builder.clock = lambda: clock[0]
    quiet = heartbeat("a")
    r.builder.observe(quiet)
    assert isinstance(r.place(request("long", prompt=100_000, output=16, blocks=0), [quiet], NOW_WALL + 60), Placement)
    clock[0] += 1.0
    beat = heartbeat("a", running=1, sent_at=clock[0])
    beat = msgspec.structs.replace(beat, stats=msgspec.structs.replace(beat.stats, prefilling=prefilling))
    r.builder.observe(beat)
    seen = r.builder.snapshot(request("next"), [beat], r.table.used, {})
    assert seen.chains[0].prefill_backlog_s == pytest.approx(backlog_s)


def test_placements_build_a_backlog_that_steers_uncached_prompts_away() -> None:
    clock = [NOW_WALL]
    r = router("jffc_per_request")
    r.builder.clock = lambda: clock[0]
    heartbeats = [heartbeat("a"), heartbeat("b")]
    for hb in heartbeats:
        r.builder.observe(hb)
    long_prompt = dict(prompt=2048, output=16, blocks=128)
    first = r.place(request("r1", **long_prompt), heartbeats, NOW_WALL + 60)
    assert isinstance(first, Placement)
    # Same batch size on both nodes once r1 runs, but r1's 2048-token prefill is still ahead on its node.
    second = r.place(request("r2", **long_prompt), heartbeats, NOW_WALL + 60)
    assert second is not None and second.chain.worker_id != first.chain.worker_id
    seen = r.builder.snapshot(request("r3"), heartbeats, r.table.used, {})
    backlog_s = {c.worker_id: c.prefill_backlog_s for c in seen.chains}
    assert backlog_s[first.chain.worker_id] == pytest.approx(TINY.b * 2048)
    clock[0] += 10.0  # long enough to prefill both
    drained = r.builder.snapshot(request("r3"), heartbeats, r.table.used, {})
    assert all(c.prefill_backlog_s == 0.0 for c in drained.chains)


def test_an_undone_placement_leaves_no_backlog() -> None:
    r = router("jffc_per_request")
    r.builder.clock = lambda: NOW_WALL
    heartbeats = [heartbeat("a")]
    placement = r.place(request("r1", prompt=2048, blocks=128), heartbeats, NOW_WALL + 60)
    assert placement is not None
    r.undo(placement, chain_used=0)
    seen = r.builder.snapshot(request("r2"), heartbeats, r.table.used, {})
    assert seen.chains[0].prefill_backlog_s == 0.0


def test_per_request_jffc_counts_the_backlog_as_time_before_its_prefill() -> None:
    policy = JffcPerRequest()
    req = request(prompt=2048, output=16, blocks=128)
    idle = chain("a")
    queued = msgspec.structs.replace(chain("a"), prefill_backlog_s=0.5)
    assert policy.expected_seconds(req, queued) == pytest.approx(policy.expected_seconds(req, idle) + 0.5)
    # The cache node still wins over a cold one while its backlog is shorter than the prefill it saves...
    cache_node = msgspec.structs.replace(chain("a", cached=128), prefill_backlog_s=TINY.b * 1000)
    assert policy.choose(req, snapshot(cache_node, chain("b"), request_blocks=128)).worker_id == "a"
    # ...and loses once the wait there is longer.
    swamped = msgspec.structs.replace(chain("a", cached=128), prefill_backlog_s=TINY.b * 4000)
    assert policy.choose(req, snapshot(swamped, chain("b"), request_blocks=128)).worker_id == "b"



def behind_a_long_prefill(use_index: bool) -> tuple[Router, list[Heartbeat], Placement, Placement]:
    """Two nodes of two slots: one with a second of prefill ahead and a free slot, the other full."""
    r = router("jffc_per_request", max_per_chain=2)
    if not use_index:
        r.chains = None
    r.builder.clock = lambda: NOW_WALL
    heartbeats = [heartbeat("a"), heartbeat("b")]
    for hb in heartbeats:
        r.builder.observe(hb)
    # 50k uncached prompt tokens at 20 us each: one second of prefill ahead on its node.
    long = r.admit(request("long", prompt=50_000, output=16), heartbeats, NOW_WALL)
    assert isinstance(long, Placement)
    other = r.admit(request("s1"), heartbeats, NOW_WALL)
    assert isinstance(other, Placement) and other.chain.worker_id != long.chain.worker_id
    assert isinstance(r.admit(request("s2"), heartbeats, NOW_WALL), Placement)  # the other node is full now
    return r, heartbeats, long, other


@pytest.mark.parametrize("use_index", [True, False])
def test_a_request_waits_for_a_slot_rather_than_behind_a_long_prefill_backlog(use_index: bool) -> None:
    r, heartbeats, long, other = behind_a_long_prefill(use_index)
    # No departures measured: no prediction of the queue's wait, so the free slot is taken.
    assert r.backlog_bound_s(request("s3"), NOW_WALL) == float("inf")
    for i in range(10):
        r.degradation.departures.note(NOW_WALL - 1 + i / 10)  # ten a second: a slot frees in 0.1 s
    queued = r.admit(request("s3"), heartbeats, NOW_WALL)
    assert isinstance(queued, Queued)
    assert r.dispatch_queued(lambda model: heartbeats) == []  # still behind the backlog
    # Once the other node frees a slot, the queued request takes it.
    r.finished("s1", other.chain.worker_id)
    [(entry, placement)] = r.dispatch_queued(lambda model: heartbeats)
    assert entry.request_id == "s3" and placement.chain.worker_id == other.chain.worker_id


@pytest.mark.parametrize("use_index", [True, False])
def test_a_cached_prefix_earns_a_backlog_allowance_of_the_prefill_it_saves(use_index: bool) -> None:
    """Elsewhere the request would prefill its cached prefix: a chain holding it may be that much further behind."""
    r, heartbeats, long, _ = behind_a_long_prefill(use_index)
    for i in range(10):
        r.degradation.departures.note(NOW_WALL - 1 + i / 10)  # the bound is the 0.5 s target
    # 0.512 s of its prompt cached there (1,600 blocks of 16): 1.0 - 0.512 is within the bound, so it goes now.
    r.index.apply(long.chain.worker_id, stored=list(range(1000, 2600)))
    cached = r.admit(request("cached", prompt=26_000, output=16, blocks=1600), heartbeats, NOW_WALL)
    assert isinstance(cached, Placement) and cached.chain.worker_id == long.chain.worker_id
    # A prefix worth less than the excess (0.4 s) does not: it waits for a slot elsewhere.
    r.finished("cached", long.chain.worker_id)
    r.index.apply(long.chain.worker_id, removed=list(range(2250, 2600)))
    short_prefix = r.admit(request("short", prompt=26_000, output=16, blocks=1600), heartbeats, NOW_WALL)
    assert isinstance(short_prefix, Queued)


@pytest.mark.parametrize("use_index", [True, False])
def test_a_slow_prefill_node_earns_no_backlog_allowance_for_its_own_slow_prefill(use_index: bool) -> None:
    """Waiting ends in a prefill on the fastest node at best: a slow node's first token is compared with that."""
    r = router("jffc_per_request", max_per_chain=2)
    if not use_index:
        r.chains = None
    r.builder.clock = lambda: NOW_WALL
    fast, slow = heartbeat("fast"), heartbeat("slow")
    # The slow node prefills five times slower: 100 us a token against 20.
    slow = msgspec.structs.replace(slow, registration=msgspec.structs.replace(
        slow.registration, step_time=StepTime(a=TINY.a, b=5 * TINY.b, c=TINY.c)))
    heartbeats = [fast, slow]
    for hb in heartbeats:
        r.builder.observe(hb)
    # 0.3 s of prefill ahead on the slow node, which keeps a free slot; the fast node is full.
    assert isinstance(r.admit(request("long", prompt=3000, blocks=0, exclude=["fast"]), heartbeats, NOW_WALL), Placement)
    for name in ("f1", "f2"):
        assert isinstance(r.admit(request(name, exclude=["slow"]), heartbeats, NOW_WALL), Placement)
    for i in range(10):
        r.degradation.departures.note(NOW_WALL - 1 + i / 10)  # the bound is the 0.5 s target
    # Its 5,000-token prompt would come out of the slow node after 0.3 + 0.5 s, out of the fast one
    # after the wait for a slot and 0.1 s: it waits, though the backlog alone is within the bound.
    assert isinstance(r.admit(request("long-prompt", prompt=5000, blocks=0), heartbeats, NOW_WALL), Queued)
    # A short prompt's own prefill costs little on either: 0.35 s is within 0.5 + 0.01 s, it goes now.
    short = r.admit(request("short-prompt", prompt=500, blocks=0), heartbeats, NOW_WALL)
    assert isinstance(short, Placement) and short.chain.worker_id == "slow"


def test_a_policy_that_does_not_cost_its_own_wait_takes_any_free_slot() -> None:
    r = router("least_loaded", max_per_chain=2)
    r.builder.clock = lambda: NOW_WALL
    heartbeats = [heartbeat("a")]
    r.builder.observe(heartbeats[0])
    for i in range(10):
        r.degradation.departures.note(NOW_WALL - 1 + i / 10)
    assert isinstance(r.admit(request("long", prompt=50_000, output=16), heartbeats, NOW_WALL), Placement)
    assert r.backlog_bound_s(request("s1"), NOW_WALL) == float("inf")
    assert isinstance(r.admit(request("s1"), heartbeats, NOW_WALL), Placement)
