"""The in-memory view of live workers (ClusterView in shared/cluster.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.messages import EngineStats, Heartbeat, LoadReport, WorkerRegistration
from shared.cluster import ClusterView, ClusterWatcher
from shared.heartbeats import HeartbeatSender

TTL = 3.0


def hb(
    worker_id: str,
    sent_at: float = 100.0,
    *,
    model: str = "m",
    draining: bool = False,
    running: int = 0,
    seq: int = 0,
    started_at: float = 0.0,
) -> Heartbeat:
    registration = WorkerRegistration(
        worker_id=worker_id,
        role="aggregated",
        model=model,
        engine="sim",
        inbox=f"inbox.{worker_id}",
        block_size=16,
        max_model_len=4096,
        tokenizer="sim",
        started_at=started_at,
    )
    return Heartbeat(registration=registration, stats=EngineStats(running=running), sent_at=sent_at, seq=seq, draining=draining)


def ids(heartbeats: list[Heartbeat]) -> list[str]:
    return sorted(h.registration.worker_id for h in heartbeats)


def test_empty_view() -> None:
    view = ClusterView(TTL)
    assert view.live(0.0) == []
    assert view.routable(0.0, "m") == []
    assert view.models(0.0) == {}
    assert view.prune(0.0) == []


def test_observe_then_live_routable_models() -> None:
    view = ClusterView(TTL)
    view.observe(hb("a"), seen_at=10.0)
    view.observe(hb("b", model="other"), seen_at=10.0)
    assert ids(view.live(10.0)) == ["a", "b"]
    assert ids(view.routable(10.0, "m")) == ["a"]
    assert ids(view.routable(10.0, "other")) == ["b"]
    assert view.routable(10.0, "missing") == []
    models = view.models(10.0)
    assert sorted(models) == ["m", "other"]
    assert models["m"].worker_id == "a"
    assert models["other"].worker_id == "b"


def test_live_start_tells_a_restarted_node_from_the_process_before_it() -> None:
    view = ClusterView(TTL)
    assert view.live_start("a", 10.0) is None
    view.observe(hb("a", sent_at=100.0, started_at=50.0), seen_at=10.0)
    assert view.live_start("a", 10.0) == 50.0
    # Restarted within the TTL, the node is never seen gone; only its start changes.
    view.observe(hb("a", sent_at=102.0, started_at=101.5), seen_at=12.0)
    assert view.live_start("a", 12.0) == 101.5
    assert view.live_start("a", 12.0 + TTL + 0.1) is None


def test_stale_after_ttl() -> None:
    view = ClusterView(TTL)
    view.observe(hb("a"), seen_at=10.0)
    assert ids(view.live(10.0 + TTL)) == ["a"]  # exactly at the TTL: still alive
    assert view.live(10.0 + TTL + 0.001) == []
    assert view.routable(10.0 + TTL + 0.001, "m") == []
    assert view.models(10.0 + TTL + 0.001) == {}


def test_newer_heartbeat_refreshes_liveness_and_stats() -> None:
    view = ClusterView(TTL)
    view.observe(hb("a", sent_at=100.0, running=1), seen_at=10.0)
    view.observe(hb("a", sent_at=101.0, running=5), seen_at=12.0)
    [live] = view.live(14.0)
    assert live.stats.running == 5
    assert live.sent_at == 101.0


def test_older_heartbeat_does_not_replace_newer() -> None:
    view = ClusterView(TTL)
    view.observe(hb("a", sent_at=101.0, running=5), seen_at=10.0)
    # A delayed older heartbeat (or an old Redis copy) arrives later: ignored.
    view.observe(hb("a", sent_at=100.0, running=1), seen_at=12.0)
    [live] = view.live(12.0)
    assert live.stats.running == 5
    assert live.sent_at == 101.0
    # ... including for liveness: the entry still dates from seen_at=10.
    assert view.live(10.0 + TTL + 0.5) == []


def test_same_heartbeat_seen_again_keeps_the_later_sighting() -> None:
    view = ClusterView(TTL)
    view.observe(hb("a", sent_at=100.0), seen_at=12.0)
    view.observe(hb("a", sent_at=100.0), seen_at=11.0)  # resync with an older sighting
    assert ids(view.live(12.0 + TTL)) == ["a"]
    view.observe(hb("a", sent_at=100.0), seen_at=14.0)
    assert ids(view.live(14.0 + TTL)) == ["a"]


def test_draining_worker_is_live_but_not_routable_nor_a_model() -> None:
    view = ClusterView(TTL)
    view.observe(hb("a", draining=True), seen_at=10.0)
    view.observe(hb("b"), seen_at=10.0)
    assert ids(view.live(10.0)) == ["a", "b"]
    assert ids(view.routable(10.0, "m")) == ["b"]
    assert view.models(10.0)["m"].worker_id == "b"


def test_only_draining_workers_serve_no_model() -> None:
    view = ClusterView(TTL)
    view.observe(hb("a", draining=True), seen_at=10.0)
    assert view.routable(10.0, "m") == []
    assert view.models(10.0) == {}


def test_worker_becomes_draining_with_a_newer_heartbeat() -> None:
    view = ClusterView(TTL)
    view.observe(hb("a", sent_at=100.0), seen_at=10.0)
    view.observe(hb("a", sent_at=101.0, draining=True), seen_at=11.0)
    assert view.routable(11.0, "m") == []


def test_remove() -> None:
    view = ClusterView(TTL)
    view.observe(hb("a"), seen_at=10.0)
    view.observe(hb("b"), seen_at=10.0)
    view.remove("a")
    view.remove("never-seen")
    assert ids(view.live(10.0)) == ["b"]
    # A removed worker comes back with its next heartbeat.
    view.observe(hb("a", sent_at=100.5), seen_at=11.0)
    assert ids(view.live(11.0)) == ["a", "b"]


def test_prune_returns_and_drops_stale_ids() -> None:
    view = ClusterView(TTL)
    view.observe(hb("old"), seen_at=1.0)
    view.observe(hb("edge"), seen_at=5.0)
    view.observe(hb("fresh"), seen_at=7.0)
    now = 5.0 + TTL  # "edge" is exactly at the TTL: kept
    assert view.prune(now) == ["old"]
    assert ids(view.live(now)) == ["edge", "fresh"]
    assert view.prune(now) == []
    assert sorted(view.prune(100.0)) == ["edge", "fresh"]
    assert view.live(0.0) == []


def test_stale_worker_returns_when_it_heartbeats_again() -> None:
    view = ClusterView(TTL)
    view.observe(hb("a", sent_at=100.0), seen_at=1.0)
    assert view.live(10.0) == []
    view.observe(hb("a", sent_at=109.0), seen_at=10.0)
    assert ids(view.live(10.0)) == ["a"]


def test_the_watcher_hands_each_heartbeat_it_records_to_its_listeners_once_the_view_holds_it() -> None:
    view = ClusterView(TTL)
    watcher = ClusterWatcher(None, None, view, 3600.0, clock=lambda: 10.0)  # type: ignore[arg-type]
    heard: list[tuple[Heartbeat, list[str]]] = []
    watcher.add_heartbeat_listener(lambda heartbeat: heard.append((heartbeat, ids(view.routable(10.0, "m")))))
    sender = HeartbeatSender(full_every=3)
    stored, message = [], []
    for beat in range(2):
        full, wire = sender.beat(hb("a").registration, EngineStats(running=beat), 100.0 + beat, beat, False)
        stored.append(full)
        message.append(wire)
    assert isinstance(message[1], LoadReport)
    watcher.heard(message[1])  # no registration yet: nothing to record, nobody told
    assert heard == []
    for wire in message:
        watcher.heard(wire)
    assert heard == [(stored[0], ["a"]), (stored[1], ["a"])]


def models_of(view: ClusterView, now: float) -> dict[str, str]:
    """What `models` must answer, from `live` alone: per model, the first live non-draining worker (in view order)."""
    found: dict[str, str] = {}
    for heartbeat in view.live(now):
        if not heartbeat.draining:
            found.setdefault(heartbeat.registration.model, heartbeat.registration.worker_id)
    return found


_STEPS = st.lists(st.tuples(
    st.sampled_from(["observe", "observe", "observe", "resync", "remove", "prune", "models"]),
    st.sampled_from(["a", "b", "c", "d"]),
    st.sampled_from(["m", "other"]),
    st.booleans(),
    st.floats(0.0, 2.0),
    st.floats(0.0, TTL),
), max_size=60)


@settings(max_examples=400)
@given(_STEPS)
def test_models_answers_as_if_read_from_live_every_time(steps: list[tuple[str, str, str, bool, float, float]]) -> None:
    # `models` keeps its answer between changes; it must never differ from reading the live nodes afresh.
    view = ClusterView(TTL)
    now = 0.0
    for action, worker_id, model, draining, elapse, age in steps:
        now += elapse
        if action == "observe":
            view.observe(hb(worker_id, sent_at=now, model=model, draining=draining), seen_at=now)
        elif action == "resync":
            # A heartbeat read back from Redis counts as seen when it was stored, `age` ago:
            # it can bring back a node that went stale without moving its last sighting past the TTL.
            view.observe(hb(worker_id, sent_at=now, model=model, draining=draining), seen_at=now - age)
        elif action == "remove":
            view.remove(worker_id)
        elif action == "prune":
            view.prune(now)
        got = {name: registration.worker_id for name, registration in view.models(now).items()}
        assert got == models_of(view, now)


def test_a_node_brought_back_by_a_resync_is_served_again() -> None:
    view = ClusterView(TTL)
    view.observe(hb("a", sent_at=100.0), seen_at=100.0)
    assert view.models(103.5) == {}  # stale: its heartbeats are late on a busy host
    # The resync reads its newest heartbeat from Redis, stored 0.5 s ago: live again.
    view.observe(hb("a", sent_at=103.0), seen_at=103.0)
    assert list(view.models(103.5)) == ["m"] == [h.registration.model for h in view.live(103.5)]
