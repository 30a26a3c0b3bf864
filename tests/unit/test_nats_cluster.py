"""The flags of a local NATS cluster (launch/nats_cluster.py) and `kvlane up --nats-cluster`'s checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from kvlane.cli import _up, build_parser
from launch.nats_cluster import NatsNode, server_args


def nodes_of(count: int) -> list[NatsNode]:
    return [NatsNode(f"nats-{i}", 4000 + i, 5000 + i, 6000 + i) for i in range(count)]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@given(st.integers(2, 7))
def test_each_server_routes_to_every_other_one_and_keeps_its_own_store(count: int) -> None:
    nodes = nodes_of(count)
    store = Path("/store")
    all_args = [server_args(node, nodes, store) for node in nodes]
    for node, args in zip(nodes, all_args, strict=True):
        routes = set(flag(args, "--routes").split(","))
        assert routes == {f"nats://127.0.0.1:{other.cluster_port}" for other in nodes if other is not node}
        assert flag(args, "--cluster") == f"nats://127.0.0.1:{node.cluster_port}"
        assert flag(args, "-m") == str(node.monitor_port)
        assert "-js" in args
    # JetStream needs distinct server names in one cluster, and each server a store directory of its own.
    assert len({flag(args, "--server_name") for args in all_args}) == count
    assert len({flag(args, "-sd") for args in all_args}) == count
    assert len({flag(args, "--cluster_name") for args in all_args}) == 1


def test_a_single_server_has_no_routes() -> None:
    [node] = nodes_of(1)
    args = server_args(node, [node], Path("/store"))
    assert "--routes" not in args and "--cluster" not in args and "-js" in args


@pytest.mark.parametrize("flags", [["--nats-cluster", "0"], ["--nats-cluster", "3", "--secure"]])
def test_kvlane_up_refuses_a_cluster_it_cannot_start_before_starting_anything(
    flags: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVLANE_CONFIG", raising=False)
    console = Console(record=True, width=200)
    assert _up(build_parser().parse_args(["up", "--log-dir", str(tmp_path / "logs"), *flags]), console) == 2
    assert "--nats-cluster" in console.export_text()
    assert not (tmp_path / "logs").exists()
