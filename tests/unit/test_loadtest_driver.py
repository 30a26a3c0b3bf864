"""The bench's load driver (loadtest/bench/driver.py) against a fake client: no fleet, no sockets."""

from __future__ import annotations

import asyncio
import time

from loadtest.bench.client import RequestRecord
from loadtest.bench.driver import CANCELLED, DriveLimits, WorkloadDriver
from loadtest.bench.workloads import Session, Turn


class FakeClient:
    """Answers every request after `latency_s` with `answer`, remembering the bodies it got."""

    def __init__(self, latency_s: float, answer: str = " baba") -> None:
        self._origin = time.perf_counter()
        self._latency_s = latency_s
        self._answer = answer
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    def now(self) -> float:
        return time.perf_counter() - self._origin

    async def send(self, record: RequestRecord, body: dict) -> RequestRecord:
        self.bodies.append(body)
        record.sent_s = self.now()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self._latency_s)
        finally:
            self.in_flight -= 1
        record.first_token_s = record.end_s = self.now()
        record.token_times_s = [record.end_s]
        record.status, record.completion_tokens, record.text = 200, 1, self._answer
        return record


def _single(index: int, arrival_s: float) -> Session:
    return Session(f"s{index}", "g", arrival_s, (Turn(" hello", 1, 1),))


async def test_open_loop_sends_at_arrival_times_whatever_the_latency() -> None:
    client = FakeClient(latency_s=0.2)
    sessions = [_single(i, 0.02 * i) for i in range(5)]
    records = await WorkloadDriver(client, DriveLimits(issue_for_s=5, hard_stop_s=5)).run(sessions)
    assert [r.session_id for r in sorted(records, key=lambda r: r.sent_s)] == ["s0", "s1", "s2", "s3", "s4"]
    assert all(abs(r.sent_s - r.scheduled_s) < 0.05 for r in records)
    assert client.max_in_flight == 5  # open loop: arrivals do not wait for answers


async def test_closed_loop_keeps_concurrency_requests_in_flight() -> None:
    client = FakeClient(latency_s=0.01)
    records = await WorkloadDriver(client, DriveLimits(issue_for_s=5, hard_stop_s=5, concurrency=3)).run(
        [_single(i, 0.0) for i in range(12)])
    assert len(records) == 12 and all(r.ok for r in records)
    assert client.max_in_flight == 3


async def test_conversation_turns_are_sequential_and_carry_the_answers() -> None:
    client = FakeClient(latency_s=0.01, answer=" zaza")
    conversation = Session("c0", "c0", 0.0, (Turn(" one", 4, 1), Turn(" two", 4, 1)), api="chat", system=" sys")
    records = await WorkloadDriver(client, DriveLimits(issue_for_s=5, hard_stop_s=5)).run([conversation])
    assert [r.turn for r in records] == [0, 1]
    assert records[1].sent_s >= records[0].end_s
    assert client.bodies[1]["messages"] == [
        {"role": "system", "content": " sys"}, {"role": "user", "content": " one"},
        {"role": "assistant", "content": " zaza"}, {"role": "user", "content": " two"},
    ]


async def test_hard_stop_cancels_and_records_what_was_in_flight() -> None:
    client = FakeClient(latency_s=10.0)
    started = time.perf_counter()
    records = await WorkloadDriver(client, DriveLimits(issue_for_s=0.1, hard_stop_s=0.3)).run(
        [_single(0, 0.0), _single(1, 0.05), _single(2, 1.0)])
    assert time.perf_counter() - started < 2.0
    assert [r.session_id for r in records] == ["s0", "s1"]  # s2 arrives after issue_for_s
    assert all(r.error == CANCELLED and not r.ok for r in records)


async def test_a_bug_in_a_session_is_raised_not_hidden() -> None:
    class BrokenClient(FakeClient):
        async def send(self, record: RequestRecord, body: dict) -> RequestRecord:
            raise RuntimeError("bug")

    try:
        await WorkloadDriver(BrokenClient(0.0), DriveLimits(issue_for_s=1, hard_stop_s=1)).run([_single(0, 0.0)])
    except RuntimeError as exc:
        assert str(exc) == "bug"
    else:
        raise AssertionError("the driver swallowed a crash")
