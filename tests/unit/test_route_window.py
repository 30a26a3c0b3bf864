"""The balancer benchmark's load generator: every request answered once, never more than the window in flight,
one RequestFinished per decision naming the node the decision chose."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from benchmarks.route_window import RouteWindow
from contracts import subjects
from contracts.messages import ErrorReply, RequestFinished, RouteDecision, RouteRequest


class AnsweringConnection:
    """A NATS connection whose balancer answers each route request a loop iteration later, on its reply subject."""

    def __init__(self, refuse: str = "") -> None:
        self._refuse = refuse
        self._callbacks: dict[str, object] = {}
        self.in_flight = 0
        self.most_in_flight = 0
        self.finished: list[RequestFinished] = []

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb):
        assert subject.endswith(".*")
        self._callbacks[subject[:-1]] = cb
        return SimpleNamespace(unsubscribe=self._unsubscribed)

    async def _unsubscribed(self) -> None:
        self._callbacks.clear()

    async def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        if subject == subjects.REQUEST_FINISHED:
            self.finished.append(msgspec.msgpack.decode(payload, type=RequestFinished))
            self.in_flight -= 1
            return
        assert subject == subjects.ROUTE
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        request = msgspec.msgpack.decode(payload, type=RouteRequest)
        answer: RouteDecision | ErrorReply = RouteDecision(
            request_id=request.request_id, worker_id=f"w-{request.request_id}", inbox="inbox", policy="test")
        if request.request_id == self._refuse:
            answer = ErrorReply(code="overloaded", message="no room")
        prefix, _, _ = reply.rpartition(".")
        cb = self._callbacks[prefix + "."]
        asyncio.get_running_loop().call_soon(
            lambda: asyncio.ensure_future(cb(SimpleNamespace(subject=reply, data=msgspec.msgpack.encode(answer)))))

    async def flush(self) -> None:
        pass


def window_over(nc: AnsweringConnection, count: int, window: int) -> RouteWindow:
    requests = [RouteRequest(request_id=f"r{i}", model="m", prompt_tokens=1, max_tokens=1, timeout_s=1.0) for i in range(count)]
    return RouteWindow(nc, [msgspec.msgpack.encode(r) for r in requests], [r.request_id for r in requests], window)


async def test_every_request_finishes_once_on_its_node_within_the_window() -> None:
    nc = AnsweringConnection()
    await window_over(nc, 100, 8).run(timeout_s=5)
    assert sorted((f.request_id, f.worker_id) for f in nc.finished) == sorted((f"r{i}", f"w-r{i}") for i in range(100))
    assert nc.most_in_flight == 8
    assert nc.in_flight == 0


async def test_fewer_requests_than_the_window() -> None:
    nc = AnsweringConnection()
    await window_over(nc, 3, 32).run(timeout_s=5)
    assert len(nc.finished) == 3


async def test_a_refusal_ends_the_run() -> None:
    with pytest.raises(RuntimeError, match="no room"):
        await window_over(AnsweringConnection(refuse="r5"), 20, 4).run(timeout_s=5)
