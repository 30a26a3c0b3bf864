"""Heartbeats without the registration between full ones (shared/heartbeats.py) and their assembly (ClusterView.assemble)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.messages import EngineStats, Heartbeat, HeartbeatMessage, LoadReport, StepTime, WorkerRegistration
from shared.cluster import ClusterView
from shared.heartbeats import HeartbeatSender, registration_digest

TTL = 3.0


def registration(worker_id: str = "w0", max_num_seqs: int = 64, model: str = "m") -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, role="aggregated", model=model, engine="sim", inbox=f"kvlane.v1.worker.{worker_id}.generate",
                              block_size=16, max_model_len=4096, tokenizer="sim", started_at=1.0, host="h:1",
                              max_num_seqs=max_num_seqs, step_time=StepTime(a=0.01, b=1e-5, c=1e-4))


def beat(sender: HeartbeatSender, reg: WorkerRegistration, seq: int, running: int = 0, draining: bool = False) -> tuple[Heartbeat, HeartbeatMessage]:
    return sender.beat(reg, EngineStats(running=running, kv_blocks_total=100), 100.0 + seq, seq, draining)


def receive(view: ClusterView, message: HeartbeatMessage, at: float) -> Heartbeat | None:
    heartbeat = view.assemble(message)
    if heartbeat is not None:
        view.observe(heartbeat, at)
    return heartbeat


def test_first_beat_is_full_then_load_reports_until_every_nth() -> None:
    sender = HeartbeatSender(full_every=3)
    kinds = [type(beat(sender, registration(), seq)[1]).__name__ for seq in range(1, 8)]
    assert kinds == ["Heartbeat", "LoadReport", "LoadReport", "Heartbeat", "LoadReport", "LoadReport", "Heartbeat"]


def test_full_every_one_sends_every_heartbeat_whole() -> None:
    sender = HeartbeatSender(full_every=1)
    assert all(isinstance(beat(sender, registration(), seq)[1], Heartbeat) for seq in range(1, 6))


def test_full_every_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        HeartbeatSender(full_every=0)


def test_redis_always_gets_the_full_heartbeat() -> None:
    sender = HeartbeatSender(full_every=10)
    for seq in range(1, 5):
        full, _ = beat(sender, registration(), seq, running=seq)
        assert full.registration == registration() and full.stats.running == seq
        assert full.registration_digest == registration_digest(registration())


def test_a_load_report_is_much_smaller_than_a_full_heartbeat() -> None:
    sender = HeartbeatSender(full_every=10)
    full, _ = beat(sender, registration(), 1, running=3)
    _, load = beat(sender, registration(), 2, running=3)
    assert isinstance(load, LoadReport)
    assert len(msgspec.msgpack.encode(load)) * 3 < len(msgspec.msgpack.encode(full))


def test_a_changed_registration_goes_out_at_once_and_replaces_the_old_one() -> None:
    sender, view = HeartbeatSender(full_every=100), ClusterView(TTL)
    for seq in range(1, 4):
        receive(view, beat(sender, registration(), seq)[1], seq)
    changed = registration(max_num_seqs=8)
    _, on_wire = beat(sender, changed, 4)
    assert isinstance(on_wire, Heartbeat)
    receive(view, on_wire, 4)
    assembled = receive(view, beat(sender, changed, 5, running=2)[1], 5)
    assert assembled is not None and assembled.registration.max_num_seqs == 8 and assembled.stats.running == 2


def test_a_receiver_that_missed_a_change_joins_no_report_to_the_old_registration() -> None:
    sender, view = HeartbeatSender(full_every=4), ClusterView(TTL)
    receive(view, beat(sender, registration(), 1)[1], 1)
    beat(sender, registration(model="other"), 2)  # the full heartbeat of the change is lost
    _, report = beat(sender, registration(model="other"), 3)
    assert isinstance(report, LoadReport)
    assert receive(view, report, 3) is None
    assert view.unmatched_load_reports == 1
    assert view.live(3)[0].registration.model == "m"  # still the last one it knew, from before
    assert [receive(view, beat(sender, registration(model="other"), seq)[1], seq) for seq in (4, 5)] == [None, None]
    _, full = beat(sender, registration(model="other"), 6)  # the periodic full heartbeat, 4 after the change
    assert isinstance(full, Heartbeat)
    assert receive(view, full, 6).registration.model == "other"


def test_a_receiver_that_starts_late_learns_the_registration_from_the_next_full_heartbeat() -> None:
    sender, view = HeartbeatSender(full_every=5), ClusterView(TTL)
    beat(sender, registration(), 1)  # sent before the receiver listened
    assembled = [receive(view, beat(sender, registration(), seq, running=seq)[1], seq) for seq in range(2, 9)]
    # seq 2-5: load reports of a registration it does not hold; seq 6 is full; 7, 8 join it.
    assert assembled[:4] == [None] * 4
    assert [hb.seq for hb in assembled[4:]] == [6, 7, 8]
    assert assembled[-1].registration == registration() and assembled[-1].stats.running == 8


def test_a_receiver_that_starts_late_learns_the_registration_from_redis() -> None:
    sender, view = HeartbeatSender(full_every=100), ClusterView(TTL)
    full, _ = beat(sender, registration(), 1)
    view.observe(full, 1.0)  # what a resync reads from the node's key
    _, report = beat(sender, registration(), 2, running=5, draining=True)
    assembled = receive(view, report, 2.0)
    assert assembled is not None and assembled.stats.running == 5 and assembled.draining and assembled.seq == 2


def test_a_restarted_worker_with_the_same_id_is_not_mistaken_for_the_old_one() -> None:
    view = ClusterView(TTL)
    receive(view, beat(HeartbeatSender(5), registration(), 1)[1], 1)
    restarted = msgspec.structs.replace(registration(), started_at=50.0)
    sender = HeartbeatSender(5)
    beat(sender, restarted, 1)  # its first, full heartbeat is lost
    assert receive(view, beat(sender, restarted, 2)[1], 2) is None


def test_a_pruned_node_needs_a_full_heartbeat_again() -> None:
    sender, view = HeartbeatSender(full_every=10), ClusterView(TTL)
    receive(view, beat(sender, registration(), 1)[1], 1.0)
    view.prune(1.0 + TTL + 1)
    assert receive(view, beat(sender, registration(), 2)[1], 5.0) is None


# --- property: whatever the receiver misses, what it assembles is exactly what was sent ---------------------------------

registrations = st.sampled_from([registration(), registration(max_num_seqs=8), registration(model="other")])


@settings(max_examples=200, deadline=None)
@given(
    full_every=st.integers(min_value=1, max_value=6),
    beats=st.lists(st.tuples(registrations, st.integers(0, 9), st.booleans()), min_size=1, max_size=40),
)
def test_every_assembled_heartbeat_equals_the_one_the_worker_stored(full_every: int, beats: list) -> None:
    sender, view = HeartbeatSender(full_every), ClusterView(TTL)
    delivered_full_since_change = False
    last_registration = None
    for seq, (reg, running, delivered) in enumerate(beats, start=1):
        full, on_wire = beat(sender, reg, seq, running=running)
        if reg != last_registration:
            delivered_full_since_change = False
            last_registration = reg
        if not delivered:
            continue
        assembled = receive(view, on_wire, float(seq) * 0.01)
        if isinstance(on_wire, Heartbeat):
            delivered_full_since_change = True
        if assembled is not None:
            # Never a stale registration joined to new load, never a changed stat lost.
            assert assembled == full
        else:
            assert isinstance(on_wire, LoadReport) and not delivered_full_since_change
