"""Sending a workload: open loop (sessions start at their arrival times) or closed loop.

Turns of one session are sequential: a conversation's next prompt holds the
answers the client actually received. Sessions run concurrently. The run is
bounded twice: no session starts after `issue_for_s`, and whatever is still
running at `hard_stop_s` is cancelled (and recorded as failed), so a stuck
fleet cannot hold the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from loadtest.bench.client import RequestRecord, StreamingClient
from loadtest.bench.workloads import Session

CANCELLED = "cancelled: the run's time limit passed"


@dataclass(frozen=True)
class DriveLimits:
    issue_for_s: float  # no new session after this (seconds from the run's start)
    hard_stop_s: float  # everything still running then is cancelled
    concurrency: int | None = None  # closed loop with this many clients; None: open loop


def request_body(session: Session, history: list[tuple[str, str]], text: str) -> dict[str, Any]:
    """The JSON body of a session's next turn (model, stream and max_tokens are the client's)."""
    extra = {"priority": session.priority} if session.priority else {}
    if session.api == "completions":
        return {"prompt": text, **extra}
    messages = [{"role": "system", "content": session.system}] if session.system else []
    for question, answer in history:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": text})
    return {"messages": messages, **extra}


class WorkloadDriver:
    def __init__(self, client: StreamingClient, limits: DriveLimits,
                 on_record: Callable[[RequestRecord], None] = lambda record: None) -> None:
        self._client = client
        self._limits = limits
        self._on_record = on_record
        self.records: list[RequestRecord] = []
        self._crashes: list[BaseException] = []

    async def run(self, sessions: Iterable[Session]) -> list[RequestRecord]:
        tasks: set[asyncio.Task] = set()
        try:
            if self._limits.concurrency is None:
                await self._open_loop(iter(sessions), tasks)
            else:
                iterator = iter(sessions)
                for _ in range(self._limits.concurrency):
                    self._track(asyncio.create_task(self._closed_client(iterator)), tasks)
            remaining = self._limits.hard_stop_s - self._client.now()
            if tasks:
                await asyncio.wait(tasks, timeout=max(0.0, remaining))
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)
        if self._crashes:
            # A bug in the benchmark itself must not pass for a slow fleet.
            raise self._crashes[0]
        return self.records

    def _track(self, task: asyncio.Task, tasks: set[asyncio.Task]) -> None:
        tasks.add(task)

        def done(finished: asyncio.Task) -> None:
            # Finished sessions leave the set, so a long run holds only what is in flight.
            tasks.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                self._crashes.append(finished.exception())

        task.add_done_callback(done)

    async def _open_loop(self, sessions: Iterator[Session], tasks: set[asyncio.Task]) -> None:
        for session in sessions:
            if session.arrival_s > self._limits.issue_for_s:
                return
            delay = session.arrival_s - self._client.now()
            if delay > 0:
                await asyncio.sleep(delay)
            self._track(asyncio.create_task(self._session(session, session.arrival_s)), tasks)

    async def _closed_client(self, sessions: Iterator[Session]) -> None:
        while self._client.now() < self._limits.issue_for_s:
            session = next(sessions, None)
            if session is None:
                return
            await self._session(session, self._client.now())

    async def _session(self, session: Session, scheduled_s: float) -> None:
        history: list[tuple[str, str]] = []
        for index, turn in enumerate(session.turns):
            if index:
                if session.think_time_s:
                    await asyncio.sleep(session.think_time_s)
                scheduled_s = self._client.now()
            record = RequestRecord(session.session_id, session.group, index, session.api, turn.max_tokens, scheduled_s,
                                   priority=session.priority, tenant=session.tenant, model=session.adapter)
            self.records.append(record)
            try:
                await self._client.send(record, request_body(session, history, turn.text))
            except asyncio.CancelledError:
                record.error = record.error or CANCELLED
                raise
            finally:
                self._on_record(record)
            if not record.ok:
                return  # without its answer the conversation cannot go on
            history.append((turn.text, record.text))
