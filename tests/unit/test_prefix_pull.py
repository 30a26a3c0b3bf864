"""Prefix pulls: when a free node runs a request on the prefix a busy node caches, and how the router places it."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.messages import Heartbeat, RouteDecision, RouteRequest
from services.balancer.core import BalancerCore, Release
from services.balancer.prefix_pull import LinkQueue, PrefixPulls, PullCandidate, merged_cached
from services.balancer.snapshot import NodeFacts
from services.balancer.speed import StepModel
from shared.balancer_settings import PrefixPullSettings
from shared.kv.links import advertised_kv_transfer, get_link
from shared.kv.step_profile import get_profile
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, node, request, router

H100 = get_profile("h100-80g-llama3-8b")
H100_MODEL = StepModel(a=H100.a, b=H100.b, c=H100.c, d=H100.d, per_request=H100.per_request)
SETTINGS = PrefixPullSettings()


def _facts(worker_id: str, link: str = "ethernet-100g", running: int = 0) -> NodeFacts:
    return msgspec.structs.replace(node(worker_id, running=running), model=H100_MODEL, kv_share=True,
                                   kv_transfer=advertised_kv_transfer(H100.kv_bytes_per_token, get_link(link)))


def _candidates(source_blocks: int, runner_blocks: int = 0, link: str = "ethernet-100g", busy: float = 16.0,
                idle: float = 0.0) -> list[PullCandidate]:
    return [PullCandidate(_facts("source", link), source_blocks, busy), PullCandidate(_facts("runner", link), runner_blocks, idle)]


# --- the cost model -----------------------------------------------------------------------


def test_a_long_cached_prefix_is_pulled_to_the_free_node() -> None:
    pulls = PrefixPulls(SETTINGS, imposed_delay_weight=2.0)
    offers = pulls.offers(4096, _candidates(source_blocks=200, runner_blocks=10), NOW_WALL)
    assert set(offers) == {"runner"}
    pull = offers["runner"]
    assert pull.source.worker_id == "source" and pull.blocks == 200 and pull.exposed_tokens == 3200
    # Only the blocks the runner lacks cross the link.
    assert pull.pulled_tokens == 190 * 16 and pull.pulled_bytes == 190 * 16 * H100.kv_bytes_per_token
    assert pull.seconds < pull.recompute_s


def test_the_break_even_moves_with_the_link() -> None:
    """3,000 tokens of Llama-3-8B KV (393 MB): 8 ms over RDMA at 400 Gbit/s, 126 ms over 25 GbE, against
    their prefill on an H100 with nothing running there (no imposed delay)."""
    pulls = PrefixPulls(SETTINGS, imposed_delay_weight=2.0)
    recompute_s = 3000 * H100.b
    fast = pulls.offers(4096, _candidates(3000 // 16, link="rdma-400g"), NOW_WALL)
    slow = pulls.offers(4096, _candidates(3000 // 16, link="ethernet-25g"), NOW_WALL)
    assert fast and fast["runner"].seconds < recompute_s
    assert (get_link("ethernet-25g").transfer_seconds(3000 * H100.kv_bytes_per_token) > recompute_s) == (not slow)


def test_no_shared_prefix_or_a_short_one_is_not_pulled() -> None:
    pulls = PrefixPulls(SETTINGS, imposed_delay_weight=2.0)
    assert pulls.offers(4096, _candidates(0), NOW_WALL) == {}
    # Fewer than min_tokens (64) more than the runner has: computed again.
    assert pulls.offers(4096, _candidates(source_blocks=13, runner_blocks=10), NOW_WALL) == {}
    assert PrefixPulls(PrefixPullSettings(enabled=False), 2.0).offers(4096, _candidates(200), NOW_WALL) == {}


def test_the_runner_is_left_a_token_to_compute() -> None:
    pulls = PrefixPulls(SETTINGS, imposed_delay_weight=2.0)
    offers = pulls.offers(1600, _candidates(source_blocks=100), NOW_WALL)  # the whole prompt, 100 full blocks, cached
    assert offers["runner"].blocks == 99


def test_pulls_queue_on_the_source_link() -> None:
    pulls = PrefixPulls(SETTINGS, imposed_delay_weight=2.0)
    first = pulls.offers(4096, _candidates(200), NOW_WALL)["runner"]
    pulls.chosen("runner", first, "source", NOW_WALL)
    second = pulls.offers(4096, _candidates(200), NOW_WALL)["runner"]
    transfer = get_link("ethernet-100g").transfer_seconds(first.pulled_bytes) - get_link("ethernet-100g").latency_s
    assert second.seconds == pytest.approx(first.seconds + transfer)
    # Drained at the link's bandwidth.
    assert pulls.offers(4096, _candidates(200), NOW_WALL + 1.0)["runner"].seconds == pytest.approx(first.seconds)
    assert pulls.choices == {"pull": 1, "recompute": 0, "run_on_source": 0}
    assert pulls.pulled_bytes == {"source": first.pulled_bytes}
    pulls.undone("pull", first, NOW_WALL)
    assert pulls.offers(4096, _candidates(200), NOW_WALL)["runner"].seconds == pytest.approx(first.seconds)
    assert pulls.choices == {"pull": 0, "recompute": 0, "run_on_source": 0} and pulls.pulled_bytes == {"source": 0}


@given(prompt=st.integers(1, 20_000), source_blocks=st.integers(0, 1500), runner_blocks=st.integers(0, 1500),
       busy=st.floats(0, 64), idle=st.floats(0, 64), link=st.sampled_from(["rdma-400g", "ethernet-100g", "ethernet-25g"]))
def test_an_offer_is_made_exactly_when_the_pull_is_sooner(prompt: int, source_blocks: int, runner_blocks: int, busy: float,
                                                          idle: float, link: str) -> None:
    pulls = PrefixPulls(SETTINGS, imposed_delay_weight=2.0)
    source_blocks = min(source_blocks, prompt // 16)
    runner_blocks = min(runner_blocks, prompt // 16)
    candidates = _candidates(source_blocks, runner_blocks, link, busy, idle)
    offers = pulls.offers(prompt, candidates, NOW_WALL)
    assert set(offers) <= {"runner", "source"}
    for runner_id, pull in offers.items():
        source = pull.source.worker_id
        assert source != runner_id
        assert pull.blocks * 16 < prompt
        assert pull.pulled_tokens >= SETTINGS.min_tokens
        assert pull.seconds < pull.recompute_s
        # The source caches at least what it exposes, and more than the runner.
        own = {c.facts.worker_id: c.cached_blocks for c in candidates}
        assert own[source] >= pull.blocks > own[runner_id]
    # Two nodes caching the same: nothing to gain.
    if source_blocks == runner_blocks:
        assert offers == {}


# --- the link queue -----------------------------------------------------------------------


def test_the_link_queue_drains_and_never_goes_below_zero() -> None:
    links = LinkQueue()
    links.add("a", 1000, 100.0, 0.0)
    assert links.seconds("a", 100.0, 0.0) == 10.0
    assert links.seconds("a", 100.0, 4.0) == 6.0
    links.withdraw("a", 5000, 100.0, 4.0)
    assert links.seconds("a", 100.0, 4.0) == 0.0
    links.add("a", 100, 100.0, 20.0)
    links.forget(["a"])
    assert links.seconds("a", 100.0, 20.0) == 0.0


def test_merged_cached_counts_the_pulled_prefix_on_the_runner() -> None:
    pulls = PrefixPulls(SETTINGS, 2.0).offers(4096, _candidates(200, 10), NOW_WALL)
    assert merged_cached({"source": 200, "runner": 10, "other": 3}, pulls) == {"source": 200, "runner": 200, "other": 3}


# --- the router -----------------------------------------------------------------------------


def _sharing(hb: Heartbeat, link: str = "ethernet-100g") -> Heartbeat:
    registration = msgspec.structs.replace(
        hb.registration, kv_share=True, kv_transfer=advertised_kv_transfer(H100.kv_bytes_per_token, get_link(link)))
    return msgspec.structs.replace(hb, registration=registration)


def _long(request_id: str = "r1") -> RouteRequest:
    # 200 blocks of 16 tokens and a bit more: long enough that computing it again costs more than pulling it.
    return msgspec.structs.replace(request(request_id, prompt=3300, output=16, blocks=200))


@pytest.mark.parametrize("use_index", [True, False])
def test_the_router_runs_a_request_on_the_free_node_with_the_prefix_pulled_from_the_busy_one(use_index: bool) -> None:
    r = router(use_index=use_index, max_per_chain=2, prefix_pull=SETTINGS)
    heartbeats = [_sharing(heartbeat("busy", running=2)), _sharing(heartbeat("free"))]
    busy = r.builder.facts(heartbeats[0])
    for index in range(2):
        r.table.reserve(f"running{index}", busy.chain_id, 2, NOW_WALL + 60)
    r.index.apply("busy", stored=range(1000, 1200))
    placement = r.place(_long(), heartbeats, NOW_WALL + 60)
    assert placement is not None and placement.chain.worker_id == "free"
    assert placement.pull is not None and placement.pull.source.worker_id == "busy"
    # The free node is costed with the pulled prefix: only the rest is its backlog.
    assert placement.chain.cached_blocks == 200 and placement.chain.pull_s == placement.pull.seconds
    assert r.pull_source("r1") == "busy" and r.pulls.choices["pull"] == 1
    r.finished("r1", "free")
    assert r.pull_source("r1") is None


def test_an_undone_pull_placement_is_forgotten() -> None:
    """The global slot store refused the runner's slot: the pull is not counted, nor queued on the source's link."""
    r = router(max_per_chain=2, prefix_pull=SETTINGS)
    heartbeats = [_sharing(heartbeat("busy", running=2)), _sharing(heartbeat("free"))]
    for index in range(2):
        r.table.reserve(f"running{index}", r.builder.facts(heartbeats[0]).chain_id, 2, NOW_WALL + 60)
    r.index.apply("busy", stored=range(1000, 1200))
    placement = r.place(_long(), heartbeats, NOW_WALL + 60)
    assert placement is not None and placement.pull is not None and placement.pull_choice == "pull"
    r.undo(placement, chain_used=0)
    assert r.pull_source("r1") is None and r.pulls.choices["pull"] == 0 and r.pulls.pulled_bytes == {"busy": 0}


@pytest.mark.parametrize("use_index", [True, False])
def test_without_kv_share_or_with_pulls_off_the_request_is_computed_again_or_waits(use_index: bool) -> None:
    for heartbeats, settings in (([heartbeat("busy", running=2), heartbeat("free")], SETTINGS),
                                 ([_sharing(heartbeat("busy", running=2)), _sharing(heartbeat("free"))],
                                  PrefixPullSettings(enabled=False))):
        r = router(use_index=use_index, max_per_chain=2, prefix_pull=settings)
        busy = r.builder.facts(heartbeats[0])
        for index in range(2):
            r.table.reserve(f"running{index}", busy.chain_id, 2, NOW_WALL + 60)
        r.index.apply("busy", stored=range(1000, 1200))
        placement = r.place(_long(), heartbeats, NOW_WALL + 60)
        assert placement is not None and placement.pull is None and placement.chain.cached_blocks == 0


def test_a_free_source_runs_the_request_itself_when_that_is_cheaper() -> None:
    r = router(max_per_chain=4, prefix_pull=SETTINGS)
    heartbeats = [_sharing(heartbeat("caching")), _sharing(heartbeat("other"))]
    r.index.apply("caching", stored=range(1000, 1200))
    placement = r.place(_long(), heartbeats, NOW_WALL + 60)
    assert placement is not None and placement.chain.worker_id == "caching" and placement.pull is None
    assert r.pulls.choices == {"pull": 0, "recompute": 0, "run_on_source": 1}


def test_index_and_snapshot_cost_a_pull_alike() -> None:
    decided = []
    for use_index in (True, False):
        r = router(use_index=use_index, max_per_chain=3, prefix_pull=SETTINGS)
        heartbeats = [_sharing(heartbeat(f"w{i}", running=i)) for i in range(4)]
        for i, hb in enumerate(heartbeats):
            for k in range(min(i, 2)):
                r.table.reserve(f"run{i}-{k}", r.builder.facts(hb).chain_id, 3, NOW_WALL + 60)
        r.index.apply("w3", stored=range(1000, 1200))
        r.index.apply("w1", stored=range(1000, 1020))
        placement = r.place(_long(), heartbeats, NOW_WALL + 60)
        assert placement is not None
        decided.append((placement.chain.worker_id, placement.pull))
    assert decided[0] == decided[1]


def test_a_source_that_ends_the_request_before_handing_it_over_frees_the_runner_slot() -> None:
    core_router = router(max_per_chain=2, prefix_pull=SETTINGS)
    heartbeats = [_sharing(heartbeat("busy", running=2)), _sharing(heartbeat("free"))]
    core = BalancerCore(core_router, lambda model: heartbeats, lambda: heartbeats)
    busy = core_router.builder.facts(heartbeats[0])
    for index in range(2):
        core_router.table.reserve(f"running{index}", busy.chain_id, 2, NOW_WALL + 60)
    core_router.index.apply("busy", stored=range(1000, 1200))
    placement = core_router.place(_long(), heartbeats, NOW_WALL + 60)
    assert placement is not None and placement.pull is not None
    effects = core.finished("r1", "busy")  # the source failed before the hand-off
    release = effects[-1]
    assert isinstance(release, Release) and release.chain_id == placement.chain.chain_id
    assert core_router.table.holder("r1") is None


def test_a_pull_decision_names_the_source_first_and_the_prefix_it_runs() -> None:
    decision = RouteDecision("r1", "free", "inbox.free", "jffc_per_request", 200, prefill_worker_id="busy",
                             prefill_inbox="inbox.busy", prefix_tokens=3200)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(decision), type=RouteDecision) == decision
