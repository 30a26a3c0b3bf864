"""`free_port`: ports a service can still bind when it starts, and never one an outgoing connection may take."""

from __future__ import annotations

import socket

import pytest

from launch import launcher
from launch.launcher import _lowest_ephemeral_port, free_port


def test_ports_lie_below_the_ephemeral_range_are_free_and_are_not_handed_out_twice() -> None:
    low = _lowest_ephemeral_port()
    handed = [free_port() for _ in range(50)]
    assert len(set(handed)) == 50
    assert all(port < low for port in handed)
    first = free_port(count=3)
    assert not {first, first + 1, first + 2} & set(handed)
    for port in (*handed[:5], first, first + 1, first + 2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if anything held it


def test_a_port_something_holds_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            spare = probe.getsockname()[1]
        # The first draw is the held port: it must be passed over for the next one.
        draws = iter([taken, spare])
        monkeypatch.setattr(launcher.random, "randrange", lambda start, stop: next(draws))
        monkeypatch.setattr(launcher, "_lowest_ephemeral_port", lambda: 65_000)
        assert free_port() == spare
