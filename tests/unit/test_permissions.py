"""The permission table (launch/permissions.py), the client options built from the settings
(shared/credentials.py), and the docs that must show the table as it is."""

from __future__ import annotations

import re
import ssl
import subprocess
from pathlib import Path

import pytest

from contracts import subjects
from launch.launcher import LaunchError, find_nats_server
from services.balancer import slot_store
from launch import permissions
from services.ingress import key_limits
from shared.kv import block_ledger
from shared.config import NatsSettings, RedisSettings, load_config
from shared.credentials import nats_options, redis_url_and_options
from launch.permissions import ROLES, grant, may_publish, may_subscribe, subject_matches

DOCS = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def worker(worker_id: str = "w0", role: str = "worker") -> permissions.Grant:
    return grant(ROLES[role], f"{role}-{worker_id}", worker_id)


# --- matching ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("a.b", "a.b", True),
        ("a.*", "a.b", True),
        ("a.*", "a.b.c", False),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.b.d", False),
        # A wildcard subscription lies within a pattern only if every subject it matches does.
        ("a.*", "a.*", True),
        ("a.b", "a.*", False),
        ("a.>", "a.*.c", True),
        ("a.*", "a.>", False),
    ],
)
def test_subject_matching(pattern: str, subject: str, matches: bool) -> None:
    assert subject_matches(pattern, subject) is matches


# --- what each role may do ------------------------------------------------------------


def test_a_worker_may_publish_only_its_own_heartbeats_and_kv_events() -> None:
    w0 = worker("w0")
    assert may_publish(w0, subjects.heartbeat("w0"))
    assert may_publish(w0, subjects.kv_events("w0"))
    assert not may_publish(w0, subjects.heartbeat("w1"))
    assert not may_publish(w0, subjects.kv_events("w1"))


def test_a_worker_may_not_route_abort_others_or_speak_for_services() -> None:
    w0 = worker("w0")
    for subject in (subjects.ROUTE, subjects.worker_inbox("w1"), subjects.health("w0"), subjects.FEEDBACK,
                    subjects.CACHE_REQUEST, subjects.AUTOSCALER_DECISION, subjects.API_CHAT_COMPLETIONS):
        assert not may_publish(w0, subject), subject


def test_a_worker_hears_its_own_inbox_only() -> None:
    w0 = worker("w0")
    assert may_subscribe(w0, subjects.worker_inbox("w0"))
    for subject in (subjects.worker_inbox("w1"), subjects.worker_inbox("*"), subjects.ROUTE, subjects.HEARTBEAT_ALL,
                    subjects.stream_inbox("i0"), "_INBOX.>", "_INBOX.ingress.>", ">"):
        assert not may_subscribe(w0, subject), subject


def test_only_balancers_answer_routes_and_only_ingresses_ask() -> None:
    for name, role in ROLES.items():
        g = grant(role, f"{name}-x", "x")
        assert may_subscribe(g, subjects.ROUTE) is (name == "balancer"), name
        assert may_publish(g, subjects.ROUTE) is (name == "ingress"), name


def test_worker_inboxes_take_requests_from_the_roles_that_send_them_only() -> None:
    senders = {name for name, role in ROLES.items() if may_publish(grant(role, f"{name}-x", "x"), subjects.worker_inbox("w9"))}
    # Ingress (requests, aborts), balancer (requests it hands over, aborts of withdrawn ones), cache-manager
    # (preemption, pre-warming), health-prober (probes), prefill workers (the hand-off to a decode worker).
    assert senders == {"ingress", "balancer", "cache-manager", "health-prober", "prefill-worker"}


def test_streams_are_heard_by_their_owner_only() -> None:
    ingress = grant(ROLES["ingress"], "ingress-i0", "i0")
    assert may_subscribe(ingress, subjects.stream_inbox("i0"))
    assert not may_subscribe(ingress, subjects.stream_inbox("i1"))
    prober = grant(ROLES["health-prober"], "health-prober-h0", "h0")
    assert may_subscribe(prober, subjects.stream_inbox("h0"))
    assert not may_subscribe(prober, subjects.stream_inbox("i0"))


def test_each_user_hears_its_own_inboxes_and_answers_only_the_roles_that_ask_it() -> None:
    balancer = grant(ROLES["balancer"], "balancer-0")
    assert balancer.inbox_prefix == "_INBOX.balancer.balancer-0"
    assert may_subscribe(balancer, balancer.inbox_prefix + ".abc.1")
    assert not may_subscribe(balancer, "_INBOX.balancer.balancer-1.abc")
    assert may_publish(balancer, "_INBOX.ingress.ingress-i0.abc.1")
    assert not may_publish(balancer, "_INBOX.worker.worker-w0.abc.1")
    # Workers answer each other in a hand-off: prefill answers decode's KV pulls, decode accepts prefill's hand-offs.
    assert may_publish(worker("p0", "prefill-worker"), "_INBOX.decode-worker.decode-worker-d0.x")
    assert may_publish(worker("d0", "decode-worker"), "_INBOX.prefill-worker.prefill-worker-p0.x")
    assert not may_publish(worker("w0"), "_INBOX.decode-worker.decode-worker-d0.x")


def test_every_role_that_requests_has_an_inbox_and_every_answered_role_exists() -> None:
    for role in ROLES.values():
        assert set(role.answers) <= set(ROLES), role.name
        for asker in role.answers:
            assert permissions.INBOX in ROLES[asker].subscribe, f"{asker} asks {role.name} but hears no inbox"


def test_subjects_in_the_table_are_well_formed() -> None:
    token = re.compile(r"^([A-Za-z0-9_$-]+|\*|>|\{id\}|\{user\}|\{role\})$")
    for role in ROLES.values():
        for subject in (*role.publish, *role.subscribe):
            tokens = subject.split(".")
            assert all(token.match(t) for t in tokens), (role.name, subject)
            assert ">" not in tokens[:-1], (role.name, subject)


def test_a_per_instance_role_needs_its_id_and_ids_must_be_tokens() -> None:
    with pytest.raises(ValueError, match="instance id"):
        grant(ROLES["worker"], "worker-x")
    with pytest.raises(ValueError, match="token"):
        grant(ROLES["worker"], "worker-x", "a.b")
    with pytest.raises(ValueError, match="token"):
        grant(ROLES["balancer"], "bad user")
    # One user for every instance of a role: `{id}` as a wildcard (weaker, but possible).
    shared = grant(ROLES["worker"], "workers", "*")
    assert may_subscribe(shared, subjects.worker_inbox("w7"))


def test_per_instance_roles_name_the_setting_that_holds_their_id() -> None:
    for role in ROLES.values():
        if role.per_instance:
            assert role.id_setting.startswith("KVLANE__"), role.name
            section, key = role.id_setting.removeprefix("KVLANE__").lower().split("__")
            assert getattr(getattr(load_config(env={role.id_setting: "x1"}), section), key) == "x1"


# --- Redis ---------------------------------------------------------------------------------


def lua_commands(script: str) -> set[str]:
    return {name.lower() for name in re.findall(r"redis\.call\('([A-Za-z]+)'", script)}


def test_lua_scripts_use_only_commands_their_roles_may_run() -> None:
    ledger = {s for name in ("_ALLOCATE", "_PREEMPT", "RELEASE_SCRIPT", "_REAP", "_RENEW") for s in lua_commands(getattr(block_ledger, name))}
    slots = {s for name in ("_RESERVE", "_RESERVE_WITH_LEASE", "_RELEASE", "_READ_AND_RELEASE_LEASE")
             for s in lua_commands(getattr(slot_store, name))}
    assert ledger and slots
    assert ledger <= set(ROLES["cache-manager"].redis_commands)
    assert ledger | slots <= set(ROLES["balancer"].redis_commands)
    scripts = [value for name, value in vars(key_limits).items() if name.startswith("_") and isinstance(value, str)]
    limits = {command for script in scripts for command in lua_commands(script)}
    assert limits and limits <= set(ROLES["ingress"].redis_commands)


def test_the_cache_managers_leadership_lock_uses_only_commands_its_role_may_run() -> None:
    import fnmatch

    from redis.asyncio.lock import Lock

    from services.cache_manager.leadership import leader_key

    scripts = (Lock.LUA_RELEASE_SCRIPT, Lock.LUA_EXTEND_SCRIPT, Lock.LUA_REACQUIRE_SCRIPT)
    lock_commands = {"set"} | {command for script in scripts for command in lua_commands(script)}  # SET NX PX takes it
    assert {"get", "pexpire"} <= lock_commands <= set(ROLES["cache-manager"].redis_commands)
    # Redis ACL key patterns are globs.
    assert any(fnmatch.fnmatchcase(leader_key("prewarm"), keys.pattern) and keys.access == "RW"
               for keys in ROLES["cache-manager"].redis_keys)


def test_acl_lines_scope_keys_and_commands_and_hide_the_password() -> None:
    line = permissions.redis_acl_line(worker("w0"), "s3cret")
    assert line.startswith("user worker-w0 on #")
    assert "s3cret" not in line
    assert "~kvlane:v1:node:w0" in line.split() and "~kvlane:v1:node:*" not in line
    assert "-@all" in line and "+flushall" not in line and "+@all" not in line
    ingress = permissions.redis_acl_line(grant(ROLES["ingress"], "ingress-i0", "i0"), "x")
    assert "%R~kvlane:v1:node:*" in ingress.split()


def test_nats_authorization_block_lists_users_with_their_permissions() -> None:
    block = permissions.nats_authorization([permissions.NatsUser(worker("w0"), password="pw")])
    assert 'user: "worker-w0", password: "pw"' in block
    assert '"kvlane.v1.heartbeat.w0"' in block and '"kvlane.v1.worker.w0.generate"' in block
    assert "allow_responses" not in block


def test_nats_server_accepts_the_generated_configuration(tmp_path: Path) -> None:
    try:
        binary = find_nats_server()
    except LaunchError:
        pytest.skip("nats-server not installed")
    users = [permissions.NatsUser(grant(role, f"{name}-x", "x"), password="pw") for name, role in ROLES.items()]
    config = tmp_path / "nats.conf"
    config.write_text(permissions.nats_authorization(users))
    result = subprocess.run([binary, "-t", "-c", str(config)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


# --- docs -------------------------------------------------------------------------------------


def test_docs_show_the_table_as_the_code_has_it() -> None:
    text = DOCS.read_text()
    begin, end = "<!-- permissions:begin -->\n", "<!-- permissions:end -->"
    assert begin in text and end in text
    shown = text.split(begin, 1)[1].split(end, 1)[0]
    assert shown == permissions.markdown_tables(), (
        "docs/security.md is out of date: paste `python -c 'from launch.permissions import markdown_tables as t; print(t(), end=\"\")'`"
    )


# --- client options ----------------------------------------------------------------------------


def test_unsecured_settings_give_the_options_of_old() -> None:
    assert nats_options(NatsSettings()) == {"servers": ["nats://127.0.0.1:4222"]}
    assert redis_url_and_options(RedisSettings()) == ("redis://127.0.0.1:6379/0", {})


def test_nats_options_carry_credentials_inbox_several_servers_and_tls(tmp_path: Path) -> None:
    from launch.certs import make_certs

    certs = make_certs(tmp_path)
    options = nats_options(NatsSettings(
        url="nats://a:4222, nats://b:4222", user="u", password="p", inbox_prefix="_INBOX.worker.u",
        nkeys_seed_file="/s.nk", credentials_file="/u.creds", tls_ca=str(certs.ca), tls_cert=str(certs.client_cert),
        tls_key=str(certs.client_key),
    ))
    assert options["servers"] == ["nats://a:4222", "nats://b:4222"]
    assert (options["user"], options["password"], options["inbox_prefix"]) == ("u", "p", "_INBOX.worker.u")
    assert (options["nkeys_seed"], options["user_credentials"]) == ("/s.nk", "/u.creds")
    assert isinstance(options["tls"], ssl.SSLContext) and options["tls"].verify_mode == ssl.CERT_REQUIRED


def test_redis_settings_credentials_win_over_the_url_and_tls_means_rediss() -> None:
    url, options = redis_url_and_options(RedisSettings(url="redis://old:pw@h:1/2", username="u", password="p", tls_ca="/ca.pem"))
    assert url == "rediss://h:1/2"
    assert options == {"username": "u", "password": "p", "ssl_cert_reqs": "required", "ssl_ca_certs": "/ca.pem"}
    url, options = redis_url_and_options(RedisSettings(url="redis://:pw@h:1/0"))
    assert (url, options) == ("redis://:pw@h:1/0", {})


def test_credentials_come_from_the_environment() -> None:
    config = load_config(env={"KVLANE__NATS__USER": "worker-w0", "KVLANE__NATS__PASSWORD": "123",
                              "KVLANE__REDIS__USERNAME": "worker-w0", "KVLANE__REDIS__PASSWORD": "456"})
    assert (config.nats.user, config.nats.password) == ("worker-w0", "123")
    assert (config.redis.username, config.redis.password) == ("worker-w0", "456")
