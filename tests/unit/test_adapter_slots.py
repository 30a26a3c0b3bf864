"""LoRA adapters in the sim: `AdapterSlots` (batch slots and host memory, as vLLM keeps them) and the sim scheduler
that runs requests with them (a request waits for a slot; a load lengthens the step that admits it; an adapter's
blocks and tokens are its own). A request for an adapter on a node that serves none is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.sim import SimRequest
from services.worker.sim.adapter_slots import AdapterSlots
from shared.kv.block_hash import adapter_root, chained_block_hashes
from tests.unit.test_sim_scheduler import make_scheduler, run_all

ACTIVATE_S, LOAD_S = 0.25, 2.0


def test_residence_goes_slot_then_host_then_none() -> None:
    slots = AdapterSlots(max_loras=1, max_cpu_loras=2)
    assert slots.start("a") == ("none", [])
    slots.finish("a")
    assert slots.start("a") == ("slot", [])
    slots.finish("a")
    assert slots.start("b") == ("none", [])  # takes a's idle slot; a stays in host memory
    slots.finish("b")
    assert slots.residence("a") == "host" and slots.in_slots() == ["b"] and slots.in_host_only() == ["a"]
    assert slots.start("c") == ("none", ["a"])  # host memory holds two: a, the least recently used, goes
    assert slots.residence("a") == "none"


def test_a_slot_running_requests_is_not_given_up() -> None:
    slots = AdapterSlots(max_loras=1, max_cpu_loras=4)
    slots.start("a")
    assert slots.can_start("a") and not slots.can_start("b")
    with pytest.raises(RuntimeError, match="no slot"):
        slots.start("b")
    slots.finish("a")
    assert slots.can_start("b")


@settings(max_examples=200, deadline=None)
@given(max_loras=st.integers(1, 4), extra_host=st.integers(0, 4),
       events=st.lists(st.tuples(st.booleans(), st.sampled_from("abcdefg")), max_size=60))
def test_slots_and_host_memory_stay_within_their_sizes(max_loras: int, extra_host: int, events: list[tuple[bool, str]]) -> None:
    slots = AdapterSlots(max_loras, max_loras + extra_host)
    running: list[str] = []
    for start, adapter in events:
        if start and slots.can_start(adapter):
            slots.start(adapter)
            running.append(adapter)
        elif not start and adapter in running:
            running.remove(adapter)
            slots.finish(adapter)
        assert len(slots.in_slots()) <= max_loras
        assert len(slots.in_slots()) + len(slots.in_host_only()) <= max_loras + extra_host
        # Every adapter with a running request holds its slot.
        assert set(running) <= set(slots.in_slots()) and slots.running() == {a: running.count(a) for a in set(running)}


def lora_scheduler(max_loras: int = 1, **overrides: object):
    return make_scheduler(adapters=AdapterSlots(max_loras, 4), adapter_activate_s=ACTIVATE_S, adapter_load_s=LOAD_S,
                          record_kv_events=True, **overrides)


def test_a_load_lengthens_the_step_that_admits_the_request() -> None:
    scheduler = lora_scheduler()
    scheduler.add(SimRequest("r1", [1, 2, 3, 4, 5], 2, adapter="a"))
    first = scheduler.step()
    assert first.adapter_loads == 1 and first.adapter_load_s == ACTIVATE_S + LOAD_S
    plain = make_scheduler()
    plain.add(SimRequest("r1", [1, 2, 3, 4, 5], 2))
    assert first.duration_s == pytest.approx(plain.step().duration_s + ACTIVATE_S + LOAD_S)
    run_all(scheduler)
    scheduler.add(SimRequest("r2", [9, 9, 9, 9, 9], 2, adapter="a"))
    assert scheduler.step().adapter_loads == 0  # still in its slot
    stats = scheduler.stats()
    assert (stats.adapters_active, stats.adapter_loads, stats.adapter_fetches, stats.adapter_fetch_seconds) == (
        ["a"], 1, 1, ACTIVATE_S + LOAD_S)


def test_a_request_whose_adapter_finds_no_slot_waits_while_others_go_ahead() -> None:
    scheduler = lora_scheduler(max_loras=1)
    scheduler.add(SimRequest("a1", [1, 2, 3, 4], 4, adapter="a"))
    scheduler.add(SimRequest("b1", [1, 2, 3, 4], 4, adapter="b"))
    scheduler.add(SimRequest("base", [5, 6, 7, 8], 4))
    scheduler.step()
    stats = scheduler.stats()
    assert (stats.running, stats.waiting) == (2, 1)  # a1 and the base request run; b1 waits for a's slot
    assert stats.adapters_running == ["a"]
    emitted, _ = run_all(scheduler)
    assert set(emitted) == {"a1", "b1", "base"}
    stats = scheduler.stats()
    assert (stats.adapters_active, stats.adapters_cached, stats.adapters_running) == (["b"], ["a"], [])
    # b came from storage, as a did: two loads, both fetches.
    assert (stats.adapter_loads, stats.adapter_fetches) == (2, 2)


def test_an_adapter_has_its_own_blocks_and_its_own_tokens() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    scheduler = lora_scheduler(max_loras=2)
    scheduler.add(SimRequest("base", prompt, 6))
    scheduler.add(SimRequest("a", prompt, 6, adapter="a"))
    scheduler.add(SimRequest("b", prompt, 6, adapter="b"))
    emitted, _ = run_all(scheduler)
    assert len({tuple(tokens) for tokens in emitted.values()}) == 3
    stored = {event.block_hash for event in scheduler.drain_kv_events() if event.kind == "stored"}
    assert set(chained_block_hashes(prompt, 4, adapter_root("a"))) <= stored
    assert set(chained_block_hashes(prompt, 4)) <= stored
    # The same adapter and prompt again: a prefix hit, tokens as before.
    scheduler.add(SimRequest("a-again", prompt, 6, adapter="a"))
    again, outcomes = run_all(scheduler)
    finished = [info for outcome in outcomes for info in outcome.finished_info]
    assert again["a-again"] == emitted["a"] and finished[0].cached_prompt_tokens == 8


def test_an_adapter_request_on_a_node_without_adapters_is_refused() -> None:
    with pytest.raises(ValueError, match="serves no LoRA adapter"):
        make_scheduler().add(SimRequest("r", [1, 2, 3], 2, adapter="a"))
