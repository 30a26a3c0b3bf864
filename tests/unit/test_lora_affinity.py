"""lora_affinity: the adapter's active nodes first, then nodes with room, then load; the index decides as a snapshot does."""

from __future__ import annotations

from collections import Counter

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.messages import Heartbeat
from services.balancer.policies import make_policy
from services.balancer.policies.lora_affinity import LoraAffinity
from services.balancer.router import Placement, Router
from shared.balancer_settings import AdapterRoutingSettings
from tests.unit.balancer_fixtures import NOW_WALL, chain, heartbeat, request, router, settings as balancer_settings, snapshot

ADAPTERS = ["a0", "a1", "a2", "a3", "a4"]
WORKERS = [f"w{i}" for i in range(5)]


def with_adapter(adapter: str, request_id: str = "r1"):
    return msgspec.structs.replace(request(request_id), adapter=adapter)


def loading(state, seconds: float):
    return msgspec.structs.replace(state, adapter_load_s=seconds)


def pick(snap, adapter: str = "a0") -> str:
    chosen = make_policy("lora_affinity", balancer_settings("lora_affinity")).choose(with_adapter(adapter), snap)
    assert chosen is not None
    return chosen.worker_id


def test_a_node_with_the_adapter_active_wins_over_idler_ones() -> None:
    busy_active = loading(chain("active", running=6, used=6), 0.0)
    idle_host = loading(chain("host", running=0), 0.003)
    idle_storage = loading(chain("storage", running=0), 0.08)
    assert pick(snapshot(idle_host, busy_active, idle_storage)) == "active"


def test_without_an_active_node_load_decides_whatever_the_adapter_would_cost() -> None:
    # GIE's "room" tier does not tell a copy from host memory from a fetch: load, then KV, decide.
    host = loading(chain("host", running=3), 0.003)
    storage = loading(chain("storage", running=1), 0.08)
    assert pick(snapshot(host, storage)) == "storage"
    kv_heavy = loading(chain("kv_heavy", running=1, kv_used=800), 0.003)
    kv_light = loading(chain("kv_light", running=1, kv_used=100), 0.08)
    assert pick(snapshot(kv_heavy, kv_light)) == "kv_light"


def test_among_active_nodes_the_least_loaded_wins_and_ties_rotate() -> None:
    snap = snapshot(loading(chain("a", running=2), 0.0), loading(chain("b", running=1), 0.0),
                    loading(chain("c", running=1), 0.0), loading(chain("idle", running=0), 0.08))
    policy = LoraAffinity()
    picks = [policy.choose(with_adapter("a0"), snap).worker_id for _ in range(6)]  # type: ignore[union-attr]
    assert Counter(picks) == {"b": 3, "c": 3}


def test_a_request_without_adapter_goes_by_load_alone() -> None:
    # Only an adapter request reads the adapter column (a base-model request has none to load).
    snap = snapshot(loading(chain("slot", running=4), 0.0), chain("idle", running=0))
    assert pick(snap, adapter="") == "idle"


def test_full_chains_are_never_taken() -> None:
    snap = snapshot(loading(chain("active_full", slots=2, used=2), 0.0), loading(chain("other", running=5), 0.08))
    assert pick(snap) == "other"
    assert LoraAffinity().choose(with_adapter("a0"), snapshot(chain("full", slots=1, used=1))) is None


# --- on the router: heartbeats with adapters, the chain index against a snapshot per decision --------------------------


def adapter_heartbeat(worker_id: str, *, running: int, in_slots: list[str], busy: list[str], in_host: list[str],
                      sent_at: float, max_loras: int = 2) -> Heartbeat:
    hb = heartbeat(worker_id, running=running, sent_at=sent_at, decode_tps=100.0, prefill_tps=100.0, started_at=1.0)
    registration = msgspec.structs.replace(hb.registration, max_loras=max_loras, max_cpu_loras=max_loras + 2)
    stats = msgspec.structs.replace(hb.stats, adapters_active=in_slots, adapters_running=busy, adapters_cached=in_host,
                                    adapter_loads=1, adapter_load_s=0.05)
    return msgspec.structs.replace(hb, registration=registration, stats=stats)


class Spy(LoraAffinity):
    """Counts which of its two ways each decision took."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def choose(self, request, snapshot):  # type: ignore[no-untyped-def]
        self.calls["snapshot"] += 1
        return super().choose(request, snapshot)

    def choose_indexed(self, request, chains):  # type: ignore[no-untyped-def]
        self.calls["indexed"] += 1
        return super().choose_indexed(request, chains)


def spied_router(use_index: bool, aware: bool = True) -> tuple[Router, Spy]:
    r = router("lora_affinity", clock=lambda: NOW_WALL, use_index=use_index)
    r.adapters._settings = AdapterRoutingSettings(aware=aware)
    spy = Spy()
    r.policy = spy
    return r, spy


node_states = st.lists(
    st.tuples(st.integers(0, 5),  # running
              st.lists(st.sampled_from(ADAPTERS), max_size=2, unique=True),  # in slots
              st.integers(0, 2),  # how many of those run requests
              st.lists(st.sampled_from(ADAPTERS), max_size=2, unique=True)),  # in host memory besides
    min_size=1, max_size=len(WORKERS),
)
requests = st.lists(st.tuples(st.sampled_from(["", *ADAPTERS]), st.booleans()), min_size=1, max_size=25)


@settings(max_examples=200, deadline=None)
@given(nodes=node_states, sequence=requests)
def test_the_index_and_the_snapshot_choose_the_same_nodes(nodes, sequence) -> None:
    indexed, indexed_spy = spied_router(use_index=True)
    reference, reference_spy = spied_router(use_index=False)
    heartbeats = []
    for worker_id, (running, in_slots, busy, in_host) in zip(WORKERS, nodes):
        hb = adapter_heartbeat(worker_id, running=running, in_slots=in_slots, busy=in_slots[:busy],
                               in_host=[a for a in in_host if a not in in_slots], sent_at=NOW_WALL)
        heartbeats.append(hb)
        indexed.observe(hb)
        reference.observe(hb)
    placed: list[Placement] = []
    for number, (adapter, finish_one) in enumerate(sequence):
        req = with_adapter(adapter, f"r{number}")
        got = indexed.place(req, heartbeats, NOW_WALL + 60)
        expected = reference.place(req, heartbeats, NOW_WALL + 60)
        assert (got and got.chain.worker_id) == (expected and expected.chain.worker_id)
        if got is not None:
            placed.append(got)
        if finish_one and placed:
            done = placed.pop(0)
            assert indexed.finished(done.request_id, done.chain.worker_id) == reference.finished(
                done.request_id, done.chain.worker_id)
    # Every decision of the indexed router was the index's: the agreement above compared the two ways.
    assert indexed_spy.calls["snapshot"] == 0 and reference_spy.calls["indexed"] == 0
    assert indexed_spy.calls["indexed"] == reference_spy.calls["snapshot"] > 0


def test_on_the_router_a_burst_for_one_adapter_stays_on_the_node_it_went_to() -> None:
    """What `AdapterPlacement` counts as sent makes that node "active" for the next requests of the adapter."""
    for use_index in (True, False):
        r, _ = spied_router(use_index)
        heartbeats = [adapter_heartbeat(w, running=0, in_slots=[], busy=[], in_host=[], sent_at=NOW_WALL) for w in WORKERS]
        for hb in heartbeats:
            r.observe(hb)
        first = r.place(with_adapter("a3", "first"), heartbeats, NOW_WALL + 60)
        assert first is not None
        # The node it went to now runs one more request than any other; the adapter keeps going there.
        again = [r.place(with_adapter("a3", f"again{i}"), heartbeats, NOW_WALL + 60) for i in range(3)]
        assert {p.chain.worker_id for p in again if p is not None} == {first.chain.worker_id}
        # Another adapter goes to the idlest node instead.
        other = r.place(with_adapter("a4", "other"), heartbeats, NOW_WALL + 60)
        assert other is not None and other.chain.worker_id != first.chain.worker_id


def test_unaware_it_is_least_loaded() -> None:
    """With `balancer.adapters.aware` off every node reads as active: the adapter no longer draws requests."""
    for use_index in (True, False):
        r, _ = spied_router(use_index, aware=False)
        heartbeats = [adapter_heartbeat("slot", running=3, in_slots=["a0"], busy=["a0"], in_host=[], sent_at=NOW_WALL),
                      adapter_heartbeat("idle", running=0, in_slots=[], busy=[], in_host=[], sent_at=NOW_WALL)]
        for hb in heartbeats:
            r.observe(hb)
        chosen = r.place(with_adapter("a0"), heartbeats, NOW_WALL + 60)
        assert chosen is not None and chosen.chain.worker_id == "idle"
        aware, _ = spied_router(use_index, aware=True)
        for hb in heartbeats:
            aware.observe(hb)
        chosen = aware.place(with_adapter("a0"), heartbeats, NOW_WALL + 60)
        assert chosen is not None and chosen.chain.worker_id == "slot"
