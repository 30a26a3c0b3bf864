"""Routing that knows LoRA adapters (services/balancer/adapters.py and the router around it).

A request for an adapter costs, per node, the adapter's load there: nothing in a batch slot, a copy from host
memory, a fetch and load otherwise; a node whose every slot runs other adapters' requests is not offered, nor is
one that serves no adapter. Where the adapter runs nothing yet, the slot it takes is priced too: the mean hold
times rho / (1 - rho). The indexed and the snapshot paths decide alike, and a fleet with no adapter-serving node
refuses the request at once.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.messages import ErrorReply, Heartbeat
from services.balancer.adapters import AdapterPlacement
from services.balancer.router import Placement
from shared.balancer_settings import AdapterRoutingSettings
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, request, router

# Loads alone (the slot price has tests of its own).
SETTINGS = AdapterRoutingSettings(load_s=0.5, activate_s=0.01, price_slots=False)
PRICED = AdapterRoutingSettings(load_s=0.5, activate_s=0.01, hold_s=4.0)


def lora_node(worker_id: str, *, active: tuple[str, ...] = (), adapters_running: tuple[str, ...] = (),
              cached: tuple[str, ...] = (), max_loras: int = 2, load_s: float = 0.0, **load: object) -> Heartbeat:
    """A node serving adapters; `load`: `heartbeat`'s fields (running requests, KV...)."""
    beat = heartbeat(worker_id, **load)  # type: ignore[arg-type]
    return msgspec.structs.replace(
        beat, registration=msgspec.structs.replace(beat.registration, max_loras=max_loras, max_cpu_loras=4),
        stats=msgspec.structs.replace(beat.stats, adapters_active=list(active), adapters_running=list(adapters_running),
                                      adapters_cached=list(cached), adapter_load_s=load_s))


def adapter_request(request_id: str = "r1", adapter: str = "x", **fields: object):
    return msgspec.structs.replace(request(request_id, **fields), adapter=adapter)  # type: ignore[arg-type]


def placement_costs(beats: list[Heartbeat], adapter: str = "x", settings: AdapterRoutingSettings = SETTINGS) -> dict:
    placement = AdapterPlacement(settings)
    for beat in beats:
        placement.observe(beat)
    return dict(placement.load_seconds(adapter, beats))


def test_a_load_costs_nothing_in_a_slot_a_copy_from_host_memory_and_a_load_from_the_bus() -> None:
    beats = [lora_node("slot", active=("x",)), lora_node("host", cached=("x",)), lora_node("none"),
             lora_node("measured", load_s=0.2), heartbeat("no-lora")]
    assert placement_costs(beats) == {"slot": 0.0, "host": 0.01, "none": 0.5, "measured": 0.2, "no-lora": None}


def test_a_node_whose_slots_all_run_other_adapters_is_not_offered() -> None:
    beats = [lora_node("full", active=("a", "b"), adapters_running=("a", "b")), lora_node("idle-slots", active=("a", "b"), adapters_running=("a",))]
    # Taking idle b's slot sends b back to host memory: its next request there copies it again.
    assert placement_costs(beats) == {"full": None, "idle-slots": 0.5 + 0.01}
    # Its own adapter still runs there: it takes no other slot.
    assert placement_costs(beats, "a") == {"full": 0.0, "idle-slots": 0.0}


def test_unaware_costs_every_adapter_node_alike() -> None:
    beats = [lora_node("full", active=("a", "b"), adapters_running=("a", "b")), lora_node("none"), heartbeat("no-lora")]
    unaware = AdapterRoutingSettings(aware=False)
    assert placement_costs(beats, settings=unaware) == {"full": 0.0, "none": 0.0, "no-lora": None}


def test_adapters_of_requests_placed_here_count_as_running_until_their_slot_is_freed() -> None:
    placement = AdapterPlacement(SETTINGS)
    beats = [lora_node("w0", active=("a",), adapters_running=("a",))]
    placement.observe(beats[0])
    placement.note_placed("r1", "w0", "x", 0.0)
    placement.note_placed("r2", "w0", "x", 0.0)
    assert placement.load_seconds("x", beats) == {"w0": 0.0}
    # Two adapters now hold its two slots, whatever a heartbeat that does not know it yet says.
    assert placement.load_seconds("y", beats) == {"w0": None}
    placement.observe(beats[0])
    assert placement.load_seconds("y", beats) == {"w0": None}
    placement.released("r1", 1.0)
    assert placement.load_seconds("y", beats) == {"w0": None}  # r2 still runs x
    placement.released("r2", 1.0)
    placement.released("r2", 1.0)  # releases are idempotent
    assert placement.load_seconds("y", beats) == {"w0": 0.5}


def test_an_adapter_whose_requests_here_ended_frees_its_slot_before_the_next_heartbeat() -> None:
    placement = AdapterPlacement(SETTINGS)
    placement.note_placed("r1", "w0", "a", 0.0)
    beats = [lora_node("w0", max_loras=1, active=("a",), adapters_running=("a",))]
    placement.observe(beats[0])
    assert placement.load_seconds("y", beats) == {"w0": None}
    placement.released("r1", 1.0)  # a's last request here ended: the heartbeat still says a runs
    assert placement.load_seconds("y", beats) == {"w0": 0.5 + 0.01}
    placement.observe(beats[0])  # a heartbeat after it (another balancer's request for a, say) is believed again
    assert placement.load_seconds("y", beats) == {"w0": None}


def test_every_way_a_slot_is_freed_frees_its_adapter() -> None:
    route = router(clock=lambda: NOW_WALL)
    beats = [lora_node("w0", max_loras=1)]
    route.observe(beats[0])
    placed = route.place(adapter_request("r1", adapter="x"), beats, NOW_WALL + 60)
    assert isinstance(placed, Placement)
    assert route.place(adapter_request("r2", adapter="y"), beats, NOW_WALL + 60) is None  # x holds the one slot
    route.finished("r1", "w0")
    assert isinstance(route.place(adapter_request("r2", adapter="y"), beats, NOW_WALL + 60), Placement)
    route.table.expire(NOW_WALL + 61)  # r2's deadline passed
    assert isinstance(route.place(adapter_request("r3", adapter="z"), beats, NOW_WALL + 120), Placement)


@pytest.mark.parametrize("use_index", [True, False])
def test_jffc_per_request_takes_the_node_with_the_adapter_loaded(use_index: bool) -> None:
    route = router(use_index=use_index, clock=lambda: NOW_WALL)
    # The node without the adapter is otherwise the better one: idle, where the other runs a request.
    beats = [lora_node("cold"), lora_node("warm", active=("x",), running=1)]
    for beat in beats:
        route.observe(beat)
    placed = route.place(adapter_request(), beats, NOW_WALL + 60)
    assert isinstance(placed, Placement) and placed.chain.worker_id == "warm"
    # Without the adapter the idle node wins: the load is what tipped it.
    placed = route.place(request("r2"), beats, NOW_WALL + 60)
    assert isinstance(placed, Placement) and placed.chain.worker_id == "cold"


@pytest.mark.parametrize("use_index", [True, False])
def test_no_node_with_a_slot_for_the_adapter_leaves_the_request_waiting(use_index: bool) -> None:
    route = router(use_index=use_index, clock=lambda: NOW_WALL)
    beats = [lora_node("full", active=("a", "b"), adapters_running=("a", "b")), heartbeat("no-lora")]
    for beat in beats:
        route.observe(beat)
    assert route.place(adapter_request(), beats, NOW_WALL + 60) is None
    assert isinstance(route.place(request("plain"), beats, NOW_WALL + 60), Placement)


@pytest.mark.parametrize("policy", ["jffc_per_request", "lora_affinity", "round_robin", "least_loaded"])
def test_the_indexed_and_snapshot_paths_cost_the_adapter_alike(policy: str) -> None:
    beats = [lora_node("w0", cached=("x",), running=2), lora_node("w1", running=1), lora_node("w2", active=("x",), running=3),
             lora_node("w3", active=("a", "b"), adapters_running=("a", "b"))]
    choices = []
    for use_index in (True, False):
        route = router(policy, use_index=use_index, clock=lambda: NOW_WALL)
        for beat in beats:
            route.observe(beat)
        picks = []
        for i in range(6):
            placed = route.place(adapter_request(f"r{i}", adapter="xyz"[i % 3]), beats, NOW_WALL + 60)
            picks.append(placed.chain.worker_id if placed else None)
        choices.append(picks)
    assert choices[0] == choices[1]


def test_a_fleet_without_adapters_refuses_an_adapter_request_at_once() -> None:
    route = router()
    beats = [heartbeat("w0"), heartbeat("w1")]
    refusal = route.unroutable(adapter_request(), beats, lambda: beats)
    assert isinstance(refusal, ErrorReply) and refusal.code == "adapter_unavailable" and refusal.status == 503
    assert route.unroutable(adapter_request(), [*beats, lora_node("w2")], lambda: beats) is None


def test_a_slot_is_priced_at_its_hold_times_rho_over_one_less_rho() -> None:
    # 3 of 4 slots run requests: rho = 0.75, so a slot costs 4 s x 3.
    beats = [lora_node("full", active=("a", "b"), adapters_running=("a", "b")),
             lora_node("half", active=("a", "x"), adapters_running=("a",))]
    assert placement_costs(beats, "a", PRICED) == {"full": 0.0, "half": 0.0}  # a runs there: no slot taken
    assert placement_costs(beats, "x", PRICED) == {"full": None, "half": 12.0}  # x idle in its slot: the slot only
    assert placement_costs(beats, "y", PRICED) == {"full": None, "half": 12.0 + 0.5 + 0.01}  # and a load, and an eviction
    idle = [lora_node("w0"), lora_node("w1")]
    assert placement_costs(idle, "y", PRICED) == {"w0": 0.5, "w1": 0.5}  # no slot busy: free


def test_the_hold_is_the_moving_mean_of_the_holds_that_ended() -> None:
    placement = AdapterPlacement(PRICED)
    placement.observe(lora_node("w0"))
    placement.note_placed("r1", "w0", "x", 10.0)
    placement.released("r1", 24.0)  # held 14 s
    assert placement.mean_hold_s == pytest.approx(4.0 + 0.02 * 10.0)
    placement.released("r1", 99.0)  # once only
    assert placement.mean_hold_s == pytest.approx(4.2)


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), min_size=1, max_size=8), st.floats(0.0, 60.0))
def test_the_slot_price_grows_with_busy_slots_and_stays_finite(nodes: list[tuple[int, int]], hold_s: float) -> None:
    placement = AdapterPlacement(AdapterRoutingSettings(hold_s=hold_s))
    busy_on = {}
    for k, (max_loras, running) in enumerate(nodes):
        names = tuple(f"a{j}" for j in range(min(running, max_loras)))
        placement.observe(lora_node(f"w{k}", max_loras=max_loras, active=names, adapters_running=names))
        busy_on[f"w{k}"] = frozenset(names)
    price = placement.slot_price_s(busy_on)
    assert 0.0 <= price <= hold_s * 0.95 / 0.05 + 1e-9 and math.isfinite(price)
    if not any(busy_on.values()):
        assert price == 0.0
    # One more adapter running on a node with a free slot never makes a slot cheaper.
    for worker_id, running in busy_on.items():
        if len(running) < placement._nodes[worker_id].max_loras:
            assert placement.slot_price_s({**busy_on, worker_id: running | {"more"}}) >= price
            break


@pytest.mark.parametrize("use_index", [True, False])
def test_jffc_per_request_keeps_an_adapter_where_it_runs_while_slots_are_scarce(use_index: bool) -> None:
    # "warm" runs x beside three other requests; "cold" is idle with a free slot, and would finish x sooner.
    beats = [lora_node("warm", active=("x", "a"), adapters_running=("x", "a"), running=24),
             lora_node("cold", active=("b",), adapters_running=("b",))]
    for settings, chosen in ((PRICED, "warm"), (SETTINGS, "cold")):
        route = router(use_index=use_index, clock=lambda: NOW_WALL)
        route.adapters = AdapterPlacement(settings)
        for beat in beats:
            route.observe(beat)
        placed = route.place(adapter_request(output=512), beats, NOW_WALL + 60)
        assert isinstance(placed, Placement) and placed.chain.worker_id == chosen


def test_a_request_with_an_adapter_is_not_held_back_for_a_backlog() -> None:
    route = router("jffc_per_request", clock=lambda: NOW_WALL)
    assert route.backlog_bound_s(adapter_request(), NOW_WALL) == math.inf
