"""How many slots a chain gets: KV room for the requests actually routed, capped by the engine's batch limit."""

from __future__ import annotations

import msgspec

from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, request, router


def test_slots_stop_at_the_engines_batch_limit() -> None:
    r = router("jffc")
    hb = heartbeat("a", blocks=64 * 100)  # KV for 100 typical requests
    assert r.builder.facts(hb).slots_total == 100
    limited = msgspec.structs.replace(hb, registration=msgspec.structs.replace(hb.registration, max_num_seqs=16), sent_at=hb.sent_at + 1)
    assert r.builder.facts(limited).slots_total == 16
    capped = router("jffc", max_per_chain=8)
    assert capped.builder.facts(limited).slots_total == 8


def test_slots_follow_the_size_of_the_requests_routed() -> None:
    r = router("jffc")
    hb = heartbeat("a", blocks=4096)  # 65k tokens of KV
    assert r.builder.facts(hb).slots_total == 64  # typical 768 + 256 tokens
    placements = []
    for i in range(400):
        placement = r.place(request(f"r{i}", prompt=2048, output=32, blocks=128), [hb], NOW_WALL + 60)
        if placement is None:
            break
        placements.append(placement)
        r.table.release(placement.request_id)
    later = msgspec.structs.replace(hb, sent_at=hb.sent_at + 1)
    # 2080-token requests: 130 blocks each, so 4096 blocks hold 31 of them, not 64.
    assert r.builder.facts(later).slots_total == 31
    fixed = router("jffc", learn_request_size=False)
    for i in range(50):
        placement = fixed.place(request(f"r{i}", prompt=2048, output=32, blocks=128), [hb], NOW_WALL + 60)
        fixed.table.release(placement.request_id)  # type: ignore[union-attr]
    assert fixed.builder.facts(later).slots_total == 64
