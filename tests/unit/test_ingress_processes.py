"""Several ingress processes on one port (services/ingress/processes.py) and the batched served events."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest

from contracts import subjects
from contracts.autoscaler import RequestServed
from services.ingress.processes import METRICS_DIR_ENV, hold_port, platform_refusal, prepare_metrics_dir, process_ids
from services.ingress.served_events import ServedEvents


def test_one_process_keeps_its_id_and_several_are_numbered() -> None:
    assert process_ids("i0", 1) == ["i0"]
    assert process_ids("i0", 3) == ["i0-0", "i0-1", "i0-2"]


def test_an_id_too_long_once_numbered_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match="x{63}-0"):
        process_ids("x" * 63, 2)
    assert process_ids("x" * 63, 1) == ["x" * 63]


def test_one_process_runs_anywhere_and_several_only_on_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    assert platform_refusal(1) is None
    monkeypatch.setattr(sys, "platform", "darwin")
    refusal = platform_refusal(2)
    assert refusal is not None and "SO_REUSEPORT" in refusal and "darwin" in refusal
    assert platform_refusal(1) is None
    monkeypatch.setattr(sys, "platform", "linux")
    assert platform_refusal(2) is None


def test_the_metrics_directory_is_made_for_several_processes_only() -> None:
    environ: dict[str, str] = {}
    assert prepare_metrics_dir(1, environ) is None and environ == {}
    made = prepare_metrics_dir(2, environ)
    assert made is not None and made.is_dir() and environ[METRICS_DIR_ENV] == str(made)
    made.rmdir()


def test_a_given_metrics_directory_loses_an_earlier_runs_files_only(tmp_path) -> None:
    (tmp_path / "counter_123.db").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("kept")
    assert prepare_metrics_dir(2, {METRICS_DIR_ENV: str(tmp_path)}) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreads connections on Linux only")
def test_a_held_port_takes_no_connection_and_lets_the_processes_listen_on_it() -> None:
    with hold_port("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        assert port > 0
        with pytest.raises(ConnectionRefusedError):  # held, not listened on
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen()
            for _ in range(20):  # every connection reaches the process that listens
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    listener.accept()[0].close()
        with socket.socket() as stranger, pytest.raises(OSError):  # nobody else takes the port meanwhile
            stranger.bind(("127.0.0.1", port))


class RecordingBus:
    def __init__(self, expected: int) -> None:
        self.published: list[tuple[str, RequestServed]] = []
        self.all_in = asyncio.Event()
        self._expected = expected

    async def publish(self, subject: str, message: RequestServed, *, traced: bool = True) -> None:
        assert not traced
        self.published.append((subject, message))
        if len(self.published) == self._expected:
            self.all_in.set()

    def spawn(self, coro) -> asyncio.Task:
        return asyncio.ensure_future(coro)


def _served(index: int) -> RequestServed:
    return RequestServed(f"r{index}", "m", 0.01, 0.02, 3, 0.005)


async def test_served_events_go_out_together_after_the_interval() -> None:
    bus = RecordingBus(expected=3)
    events = ServedEvents(bus, interval_s=0.05)  # type: ignore[arg-type]
    for index in range(3):
        events.add(_served(index))
    assert bus.published == []  # nothing sent per request
    await asyncio.wait_for(bus.all_in.wait(), 5.0)
    assert bus.published == [(subjects.REQUEST_SERVED, _served(index)) for index in range(3)]


async def test_closing_sends_what_waits_at_once() -> None:
    bus = RecordingBus(expected=2)
    events = ServedEvents(bus, interval_s=3600.0)  # type: ignore[arg-type]
    events.add(_served(0))
    events.add(_served(1))
    await events.close()
    assert [served.request_id for _, served in bus.published] == ["r0", "r1"]
