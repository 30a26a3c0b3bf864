"""Every routing policy on hand-built snapshots: where they should differ, they do."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.balancer.policies import POLICY_NAMES, make_policy
from services.balancer.policies.cache_aware import ScoreBased
from services.balancer.policies.jffc import JffcPerRequest
from shared.config import JffcPerRequestSettings, ScoreSettings
from tests.unit.balancer_fixtures import TINY, chain, request, settings as balancer_settings, snapshot


def choose(policy_name: str, snap, req=None, **overrides) -> str | None:
    policy = make_policy(policy_name, balancer_settings(policy_name, **overrides))
    chosen = policy.choose(req or request(), snap)
    return None if chosen is None else chosen.worker_id


# a holds the whole prompt in cache but is busier; b is idle; c is in between.
CACHE_VS_LOAD = snapshot(
    chain("a", used=3, running=3, cached=4),
    chain("b"),
    chain("c", used=1, running=1),
    request_blocks=4,
)


def test_cache_blind_policies_pick_the_idle_node() -> None:
    assert choose("least_loaded", CACHE_VS_LOAD) == "b"
    assert choose("jffc", CACHE_VS_LOAD) == "b"  # equal speeds: the less loaded


def test_cache_aware_policies_pick_the_cache_node() -> None:
    assert choose("prefix_affinity", CACHE_VS_LOAD) == "a"
    assert choose("kv_cost", CACHE_VS_LOAD) == "a"
    assert choose("score", CACHE_VS_LOAD) == "a"


def test_per_request_jffc_weighs_the_cached_prefix_against_load() -> None:
    short = request(prompt=64, output=16, blocks=4)
    assert choose("jffc_per_request", CACHE_VS_LOAD, short) == "b"  # little prefill to save
    long_prompt = request(prompt=2048, output=16, blocks=128)
    snap = snapshot(chain("a", used=3, running=3, cached=128), chain("b"), chain("c", used=1, running=1), request_blocks=128)
    assert choose("jffc_per_request", snap, long_prompt) == "a"  # 2048 cached tokens beat 3 more in the batch
    assert choose("least_loaded", snap, long_prompt) == "b"


def test_jffc_takes_the_fastest_free_chain_and_skips_full_ones() -> None:
    snap = snapshot(chain("slow", speed=1.0), chain("fast", speed=3.0, used=8, slots=8), chain("mid", speed=2.0, used=4))
    assert choose("jffc", snap) == "mid"
    assert choose("least_loaded", snap) == "slow"
    assert choose("jffc_per_request", snap) == "mid"  # 2x speed outweighs 4 more in its batch
    # One more, and the delay it would impose on them outweighs the speed.
    busier = snapshot(chain("slow", speed=1.0), chain("mid", speed=2.0, used=5))
    assert choose("jffc_per_request", busier) == "slow"


def test_per_request_estimate_adds_prefill_transfer_and_decode() -> None:
    policy = JffcPerRequest(imposed_delay_weight=0.0)
    req = request(prompt=320, output=10, blocks=20)
    cold = chain("a", running=1)
    warm = chain("a", running=1, cached=10)  # 160 of 320 prompt tokens cached
    decode = 10 * (TINY.a + TINY.c * 2)
    assert policy.expected_seconds(req, cold) == pytest.approx(TINY.a + TINY.b * 320 + decode)
    assert policy.expected_seconds(req, warm) == pytest.approx(TINY.a + TINY.b * 160 + decode)
    fast = chain("a", running=1, speed=2.0)
    assert policy.expected_seconds(req, fast) == pytest.approx(policy.expected_seconds(req, cold) / 2)


def test_per_request_cost_adds_the_delay_imposed_on_the_running_batch() -> None:
    req = request(prompt=320, output=10, blocks=20)
    alone = JffcPerRequest(imposed_delay_weight=0.0)
    social = JffcPerRequest()
    weight = JffcPerRequestSettings().imposed_delay_weight
    assert weight == 2.0  # those running now, and about as many that join during its stay
    # Each of the 3 running requests waits for the 320-token prefill and shares 5 of the 10 decode steps.
    imposed = weight * 3 * (TINY.b * 320 + TINY.c * 5)
    busy = chain("a", running=3)
    assert social.expected_seconds(req, busy) == pytest.approx(alone.expected_seconds(req, busy) + imposed)
    assert social.expected_seconds(req, chain("a")) == pytest.approx(alone.expected_seconds(req, chain("a")))
    # Alone, the busy node's 2x speed wins; counting the delay to its batch of 6, the idle node does.
    fast_busy, idle = chain("fast", running=6, speed=2.0), chain("idle")
    assert alone.choose(req, snapshot(fast_busy, idle)).worker_id == "fast"
    assert social.choose(req, snapshot(fast_busy, idle)).worker_id == "idle"


def test_health_weight_and_queue_growth_make_a_node_less_attractive() -> None:
    sick = snapshot(chain("a", health=0.5), chain("b"))
    for name in ("least_loaded", "jffc", "jffc_per_request", "kv_cost"):
        assert choose(name, snapshot(chain("a", health=0.5, used=1, running=1), chain("b", used=1, running=1))) == "b", name
    assert choose("jffc", sick) == "b"
    # Same queue today, but a's is growing: penalised before it is long.
    growing = snapshot(chain("a", growth=3.0), chain("b"))
    for name in ("least_loaded", "jffc_per_request", "power_of_two"):
        assert choose(name, growing) == "b", name


def test_prefix_affinity_gives_way_to_load_when_imbalanced() -> None:
    imbalanced = snapshot(chain("a", cached=4, running=100, slots=200, used=100), chain("b", slots=200), request_blocks=4)
    assert choose("prefix_affinity", imbalanced) == "b"
    # Below the absolute bound the cache still wins.
    mild = snapshot(chain("a", cached=4, running=20, slots=200, used=20), chain("b", slots=200), request_blocks=4)
    assert choose("prefix_affinity", mild) == "a"
    # A weak match (1 of 4 blocks) is not enough: most free cache wins.
    weak = snapshot(chain("a", cached=1, kv_used=500), chain("b", kv_used=100), request_blocks=4)
    assert choose("prefix_affinity", weak) == "b"


def test_score_fast_forwards_to_the_cache_node_while_it_is_not_busy() -> None:
    policy = ScoreBased(ScoreSettings())
    # a holds 1 of 4 blocks and is half busy: b scores higher, but a is under 0.65.
    snap = snapshot(chain("a", cached=1, used=4), chain("b"), request_blocks=4)
    assert policy.choose(request(), snap).worker_id == "a"
    assert policy.fast_forwards == 1
    busy = snapshot(chain("a", cached=1, used=6), chain("b"), request_blocks=4)
    assert policy.choose(request(), busy).worker_id == "b"
    assert policy.fast_forwards == 1
    no_ff = ScoreBased(ScoreSettings(fast_forward_utilisation=0.0))
    assert no_ff.choose(request(), snap).worker_id == "b"


def test_round_robin_cycles_over_free_chains() -> None:
    snap = snapshot(chain("a"), chain("b", used=8), chain("c"), chain("d"))
    policy = make_policy("round_robin", balancer_settings("round_robin"))
    picks = [policy.choose(request(), snap).worker_id for _ in range(6)]
    assert Counter(picks) == {"a": 2, "c": 2, "d": 2}
    assert all(x != y for x, y in zip(picks, picks[1:]))


def test_random_and_power_of_two_are_seeded() -> None:
    snap = snapshot(*(chain(n, used=i % 3) for i, n in enumerate("abcdefgh")))
    for name in ("random", "power_of_two"):
        first, second = (make_policy(name, balancer_settings(name)) for _ in range(2))
        picks = [first.choose(request(), snap).worker_id for _ in range(20)]
        assert picks == [second.choose(request(), snap).worker_id for _ in range(20)]
        assert len(set(picks)) > 2
    # Of two chains, power-of-two always takes the less loaded.
    pair = snapshot(chain("a", used=3), chain("b", used=1))
    assert {choose("power_of_two", pair) for _ in range(10)} == {"b"}


def test_least_loaded_ties_rotate_and_kv_breaks_ties() -> None:
    policy = make_policy("least_loaded", balancer_settings("least_loaded"))
    tied = snapshot(chain("a", running=1), chain("b", running=1), chain("c", running=1), chain("d", running=9))
    picks = [policy.choose(request(), tied).worker_id for _ in range(9)]
    assert Counter(picks) == {"a": 3, "b": 3, "c": 3}
    kv = snapshot(chain("a", running=1, kv_used=500), chain("b", running=1, kv_used=200))
    assert {policy.choose(request(), kv).worker_id for _ in range(4)} == {"b"}


def test_make_policy_knows_every_name() -> None:
    for name in POLICY_NAMES:
        assert make_policy(name, balancer_settings(name)).name == name
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("nope", balancer_settings())


chain_specs = st.lists(
    st.tuples(st.integers(1, 4), st.integers(0, 4), st.integers(0, 6), st.floats(0.5, 3.0), st.floats(0.1, 1.0)),
    min_size=1, max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(specs=chain_specs, policy_name=st.sampled_from(POLICY_NAMES), cached=st.integers(0, 4))
def test_no_policy_ever_picks_a_full_chain(specs, policy_name: str, cached: int) -> None:
    chains = [
        chain(f"w{i}", slots=slots, used=min(used, slots), running=running, speed=speed, health=health, cached=cached if i == 0 else 0)
        for i, (slots, used, running, speed, health) in enumerate(specs)
    ]
    snap = snapshot(*chains, request_blocks=4)
    chosen = make_policy(policy_name, balancer_settings(policy_name)).choose(request(), snap)
    if any(c.free_slots > 0 for c in chains):
        assert chosen is not None and chosen.free_slots > 0
    else:
        assert chosen is None


def test_jffc_shares_load_between_nodes_whose_measured_speeds_differ_by_noise() -> None:
    from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, router

    r = router("jffc")
    # Identical nodes, measured 10% apart (a different prefill/decode mix), and one truly twice as fast.
    heartbeats = []
    for worker_id, tps in (("a", 40.0), ("b", 44.0), ("fast", 100.0)):
        for k in range(2):
            hb = heartbeat(worker_id, running=4, decode_tps=tps, sent_at=NOW_WALL + k, blocks=64 * 2)
            r.builder.observe(hb)
        heartbeats.append(hb)
    picks = [r.place(request(f"r{i}"), heartbeats, NOW_WALL + 60).chain.worker_id for i in range(6)]  # type: ignore[union-attr]
    assert picks[:2] == ["fast", "fast"]  # the fastest chain first, until its 2 slots are taken
    assert Counter(picks[2:]) == {"a": 2, "b": 2}  # then a and b as equals, by load


def test_jffc_lets_a_suspect_node_take_work_once_healthy_ones_are_busier() -> None:
    # A suspect verdict (weight 0.3) on a busy fleet mostly means slow probes from load, not a slower node.
    snap = snapshot(chain("suspect", health=0.3, used=1, running=1), chain("healthy", used=5, running=5))
    assert choose("jffc", snap) == "suspect"  # load 1/0.3 = 3.3 < 5
    assert choose("jffc", snapshot(chain("suspect", health=0.3, used=2, running=2), chain("healthy", used=5, running=5))) == "healthy"
    # A node that is really faster is still taken first.
    assert choose("jffc", snapshot(chain("fast", speed=3.0, used=5, running=5), chain("idle"))) == "fast"
