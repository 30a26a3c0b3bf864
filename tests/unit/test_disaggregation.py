"""Disaggregation's pure parts: KV links and sizes, the sim engine's held and
imported KV, and the balancer's choice of a prefill node."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.messages import GenerateRequest, Heartbeat, KvRef, RouteRequest, SamplingParams, WorkerRequest
from services.balancer.disaggregation import choose_prefill, prefill_finish_s
from services.balancer.router import Router
from services.balancer.snapshot import ChainState
from services.worker.sim import SimRequest, get_profile
from shared.config import DisaggregationSettings
from shared.kv.links import NAMED_LINKS, advertised_kv_transfer, get_link, hand_off_seconds, kv_bytes_per_token
from tests.unit.balancer_fixtures import NOW_WALL, TINY, chain, heartbeat, request, router
from tests.unit.test_sim_scheduler import make_scheduler, run_all

SETTINGS = DisaggregationSettings(min_remote_prefill_tokens=256, local_prefill_when_saturated=True)

# --- links and KV sizes -----------------------------------------------------------


def test_kv_bytes_per_token_follows_the_model_shape() -> None:
    # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 = 128 KiB per token (REFERENCE-NUMBERS.md).
    assert kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024
    assert get_profile("h100-80g-llama3-8b").kv_bytes_per_token == 128 * 1024
    assert get_profile("a100-80g-llama3-70b-tp4").kv_bytes_per_token == 320 * 1024
    assert get_profile("tiny-cpu").kv_bytes_per_token == 1024


def test_links_are_ordered_by_speed_and_a_transfer_costs_latency_plus_bytes() -> None:
    order = ["nvlink", "pcie5", "rdma-400g", "ethernet-100g", "ethernet-25g"]
    times = [get_link(name).transfer_seconds(1 << 30) for name in order]
    assert times == sorted(times)
    # 1,000 tokens of Llama-3-8B KV (131 MB) over 100 GbE: about 10.5 ms.
    assert get_link("ethernet-100g").transfer_seconds(1000 * 128 * 1024) == pytest.approx(0.0105, rel=0.01)
    assert all(link.transfer_seconds(0) == 0.0 for link in NAMED_LINKS.values())
    with pytest.raises(KeyError, match="known links"):
        get_link("carrier-pigeon")


def test_a_generate_request_carries_its_kv_ref_over_the_wire() -> None:
    ref = KvRef(source_worker_id="p0", engine_id="e", request_id="r", num_tokens=64, hold_s=30.0,
                block_ids=[[1, 2]], host="127.0.0.1", port=5600, kv_bytes=65536, engine_extras={"tp_size": 1})
    message = GenerateRequest("r", "m", [1, 2], SamplingParams(max_tokens=4), "s", 30.0, kv_ref=ref)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=WorkerRequest)
    assert decoded == message
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(msgspec.structs.replace(ref, port=70000)), type=KvRef)


# --- the sim engine's held and imported KV ------------------------------------------


def test_a_held_request_keeps_its_blocks_until_released() -> None:
    scheduler = make_scheduler()
    scheduler.add(SimRequest("p", list(range(1, 18)), max_tokens=1, hold_kv=True))
    run_all(scheduler)
    held = scheduler.held_blocks
    assert held == math.ceil(18 / 4)  # 17 prompt tokens + the sampled one
    assert scheduler.stats().blocks_used == held
    with pytest.raises(ValueError, match="already"):
        scheduler.add(SimRequest("p", [1, 2, 3], max_tokens=1))
    assert scheduler.release_held("p") and not scheduler.release_held("p")
    assert scheduler.stats().blocks_used == 0 and scheduler.held_blocks == 0


@given(prompt_len=st.integers(1, 60))
def test_imported_kv_is_a_prefix_cache_hit(prompt_len: int) -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 100 + prompt_len))
    imported = scheduler.import_prefix(prompt)
    assert imported == prompt_len // 4 * 4
    assert scheduler.stats().blocks_used == 0  # imported blocks are cached, not in use
    scheduler.add(SimRequest("d", prompt, max_tokens=2))
    run_all(scheduler)
    # Like vLLM, the last prompt token is always computed: a full-block prompt hits one block less.
    assert scheduler.stats().prefix_hit_tokens == min(imported, (prompt_len - 1) // 4 * 4)


def test_import_into_a_full_pool_imports_nothing() -> None:
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add(SimRequest("busy", list(range(1, 14)), max_tokens=1, hold_kv=True))
    run_all(scheduler)
    assert scheduler.import_prefix(list(range(500, 520))) == 0


# --- choosing the prefill node ---------------------------------------------------------


def test_only_decode_chains_get_a_prefill_node_and_only_for_long_uncached_prompts() -> None:
    decode = chain("d0", role="decode")
    prefill = [chain("p0", role="prefill")]
    assert choose_prefill(chain("w0"), 1000, prefill, SETTINGS) is None
    assert choose_prefill(decode, 1000, [], SETTINGS) is None
    assert choose_prefill(decode, 200, prefill, SETTINGS) is None
    assert choose_prefill(decode, 300, prefill, SETTINGS).worker_id == "p0"
    # 40 of 48 blocks cached on the decode node: 128 tokens to prefill there, below the threshold.
    assert choose_prefill(chain("d0", role="decode", cached=40), 768, prefill, SETTINGS) is None


def test_the_prefill_node_that_finishes_first_wins() -> None:
    decode = chain("d0", role="decode")
    slow = chain("p0", role="prefill", speed=0.5)
    cached = chain("p1", role="prefill", cached=40)  # holds 640 of the 700 tokens
    assert choose_prefill(decode, 700, [slow, cached], SETTINGS).worker_id == "p1"
    assert prefill_finish_s(slow, 700) == pytest.approx(700 * TINY.b / 0.5)
    fast = chain("p2", role="prefill", speed=2.0)
    assert choose_prefill(decode, 700, [slow, fast], SETTINGS).worker_id == "p2"


def test_the_router_completes_a_decode_chain_and_degrades_to_local_prefill() -> None:
    r = router()
    heartbeats = [heartbeat("d0", role="decode"), heartbeat("p0", role="prefill"), heartbeat("p1", role="prefill")]
    placement = r.place(request("r1", prompt=1024, blocks=64), heartbeats, NOW_WALL + 60)
    assert placement.chain.worker_id == "d0" and placement.prefill is not None
    first = placement.prefill.worker_id
    # The first prompt is now the chosen node's backlog: the next goes to the other one.
    second = r.place(request("r2", prompt=1024, blocks=64), heartbeats, NOW_WALL + 60)
    assert {first, second.prefill.worker_id} == {"p0", "p1"}
    # Prefill nodes never generate, and with every prefill node excluded the decode node prefills.
    alone = r.place(request("r3", prompt=1024, blocks=64, exclude=["p0", "p1"]), heartbeats, NOW_WALL + 60)
    assert alone.chain.worker_id == "d0" and alone.prefill is None
    assert r.place(request("r4", prompt=1024), [heartbeat("p0", role="prefill")], NOW_WALL + 60) is None


def test_a_saturated_prefill_pool_leaves_the_prompt_to_the_decode_node() -> None:
    decode = chain("d0", role="decode")
    backed_up = msgspec.structs.replace(chain("p0", role="prefill"), prefill_backlog_s=2.0)
    assert choose_prefill(decode, 700, [backed_up], SETTINGS) is None  # 2 s behind; d0 starts now
    off = msgspec.structs.replace(SETTINGS, local_prefill_when_saturated=False)
    assert choose_prefill(decode, 700, [backed_up], off).worker_id == "p0"
    # Busy, but within the bound: still disaggregated.
    busy = msgspec.structs.replace(chain("p0", role="prefill"), prefill_backlog_s=0.2)
    assert choose_prefill(decode, 700, [busy], SETTINGS).worker_id == "p0"
    # The decode node itself is further behind than the saturated pool: the pool still does it.
    swamped = msgspec.structs.replace(decode, prefill_backlog_s=5.0)
    assert choose_prefill(swamped, 700, [backed_up], SETTINGS).worker_id == "p0"


def test_the_router_counts_local_prefills_of_a_saturated_pool() -> None:
    r = router()
    r._disaggregation = SETTINGS
    heartbeats = [heartbeat("d0", role="decode"), heartbeat("p0", role="prefill")]
    first = r.place(request("r1", prompt=100_000, blocks=64), heartbeats, NOW_WALL + 60)  # a prompt that keeps p0 busy for a while
    assert first.prefill is not None and first.prefill.worker_id == "p0"
    second = r.place(request("r2", prompt=100_000, blocks=64), heartbeats, NOW_WALL + 60)
    assert second.prefill is None and r.degradation.counts["local_prefill"] == 1


def test_among_idle_prefill_nodes_the_one_with_less_in_hand_wins() -> None:
    decode = chain("d0", role="decode")
    busy, quiet = chain("p0", role="prefill", running=2), chain("p1", role="prefill")
    assert choose_prefill(decode, 700, [busy, quiet], SETTINGS).worker_id == "p1"


def test_a_two_node_chain_is_costed_with_its_prefill_node() -> None:
    r = router()
    heartbeats = [heartbeat("d0", role="decode"), heartbeat("d1", role="decode"), heartbeat("p0", role="prefill")]
    req = request("r1", prompt=1024, blocks=64)
    r.index.apply("d0", stored=req.block_hashes[:60])  # d0 lacks 64 prompt tokens: it prefills them itself
    snapshot = r.builder.snapshot(req, heartbeats, r.table.used, r.index.match(req.block_hashes))
    costed, prefill_for = r._with_prefill_nodes(req, snapshot, heartbeats, r.index.match(req.block_hashes))
    by_node = {c.worker_id: c for c in costed.chains}
    assert by_node["d0"].remote_prefill_s is None and "d0@0" not in prefill_for
    assert by_node["d1"].remote_prefill_s == pytest.approx(1024 * TINY.b)
    assert prefill_for["d1@0"].worker_id == "p0"
    placement = r.place(req, heartbeats, NOW_WALL + 60)
    assert placement.chain.worker_id == "d0" and placement.prefill is None


# --- the KV transfer in a two-node chain's cost --------------------------------------------

LLAMA3_8B_KV = 128 * 1024  # bytes per token


def with_link(hb: Heartbeat, link: str, bytes_per_token: int = LLAMA3_8B_KV) -> Heartbeat:
    transfer = advertised_kv_transfer(bytes_per_token, get_link(link))
    return msgspec.structs.replace(hb, registration=msgspec.structs.replace(hb.registration, kv_transfer=transfer))


def test_a_hand_off_crosses_the_slower_of_the_two_links() -> None:
    fast, slow = advertised_kv_transfer(LLAMA3_8B_KV, get_link("rdma-400g")), advertised_kv_transfer(LLAMA3_8B_KV, get_link("ethernet-25g"))
    assert fast is not None and slow is not None
    expected = get_link("ethernet-25g").transfer_seconds(1000 * LLAMA3_8B_KV)
    assert hand_off_seconds(1000, fast, slow) == pytest.approx(expected)
    assert hand_off_seconds(1000, slow, fast) == pytest.approx(expected)
    assert hand_off_seconds(1000, fast, None) == pytest.approx(get_link("rdma-400g").transfer_seconds(1000 * LLAMA3_8B_KV))
    # Unknown on both sides, or nothing to move: not costed.
    assert hand_off_seconds(1000, None, None) == 0.0 and hand_off_seconds(0, fast, slow) == 0.0
    # A sim worker running 10x as fast as its GPU moves its KV 10x as fast.
    tenfold = advertised_kv_transfer(LLAMA3_8B_KV, get_link("ethernet-25g"), speed=10.0)
    assert hand_off_seconds(1000, tenfold, tenfold) == pytest.approx(expected / 10)
    assert advertised_kv_transfer(0, get_link("nvlink")) is None


@given(tokens=st.integers(1, 200_000), links=st.permutations(["nvlink", "pcie5", "rdma-400g", "ethernet-100g", "ethernet-25g"]))
def test_a_slower_link_never_makes_a_hand_off_cheaper(tokens: int, links: list[str]) -> None:
    order = sorted(links, key=lambda name: get_link(name).transfer_seconds(1 << 30))
    costs = [hand_off_seconds(tokens, *(advertised_kv_transfer(LLAMA3_8B_KV, get_link(name)),) * 2) for name in order]
    assert costs == sorted(costs) and costs[0] > 0


def _two_node_fleet(link: str) -> list[Heartbeat]:
    # d0 holds most of the prompt and prefills the rest itself, but already runs 4 requests;
    # d1 is idle, and its prompt comes from p0 over `link`.
    return [with_link(heartbeat("d0", role="decode", running=4), link), with_link(heartbeat("d1", role="decode"), link),
            with_link(heartbeat("p0", role="prefill"), link)]


def _costed(r: Router, req: RouteRequest, heartbeats: list[Heartbeat]) -> dict[str, ChainState]:
    cached = r.index.match(req.block_hashes)
    snapshot = r.builder.snapshot(req, heartbeats, r.table.used, cached)
    costed, _ = r._with_prefill_nodes(req, snapshot, heartbeats, cached)
    return {c.worker_id: c for c in costed.chains}


def test_a_slower_link_raises_a_two_node_chains_cost_and_changes_the_choice() -> None:
    req = request("r1", prompt=1024, blocks=64)
    chosen, remote = {}, {}
    for link in ("nvlink", "ethernet-25g"):
        r = router()
        r.index.apply("d0", stored=req.block_hashes[:60])
        heartbeats = _two_node_fleet(link)
        by_node = _costed(r, req, heartbeats)
        assert by_node["d0"].remote_prefill_s is None  # prefills its 64 missing tokens itself: no transfer
        remote[link] = by_node["d1"].remote_prefill_s
        assert remote[link] == pytest.approx(1024 * TINY.b + get_link(link).transfer_seconds(1024 * LLAMA3_8B_KV))
        chosen[link] = r.place(req, heartbeats, NOW_WALL + 60).chain.worker_id
    assert remote["ethernet-25g"] > remote["nvlink"]
    # Over NVLink the idle decode node is worth the hand-off; over 25 GbE the 134 MB take 43 ms,
    # and the busy node that holds the prompt is sooner.
    assert chosen == {"nvlink": "d1", "ethernet-25g": "d0"}


def test_without_transfer_costing_a_two_node_chain_costs_what_it_did() -> None:
    req = request("r1", prompt=1024, blocks=64)
    r = router()
    r._disaggregation = DisaggregationSettings(cost_kv_transfer=False)
    by_node = _costed(r, req, _two_node_fleet("ethernet-25g"))
    assert by_node["d1"].remote_prefill_s == pytest.approx(1024 * TINY.b)


def test_the_prefill_node_on_the_faster_link_wins_when_the_transfer_dominates() -> None:
    r = router()
    decode = with_link(heartbeat("d0", role="decode"), "rdma-400g")
    near, far = with_link(heartbeat("p0", role="prefill"), "rdma-400g"), with_link(heartbeat("p1", role="prefill"), "ethernet-25g")
    # p0 has a prompt in hand (10k tokens, 0.2 s at TINY's b); p1 is idle but 43 ms away by its link.
    r.builder._backlog.add("p0", 10_000, 1 / TINY.b, r.builder.clock())
    placement = r.place(request("r1", prompt=1024, blocks=64), [decode, far, near], NOW_WALL + 60)
    assert placement.prefill is not None and placement.prefill.worker_id == "p1"
    # With a small backlog, the near one is sooner despite it.
    r = router()
    r.builder._backlog.add("p0", 500, 1 / TINY.b, r.builder.clock())
    placement = r.place(request("r1", prompt=1024, blocks=64), [decode, far, near], NOW_WALL + 60)
    assert placement.prefill is not None and placement.prefill.worker_id == "p0"
