"""`kvlane up --secure` without servers: accounts, environments, files, refusals (launch/secure.py)."""

from __future__ import annotations

import json
import socket
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.launcher import Launcher
from launch.secure import SecureError, Security
from shared.config import KvlaneConfig, NatsSettings, RedisSettings, load_config


@pytest.fixture
def listening() -> Iterator[list[int]]:
    """Two ports something listens on, as a NATS and a Redis already running would."""
    sockets = []
    for _ in range(2):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sockets.append(sock)
    yield [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()


def config_at(nats_port: int, redis_port: int, **credentials: dict) -> KvlaneConfig:
    return KvlaneConfig(
        nats=NatsSettings(url=f"nats://127.0.0.1:{nats_port}", **credentials.get("nats", {})),
        redis=RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0", **credentials.get("redis", {})),
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_running_servers_without_credentials_are_refused(tmp_path: Path, listening: list[int]) -> None:
    security = Security(tmp_path / "secure")
    with pytest.raises(SecureError, match="NATS already runs"):
        security.start_servers(Launcher(tmp_path / "logs"), config_at(*listening))
    with pytest.raises(SecureError, match="Redis already runs"):
        security.start_servers(Launcher(tmp_path / "logs"), config_at(*listening, nats={"user": "u", "password": "p"}))


def test_running_servers_with_credentials_are_used_as_configured(tmp_path: Path, listening: list[int]) -> None:
    security = Security(tmp_path / "secure")
    config = config_at(*listening, nats={"user": "u", "password": "p"}, redis={"password": "r"})
    started, client_config = security.start_servers(Launcher(tmp_path / "logs"), config)
    assert started == [] and client_config == config
    # Nothing overrides the configured credentials; the process still gets its id.
    assert security.env("worker", "w0") == {"KVLANE__WORKER__WORKER_ID": '"w0"'}


def test_each_process_gets_its_own_user_password_and_inbox(tmp_path: Path) -> None:
    security = Security(tmp_path / "secure")
    security.nats_managed = security.redis_managed = True
    w0, w1 = security.env("worker", "w0"), security.env("worker", "w1")
    assert json.loads(w0["KVLANE__NATS__USER"]) == "worker-w0"
    assert json.loads(w0["KVLANE__NATS__INBOX_PREFIX"]) == "_INBOX.worker.worker-w0"
    assert json.loads(w0["KVLANE__REDIS__USERNAME"]) == "worker-w0"
    assert w0["KVLANE__NATS__PASSWORD"] != w1["KVLANE__NATS__PASSWORD"]
    assert w0["KVLANE__NATS__PASSWORD"] != w0["KVLANE__REDIS__PASSWORD"]
    assert security.env("worker", "w0") == w0  # one account per process, however often asked
    # The environment is what a service reads.
    config = load_config(env=security.env("ingress", "i0"))
    assert (config.ingress.ingress_id, config.nats.user, config.redis.username) == ("i0", "ingress-i0", "ingress-i0")
    with pytest.raises(ValueError, match="token"):
        security.env("worker", "bad.id")


def test_files_are_private_and_hold_every_account(tmp_path: Path) -> None:
    security = Security(tmp_path / "secure")
    security.nats_managed = security.redis_managed = True
    security.env("worker", "w0")
    security._written = set()
    security._write()
    security._write_operator_config(KvlaneConfig())
    assert mode(security.directory) == 0o700
    for path in (security.nats_config, security.acl_file, security.redis_config, security.operator_config):
        assert mode(path) == 0o600, path
    acl = security.acl_file.read_text()
    assert "user default off" in acl and "user worker-w0 on #" in acl
    password = security.account("worker", "w0").redis_password
    assert password not in acl
    assert 'user: "worker-w0"' in security.nats_config.read_text()
    operator = tomllib.loads(security.operator_config.read_text())
    assert operator["nats"]["user"] == "operator" and operator["redis"]["username"] == "operator"
    # The operator file is a configuration kvlane itself reads.
    assert load_config(security.operator_config).nats.inbox_prefix == "_INBOX.operator.operator"


def test_tls_makes_a_ca_and_names_it_in_the_server_configurations(tmp_path: Path) -> None:
    security = Security(tmp_path / "secure", tls=True)
    security._written = set()
    security._write()
    assert security.certs is not None and security.certs.ca.exists()
    assert mode(security.certs.key) == 0o600
    assert str(security.certs.cert) in security.nats_config.read_text()
    assert f"tls-ca-cert-file {security.certs.ca}" in security.redis_config.read_text()


def test_kvlane_up_refuses_tls_without_secure(tmp_path: Path) -> None:
    from rich.console import Console

    from kvlane.cli import _up, build_parser

    console = Console(record=True, width=200)
    args = build_parser().parse_args(["up", "--tls", "--log-dir", str(tmp_path / "logs")])
    assert _up(args, console) == 2
    assert "--tls applies to --secure only" in console.export_text()
    assert build_parser().parse_args(["up", "--secure", "--tls"]).secure
