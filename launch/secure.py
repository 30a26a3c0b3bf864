"""`kvlane up --secure`: every process its own NATS user and Redis ACL user.

`Security` keeps the credentials (random passwords) of one local fleet, one
account per process: `worker-w0` may publish the heartbeats of w0 only and
hear nothing but w0's inbox, `ingress-i0` hears the streams of i0, and so on
(the table in launch/permissions.py). It writes the nats-server
configuration (users and their subject permissions) and the Redis ACL file
into its directory, files mode 0600, and starts both servers with them.

A process started after the servers (a worker the autoscaler asks for)
gets its account at once: the files are rewritten, nats-server reloads its
configuration (SIGHUP) and Redis gets the new user (`ACL SETUSER`) before
it starts.
Replies travel on explicit inbox grants, not on nats-server's reply
tracking, so a reload costs no request in flight.

NATS or Redis already running at the configured URL is not secured by
kvlane: `--secure` then needs credentials configured for it (`nats.user`
and `nats.password`, a seed or creds file; `redis.password`), which every
service uses.
"""

from __future__ import annotations

import json
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from launch.certs import write_private
from launch.launcher import LaunchError, Launcher, Process, local_port, url_reachable
from launch import permissions
from shared.config import KvlaneConfig

ADMIN_USER = "kvlane-admin"
OPERATOR = "operator"


class SecureError(LaunchError):
    pass


@dataclass(frozen=True)
class Account:
    user: str
    role: permissions.Role
    instance_id: str
    nats_password: str
    redis_password: str

    @property
    def grant(self) -> permissions.Grant:
        return permissions.grant(self.role, self.user, self.instance_id)


def user_name(role: str, instance_id: str = "") -> str:
    return f"{role}-{instance_id}" if instance_id else role


class Security:
    def __init__(self, directory: Path, tls: bool = False) -> None:
        # Absolute: redis-server changes its working directory before it reads the ACL file.
        directory = directory.resolve()
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)
        self.tls = tls
        self.certs = None
        if tls:
            from launch.certs import make_certs  # `cryptography` is needed for --tls only

            self.certs = make_certs(directory / "tls")
        self._accounts: dict[str, Account] = {}
        self._admin_password = secrets.token_urlsafe(32)
        self._written: set[str] | None = None  # the users the running servers know; None: not started
        self.nats_managed = False
        self.redis_managed = False
        self._nats: Process | None = None
        self._redis_admin = None
        self._redis_url = ""
        self.account(OPERATOR)

    @property
    def nats_config(self) -> Path:
        return self.directory / "nats.conf"

    @property
    def redis_config(self) -> Path:
        return self.directory / "redis.conf"

    @property
    def acl_file(self) -> Path:
        return self.directory / "users.acl"

    @property
    def operator_config(self) -> Path:
        """A configuration file with the operator's credentials (`kvlane status --config`, clients of the NATS API)."""
        return self.directory / "operator.toml"

    def account(self, role: str, instance_id: str = "") -> Account:
        """The account of one process (created on first use)."""
        user = user_name(role, instance_id)
        account = self._accounts.get(user)
        if account is None:
            if role not in permissions.ROLES:
                raise SecureError(f"unknown role {role!r}")
            account = Account(user, permissions.ROLES[role], instance_id, secrets.token_urlsafe(24), secrets.token_urlsafe(24))
            account.grant  # noqa: B018 - refuses an id that cannot be a subject token, before anything starts
            self._accounts[user] = account
        return account

    # ---- servers -------------------------------------------------------------------------------------------------

    def start_servers(self, launcher: Launcher, config: KvlaneConfig) -> tuple[list[Process], KvlaneConfig]:
        """Start the servers that do not run yet with this fleet's users; refuse running ones without credentials.

        Returns what was started and the configuration the services get (TLS settings for the servers started).
        """
        nats_running, redis_running = url_reachable(config.nats.servers()[0]), url_reachable(config.redis.url)
        nats, redis_ = config.nats, config.redis
        if nats_running and not (nats.user or nats.nkeys_seed_file or nats.credentials_file):
            raise SecureError(
                f"NATS already runs at {nats.url}, so kvlane cannot secure it: configure its credentials "
                "(nats.user and nats.password, nats.nkeys_seed_file or nats.credentials_file), or point nats.url at a free port"
            )
        if redis_running and not redis_.password:
            raise SecureError(
                f"Redis already runs at {redis_.url}, so kvlane cannot secure it: configure its credentials "
                "(redis.username and redis.password), or point redis.url at a free port"
            )
        self.nats_managed, self.redis_managed = not nats_running, not redis_running
        self._written = set()
        self._write()
        started: list[Process] = []
        client = config
        try:
            if self.nats_managed:
                self._nats = launcher.start_nats(_local_port(nats.servers()[0]), config_file=self.nats_config)
                started.append(self._nats)
                if self.certs is not None:
                    client = _replace(client, "nats", tls_ca=str(self.certs.ca))
            if self.redis_managed:
                started.append(launcher.start_redis(_local_port(redis_.url), config_file=self.redis_config, tls=self.certs is not None))
                if self.certs is not None:
                    url = urlsplit(redis_.url)._replace(scheme="rediss").geturl()
                    client = _replace(client, "redis", url=url, tls_ca=str(self.certs.ca))
                self._redis_url = client.redis.url
        except BaseException:
            for process in started:
                process.stop()
            raise
        self._write_operator_config(client)
        return started, client

    def env(self, role: str, instance_id: str = "") -> dict[str, str]:
        """The KVLANE__* variables that give one process its own credentials (and its id, where the role has one)."""
        account = self.account(role, instance_id)
        self.sync()
        env: dict[str, str] = {}
        if account.role.id_setting:
            env[account.role.id_setting] = json.dumps(instance_id)
        if self.nats_managed:
            env |= {
                "KVLANE__NATS__USER": json.dumps(account.user),
                "KVLANE__NATS__PASSWORD": json.dumps(account.nats_password),
                "KVLANE__NATS__INBOX_PREFIX": json.dumps(account.grant.inbox_prefix),
            }
        if self.redis_managed:
            env |= {"KVLANE__REDIS__USERNAME": json.dumps(account.user), "KVLANE__REDIS__PASSWORD": json.dumps(account.redis_password)}
        return env

    def settings_for(self, config: KvlaneConfig, role: str, instance_id: str = "") -> KvlaneConfig:
        """`config` as one account sees it (for clients in this process, such as the autoscaling actuator)."""
        account = self.account(role, instance_id)
        self.sync()
        if self.nats_managed:
            config = _replace(config, "nats", user=account.user, password=account.nats_password,
                              inbox_prefix=account.grant.inbox_prefix)
        if self.redis_managed:
            config = _replace(config, "redis", username=account.user, password=account.redis_password)
        return config

    def sync(self) -> None:
        """Let the running servers know the accounts added since they started (or last reloaded)."""
        if self._written is None or set(self._accounts) <= self._written:
            return
        added = [account for user, account in self._accounts.items() if user not in self._written]
        self._write()
        if self.nats_managed and self._nats is not None:
            self._reload_nats(self._nats)
        if self.redis_managed:
            # Not `ACL LOAD`: it replaces every user and so drops every client's connection.
            for account in added:
                self._redis_client().execute_command(
                    "ACL", "SETUSER", account.user, *permissions.redis_acl_rules(account.grant, account.redis_password)
                )

    def _reload_nats(self, process: Process, timeout: float = 10.0) -> None:
        before = _count(process.log_path, "Reloaded server configuration")
        process.signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while _count(process.log_path, "Reloaded server configuration") <= before:
            if not process.alive() or time.monotonic() > deadline:
                raise LaunchError(f"nats-server did not reload {self.nats_config}:\n{process.log_tail()}")
            time.sleep(0.02)

    def _redis_client(self):
        if self._redis_admin is None:
            import redis

            from shared.config import RedisSettings
            from shared.credentials import redis_url_and_options

            ca = str(self.certs.ca) if self.certs is not None else ""
            url, options = redis_url_and_options(
                RedisSettings(url=self._redis_url, username=ADMIN_USER, password=self._admin_password, tls_ca=ca)
            )
            self._redis_admin = redis.Redis.from_url(url, **options)
        return self._redis_admin

    # ---- files ---------------------------------------------------------------------------------------------------

    def _write(self) -> None:
        accounts = list(self._accounts.values())
        nats = [
            "# kvlane up --secure: one user per process, subject permissions from launch/permissions.py. Generated.",
            permissions.nats_authorization([permissions.NatsUser(a.grant, password=a.nats_password) for a in accounts]),
        ]
        if self.certs is not None:
            nats.append(f"tls {{cert_file: {json.dumps(str(self.certs.cert))}, key_file: {json.dumps(str(self.certs.key))}, "
                        f"ca_file: {json.dumps(str(self.certs.ca))}, timeout: 2}}\n")
        write_private(self.nats_config, "\n".join(nats).encode())
        acl = [
            # Without credentials nothing: the default user is off.
            "user default off resetkeys resetchannels -@all",
            f"user {ADMIN_USER} on {permissions.redis_password_hash(self._admin_password)} ~* &* +@all",
            *(permissions.redis_acl_line(a.grant, a.redis_password) for a in accounts),
        ]
        write_private(self.acl_file, ("\n".join(acl) + "\n").encode())
        redis_conf = [f"aclfile {self.acl_file}"]
        if self.certs is not None:
            redis_conf += [f"tls-cert-file {self.certs.cert}", f"tls-key-file {self.certs.key}",
                           f"tls-ca-cert-file {self.certs.ca}", "tls-auth-clients optional"]
        write_private(self.redis_config, ("\n".join(redis_conf) + "\n").encode())
        if self._written is not None:
            self._written = set(self._accounts)

    def _write_operator_config(self, config: KvlaneConfig) -> None:
        operator = self.settings_for(config, OPERATOR)
        sections = {"nats": msgspec.to_builtins(operator.nats), "redis": msgspec.to_builtins(operator.redis)}
        lines = ["# The operator's credentials for this fleet (kvlane status --config THIS_FILE). Generated."]
        for section, fields in sections.items():
            lines.append(f"\n[{section}]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in fields.items()]
        write_private(self.operator_config, ("\n".join(lines) + "\n").encode())

    def close(self) -> None:
        if self._redis_admin is not None:
            self._redis_admin.close()
            self._redis_admin = None


def _replace(config: KvlaneConfig, section: str, **fields: object) -> KvlaneConfig:
    return msgspec.structs.replace(config, **{section: msgspec.structs.replace(getattr(config, section), **fields)})


def _local_port(url: str) -> int:
    try:
        return local_port(url)
    except ValueError as exc:
        raise SecureError(str(exc)) from exc


def _count(path: Path, text: str) -> int:
    try:
        return path.read_text(errors="replace").count(text)
    except OSError:
        return 0
