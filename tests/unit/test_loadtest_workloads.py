"""Bench workloads (loadtest/bench/workloads.py): deterministic, exact token lengths, real sharing."""

from __future__ import annotations

import json
import statistics

import pytest

from loadtest.bench.driver import request_body
from loadtest.bench.workloads import (
    TRACE_BLOCK_TOKENS,
    ArrivalSpec,
    TextMaker,
    WorkloadSpec,
    sessions,
)
from shared.tokenizer import SimTokenizer

TOKENIZER = SimTokenizer()


def _tokens(text: str) -> list[int]:
    return TOKENIZER.encode(text)


@pytest.mark.parametrize("count", [1, 2, 17, 512, 4000])
def test_text_maker_gives_exactly_n_output_vocabulary_tokens(count: int) -> None:
    ids = _tokens(TextMaker().text(count, f"key-{count}"))
    assert len(ids) == count
    first, end = TOKENIZER.output_token_range
    assert all(first <= i < end for i in ids)


def test_text_maker_is_a_function_of_its_key() -> None:
    maker = TextMaker()
    assert maker.text(64, "a") == TextMaker().text(64, "a")
    assert maker.text(64, "a") != maker.text(64, "b")
    assert maker.text(100, "a").startswith(maker.text(10, "a"))


@pytest.mark.parametrize("kind", ["shared-prefix", "multi-turn", "long-context", "sharegpt"])
def test_same_seed_same_sessions_other_seed_other_sessions(kind: str) -> None:
    spec = WorkloadSpec(kind=kind, seed=7, max_requests=40, arrival=ArrivalSpec("gamma", rate=5.0, cv=2.0),
                        max_model_len=32768, system_tokens=128)
    first, again = list(sessions(spec)), list(sessions(spec))
    assert first == again
    other = list(sessions(WorkloadSpec(**{**spec.__dict__, "seed": 8})))
    assert [t.text for s in other for t in s.turns] != [t.text for s in first for t in s.turns]
    assert sum(s.requests for s in first) == 40


def test_shared_prefix_groups_share_their_system_prompt_token_for_token() -> None:
    spec = WorkloadSpec(kind="shared-prefix", groups=3, system_tokens=256, question_tokens=32, output_tokens=8,
                        max_requests=60)
    by_group: dict[str, set[str]] = {}
    for session in sessions(spec):
        assert session.api == "chat"
        assert len(_tokens(session.system)) == 256
        assert session.turns[0].text_tokens == len(_tokens(session.turns[0].text)) == 32
        assert session.turns[0].max_tokens == 8
        by_group.setdefault(session.group, set()).add(session.system)
    assert len(by_group) == 3
    assert all(len(systems) == 1 for systems in by_group.values())
    assert len({next(iter(systems)) for systems in by_group.values()}) == 3
    # Rendered through the chat template, two requests of a group share the whole system part.
    group_sessions = [s for s in sessions(spec) if s.group == "g0"][:2]
    prompts = [_tokens(_render(s, [], s.turns[0].text)) for s in group_sessions]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert shared >= 256


def _render(session, history, text) -> str:
    from contracts.openai_api import ChatMessage

    messages = [ChatMessage(role=m["role"], content=m["content"]) for m in request_body(session, history, text)["messages"]]
    return TOKENIZER.apply_chat_template(messages)


def test_multi_turn_history_grows_with_the_received_answers() -> None:
    spec = WorkloadSpec(kind="multi-turn", turns=3, system_tokens=64, question_tokens=16, output_tokens=8,
                        max_requests=6)
    conversations = list(sessions(spec))
    assert [c.requests for c in conversations] == [3, 3]
    conversation = conversations[0]
    answers = [" baba bebe", " caca"]
    history = [(conversation.turns[0].text, answers[0]), (conversation.turns[1].text, answers[1])]
    body = request_body(conversation, history, conversation.turns[2].text)
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert body["messages"][2]["content"] == answers[0]
    # Each turn's prompt extends the previous one: a prefix cache can reuse it.
    earlier = _tokens(_render(conversation, history[:1], conversation.turns[1].text))
    later = _tokens(_render(conversation, history, conversation.turns[2].text))
    assert later[: len(earlier) - 3] == earlier[:-3]  # all but the generation prompt "<|assistant|>\n"


def test_max_requests_cuts_the_last_conversation() -> None:
    spec = WorkloadSpec(kind="multi-turn", turns=4, system_tokens=16, question_tokens=8, output_tokens=4, max_requests=6)
    assert [c.requests for c in sessions(spec)] == [4, 2]


def test_long_context_mix_has_a_long_share_clamped_to_the_context() -> None:
    spec = WorkloadSpec(kind="long-context", max_requests=400, long_share=0.1, max_model_len=65536)
    made = list(sessions(spec))
    long = [s for s in made if s.group == "long"]
    assert 20 <= len(long) <= 60
    for session in long:
        turn = session.turns[0]
        assert 16_384 <= turn.text_tokens
        assert turn.text_tokens + turn.max_tokens <= 65536
    assert len(_tokens(long[0].turns[0].text)) == long[0].turns[0].text_tokens


def test_sharegpt_lengths_have_the_documented_means_roughly() -> None:
    made = list(sessions(WorkloadSpec(kind="sharegpt", max_requests=3000, max_model_len=8192)))
    inputs = [s.turns[0].text_tokens for s in made]
    outputs = [s.turns[0].max_tokens for s in made]
    assert 240 <= statistics.mean(inputs) <= 360
    assert 170 <= statistics.mean(outputs) <= 230
    assert min(inputs) >= 4 and min(outputs) >= 1
    assert len(_tokens(made[0].turns[0].text)) == inputs[0]


@pytest.mark.parametrize(("mode", "cv"), [("poisson", 1.0), ("gamma", 3.0), ("gamma", 0.5)])
def test_arrivals_have_the_rate_and_burstiness_asked_for(mode: str, cv: float) -> None:
    offsets = ArrivalSpec(mode, rate=20.0, cv=cv).offsets(seed=1)
    times = [next(offsets) for _ in range(20001)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.1)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0 if mode == "poisson" else cv, rel=0.15)


def test_duration_stops_open_loop_sessions() -> None:
    spec = WorkloadSpec(kind="sharegpt", max_requests=10_000, duration_s=2.0, arrival=ArrivalSpec(rate=50.0))
    made = list(sessions(spec))
    assert 60 <= len(made) <= 140
    assert all(s.arrival_s <= 2.0 for s in made)


def _write_trace(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_trace_replay_equal_hash_ids_are_identical_512_token_blocks(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace, [
        {"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 1024, "output_length": 20, "hash_ids": [1, 2]},
        {"timestamp": 3000, "input_length": 700, "output_length": 5, "hash_ids": [9, 2]},
    ])
    made = list(sessions(WorkloadSpec(kind="trace", trace_path=trace, max_requests=10, max_model_len=8192)))
    assert [s.arrival_s for s in made] == [0.0, 0.5, 2.0]
    assert [s.turns[0].max_tokens for s in made] == [10, 20, 5]
    ids = [_tokens(s.turns[0].text) for s in made]
    assert [len(i) for i in ids] == [1200, 1024, 700]
    block = TRACE_BLOCK_TOKENS
    assert ids[0][: 2 * block] == ids[1]  # hash ids 1, 2 shared
    assert ids[2][block:] == ids[0][block : block + (700 - block)]  # block 2, cut short, is block 2's start
    assert ids[2][:block] != ids[0][:block]  # hash 9 is not hash 1


def test_trace_time_scale_and_clamping(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace, [
        {"timestamp": 0, "input_length": 9000, "output_length": 4000, "hash_ids": list(range(18))},
        {"timestamp": 2000, "input_length": 10, "output_length": 1, "hash_ids": [0]},
    ])
    made = list(sessions(WorkloadSpec(kind="trace", trace_path=trace, max_requests=10, max_model_len=4096,
                                      trace_time_scale=0.25)))
    assert [s.arrival_s for s in made] == [0.0, 0.5]
    first = made[0].turns[0]
    assert first.text_tokens + first.max_tokens <= 4096
    assert len(_tokens(first.text)) == first.text_tokens


def test_trace_needs_a_file_and_bad_lines_are_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="trace file"):
        list(sessions(WorkloadSpec(kind="trace")))
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(sessions(WorkloadSpec(kind="trace", trace_path=trace)))


def test_duration_cuts_a_trace_replayed_on_its_timestamps(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace, [{"timestamp": 1000 * i, "input_length": 8, "output_length": 2, "hash_ids": [i]}
                         for i in range(10)])
    spec = WorkloadSpec(kind="trace", trace_path=trace, max_requests=100, duration_s=3.5,
                        arrival=ArrivalSpec(mode="closed"))
    assert [s.arrival_s for s in sessions(spec)] == [0.0, 1.0, 2.0, 3.0]
