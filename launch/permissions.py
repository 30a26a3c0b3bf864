"""Who may do what on the bus and in Redis: one table, by role.

Each role lists the NATS subjects it may publish to and subscribe to, and
the Redis keys and commands it may use, as read from the code (where each
service calls `bus.publish`, `bus.request`, `bus.subscribe`, and which keys
and commands its Redis code uses). The nats-server authorization block, the
Redis ACL file of `kvlane up --secure` and the table in docs/security.md are
all generated from `ROLES`; tests check the docs against it and run a
secured fleet whose nats-server must log no permission violation.

Placeholders in the table:

* `{id}`: the instance's own id (a worker's `worker.worker_id`, an ingress's
  `ingress.ingress_id`, a health prober's `health.prober_id`). A user
  rendered for one instance may touch only that instance's subjects and keys;
  rendered with `id="*"`, one user serves every instance of the role (weaker:
  workers could then read one another's requests).
* `{user}` and `{role}`: the NATS user name and its role. Each user has its
  own inbox prefix, `_INBOX.{role}.{user}` (`nats.inbox_prefix`), and may
  subscribe to its own inboxes only, so no process can read another's replies.

Answers to requests follow the data flow too: a role `answers` the roles that
send it requests, that is, it may publish to their inboxes
(`_INBOX.<their role>.>`). An explicit grant rather than nats-server's
`allow_responses`, whose reply tracking every configuration reload resets
(`kvlane up --secure` reloads to add a user for each worker it starts).

Pure data and string functions: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from contracts import subjects

ID = "{id}"
USER = "{user}"
ANY = "*"
ROLE = "{role}"
INBOX_PREFIX = f"_INBOX.{ROLE}.{USER}"
INBOX = f"{INBOX_PREFIX}.>"


def inboxes_of(role: str) -> str:
    """Where the replies to every user of `role` go."""
    return f"_INBOX.{role}.>"


# nats.micro's discovery subjects ($SRV.PING, $SRV.INFO.kvlane, $SRV.STATS.kvlane.<service id>).
MICRO_DISCOVERY = ("$SRV.*", f"$SRV.*.{subjects.API_SERVICE}", f"$SRV.*.{subjects.API_SERVICE}.*")
API_ENDPOINTS = (subjects.API_CHAT_COMPLETIONS, subjects.API_COMPLETIONS, subjects.API_MESSAGES, subjects.API_RESPONSES,
                 subjects.API_MODELS, subjects.API_TOKENIZE, subjects.API_DETOKENIZE)
# What every process that watches the cluster (shared/cluster.py ClusterWatcher) hears.
WATCH_CLUSTER = (subjects.HEARTBEAT_ALL, subjects.WORKER_LEFT)


@dataclass(frozen=True)
class RedisKeys:
    """A Redis key pattern and whether the role may read ("R"), write ("W") or both ("RW")."""

    pattern: str
    access: str = "RW"

    def acl(self, instance_id: str) -> str:
        pattern = self.pattern.replace(ID, instance_id)
        return {"RW": "~", "R": "%R~", "W": "%W~"}[self.access] + pattern


# Redis: what every process that watches the cluster reads (ClusterState.live_heartbeats, which also prunes the set).
_NODES = RedisKeys(subjects.NODE_SET_KEY)
_WATCH_KEYS = (_NODES, RedisKeys(subjects.node_key(ANY), "R"))
_WATCH_COMMANDS = ("smembers", "get", "pttl", "srem")
# Every client: the pool's health checks, SELECT of a database in the URL. (Not CLIENT SETINFO, which
# redis-py sends at connect and does without: Redis 7.0 knows no such command, and an ACL naming it fails.)
_CONNECTION_COMMANDS = ("ping", "select")
# Lua scripts (shared/redis_scripts.py, redis-py's Script): EVALSHA, and SCRIPT LOAD after a Redis restart.
_SCRIPT_COMMANDS = ("evalsha", "script|load")
# Inside the block ledger's scripts (shared/kv/block_ledger.py) and its plain reads.
_LEDGER_COMMANDS = (
    "time", "exists", "hget", "hset", "hincrby", "hmget", "hgetall", "del", "sadd", "srem", "scard", "smembers",
    "zadd", "zrem", "zrangebyscore", "zscore", "zcard",
)
# Inside the slot store's scripts (services/balancer/slot_store.py) and its plain reads.
_SLOT_COMMANDS = ("time", "get", "set", "del", "zadd", "zrem", "zcard", "zcount", "zrange", "zremrangebyscore", "pexpireat",
                  # The tenants' fair-share counters beside the slots.
                  "hincrbyfloat", "hget", "hset", "hgetall", "pexpire")
_LEDGER_KEYS = RedisKeys(f"{subjects.REDIS_PREFIX}:cache:*")
# A replicated job's leadership lock (services/cache_manager/leadership.py, redis-py's Lock): SET NX PX, and GET/PEXPIRE/DEL in its scripts.
_LEADERSHIP_COMMANDS = ("set", "get", "pexpire", "del")
# API keys (shared/api_keys.py): one record per key, `kvlane:v1:{key:<id>}`, and the set of ids.
_API_KEY_RECORDS = f"{subjects.REDIS_PREFIX}:{{key:*}}"
_API_KEY_INDEX = f"{subjects.REDIS_PREFIX}:api_keys"
# A key's rate-limit state (services/ingress/key_limits.py): `kvlane:v1:{key:<id>}:window` and the like.
_API_KEY_LIMITS = f"{subjects.REDIS_PREFIX}:{{key:*}}:*"
# Inside the key limiter's scripts.
_KEY_LIMIT_COMMANDS = (
    "time", "get", "exists", "zadd", "zrem", "zcard", "zrange", "zrangebyscore", "zremrangebyscore", "hget", "hmget",
    "hset", "hdel", "incrby", "decrby", "pexpire",
)


@dataclass(frozen=True)
class Role:
    name: str
    # `python -m services.<service>` runs it; empty for clients outside the fleet.
    service: str
    summary: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # The roles whose requests it answers (it may publish to their inboxes).
    answers: tuple[str, ...] = ()
    redis_keys: tuple[RedisKeys, ...] = ()
    redis_commands: tuple[str, ...] = ()
    # The config field that holds `{id}` for this role, as a KVLANE__* variable.
    id_setting: str = ""

    @property
    def per_instance(self) -> bool:
        return any(ID in subject for subject in (*self.publish, *self.subscribe)) or any(
            ID in keys.pattern for keys in self.redis_keys
        )


def _worker(
    name: str, service: str, summary: str, publish: tuple[str, ...] = (), subscribe: tuple[str, ...] = (),
    answers: tuple[str, ...] = (),
) -> Role:
    """A worker of any role: heartbeats, KV events, streamed frames, finished events, lease renewals, its own inbox."""
    return Role(
        name=name,
        service=service,
        summary=summary,
        publish=(
            subjects.heartbeat(ID), subjects.kv_events(ID), subjects.stream_subject(ANY, ANY), subjects.REQUEST_FINISHED,
            subjects.CACHE_RENEW, subjects.WORKER_LEFT, *publish,
        ),
        # Balancer heartbeats: a balancer newly there hears the recent finished events again (`finished_replay`).
        subscribe=(subjects.worker_inbox(ID), subjects.BALANCER_HEARTBEAT_ALL, *subscribe),
        answers=("ingress", "health-prober", *answers),
        redis_keys=(RedisKeys(subjects.node_key(ID)), _NODES),
        redis_commands=(*_CONNECTION_COMMANDS, "set", "sadd", "del", "srem"),
        id_setting="KVLANE__WORKER__WORKER_ID",
    )


ROLES: dict[str, Role] = {
    role.name: role
    for role in (
        Role(
            name="ingress",
            service="ingress",
            summary="asks balancers for routes, sends requests and aborts to workers, serves the NATS API",
            publish=(
                subjects.ROUTE, subjects.balancer_route(ANY), subjects.ROUTE_WITHDRAWN, subjects.worker_inbox(ANY),
                subjects.FEEDBACK, subjects.REQUEST_SERVED,
                # /ready pings these.
                subjects.BALANCER_STATUS, subjects.CACHE_REQUEST,
            ),
            subscribe=(
                subjects.stream_inbox(ID), *WATCH_CLUSTER, subjects.BALANCER_HEARTBEAT_ALL, *API_ENDPOINTS, *MICRO_DISCOVERY,
                INBOX,
                # Which models are served from zero.
                subjects.AUTOSCALER_DECISION,
            ),
            # The OpenAI API over NATS and nats.micro discovery.
            answers=("client", "operator"),
            redis_keys=(
                *_WATCH_KEYS,
                # API keys: their records read only, their rate limits read and written.
                RedisKeys(_API_KEY_RECORDS, "R"),
                RedisKeys(_API_KEY_LIMITS),
                # Stored responses of the Responses API.
                RedisKeys(subjects.response_key(ANY)),
                RedisKeys(subjects.AUTOSCALER_DECISION_KEY, "R"),
            ),
            redis_commands=tuple(dict.fromkeys((*_CONNECTION_COMMANDS, *_WATCH_COMMANDS, *_SCRIPT_COMMANDS, *_KEY_LIMIT_COMMANDS,
                                                "set"))),
            id_setting="KVLANE__INGRESS__INGRESS_ID",
        ),
        Role(
            name="balancer",
            service="balancer",
            summary="answers route requests and hands requests (and aborts) to workers; allocates KV from the ledger or "
                    "the cache-manager",
            publish=(subjects.CACHE_REQUEST, subjects.CACHE_ROUTED, subjects.worker_inbox(ANY), subjects.balancer_heartbeat(ANY),
                     subjects.AUTOSCALER_WAKE),
            subscribe=(
                subjects.ROUTE, subjects.balancer_route(ANY), subjects.REQUEST_FINISHED, subjects.ROUTE_WITHDRAWN, subjects.KV_EVENTS_ALL,
                subjects.HEALTH_ALL, *WATCH_CLUSTER, subjects.BALANCER_STATUS, subjects.BALANCER_STATUS_ALL, INBOX,
                subjects.AUTOSCALER_DECISION,
            ),
            # Routes; statuses.
            answers=("ingress", "autoscaler", "operator"),
            redis_keys=(
                *_WATCH_KEYS, RedisKeys(f"{subjects.REDIS_PREFIX}:slots:*"), RedisKeys(f"{subjects.REDIS_PREFIX}:slot:*"),
                RedisKeys(f"{subjects.REDIS_PREFIX}:{{tenants}}:*"), _LEDGER_KEYS, RedisKeys(subjects.AUTOSCALER_DECISION_KEY, "R"),
            ),
            redis_commands=tuple(dict.fromkeys(
                (*_CONNECTION_COMMANDS, *_WATCH_COMMANDS, *_SCRIPT_COMMANDS, *_SLOT_COMMANDS, *_LEDGER_COMMANDS)
            )),
        ),
        Role(
            name="cache-manager",
            service="cache_manager",
            summary="answers KV allocations; preempts (aborts) and pre-warms on workers",
            publish=(subjects.worker_inbox(ANY),),
            subscribe=(
                subjects.CACHE_REQUEST, subjects.CACHE_RENEW, subjects.CACHE_ROUTED, subjects.KV_EVENTS_ALL,
                subjects.ROUTE_WITHDRAWN, *WATCH_CLUSTER,
            ),
            # Allocations; the ingress's readiness pings.
            answers=("balancer", "ingress"),
            redis_keys=(*_WATCH_KEYS, _LEDGER_KEYS),
            redis_commands=tuple(dict.fromkeys(
                (*_CONNECTION_COMMANDS, *_WATCH_COMMANDS, *_SCRIPT_COMMANDS, *_LEDGER_COMMANDS, *_LEADERSHIP_COMMANDS)
            )),
        ),
        Role(
            name="health-prober",
            service="health_prober",
            summary="probes workers through their inboxes, publishes health verdicts",
            publish=(subjects.worker_inbox(ANY), subjects.health(ANY)),
            subscribe=(subjects.FEEDBACK, subjects.stream_inbox(ID), *WATCH_CLUSTER, INBOX),
            redis_keys=(*_WATCH_KEYS, RedisKeys(subjects.health_key(ANY))),
            redis_commands=(*_CONNECTION_COMMANDS, *_WATCH_COMMANDS, "set"),
            id_setting="KVLANE__HEALTH__PROBER_ID",
        ),
        Role(
            name="autoscaler",
            service="autoscaler",
            summary="reads served-request events, the balancer's queue and its wakes; publishes scaling decisions",
            publish=(subjects.AUTOSCALER_DECISION, subjects.BALANCER_STATUS),
            subscribe=(subjects.REQUEST_SERVED, subjects.AUTOSCALER_WAKE, *WATCH_CLUSTER, INBOX),
            redis_keys=(*_WATCH_KEYS, RedisKeys(subjects.AUTOSCALER_DECISION_KEY)),
            redis_commands=(*_CONNECTION_COMMANDS, *_WATCH_COMMANDS, "set"),
        ),
        _worker("worker", "worker", "runs whole requests (aggregated)"),
        _worker(
            "prefill-worker", "prefill_worker", "runs prompts, hands requests to decode workers, lends its KV",
            publish=(subjects.worker_inbox(ANY),), subscribe=(subjects.worker_kv(ID), INBOX),
            # KV pulls.
            answers=("decode-worker",),
        ),
        _worker(
            "decode-worker", "decode_worker", "takes hand-offs, pulls KV from prefill workers",
            publish=(subjects.worker_kv(ANY),), subscribe=(INBOX,),
            # Hand-offs.
            answers=("prefill-worker",),
        ),
        Role(
            name="client",
            service="",
            summary="calls the OpenAI API over NATS (kvlane.client)",
            publish=(*API_ENDPOINTS, *MICRO_DISCOVERY),
            subscribe=(INBOX,),
        ),
        Role(
            name="operator",
            service="",
            summary="the client's rights, `kvlane status`, `kvlane keys`, and `kvlane up --autoscale` reading decisions",
            publish=(*API_ENDPOINTS, *MICRO_DISCOVERY, subjects.BALANCER_STATUS_ALL),
            subscribe=(INBOX,),
            redis_keys=(
                RedisKeys(subjects.AUTOSCALER_DECISION_KEY, "R"), RedisKeys(_API_KEY_RECORDS), RedisKeys(_API_KEY_INDEX),
            ),
            redis_commands=(*_CONNECTION_COMMANDS, "get", "set", "del", "sadd", "srem", "smembers"),
        ),
    )
}

@dataclass(frozen=True)
class Grant:
    """One user's rendered permissions: subjects (with wildcards), its inbox prefix, Redis rules."""

    user: str
    role: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    inbox_prefix: str
    redis_keys: tuple[str, ...] = ()
    redis_commands: tuple[str, ...] = ()


def grant(role: Role, user: str, instance_id: str = "") -> Grant:
    """`role`'s permissions for the user `user`, `{id}` read as `instance_id` (`*`: any instance)."""
    if role.per_instance and not instance_id:
        raise ValueError(f"role {role.name} needs an instance id")
    if not subjects.is_valid_token(user):
        raise ValueError(f"user {user!r} must be one NATS subject token (A-Z a-z 0-9 _ -)")
    if instance_id not in ("", ANY) and not subjects.is_valid_token(instance_id):
        raise ValueError(f"instance id {instance_id!r} must be one NATS subject token")

    def render(subject: str) -> str:
        return subject.replace(ID, instance_id).replace(USER, user).replace(ROLE, role.name)

    return Grant(
        user=user,
        role=role.name,
        publish=tuple(render(s) for s in (*role.publish, *(inboxes_of(r) for r in role.answers))),
        subscribe=tuple(render(s) for s in role.subscribe),
        inbox_prefix=render(INBOX_PREFIX),
        redis_keys=tuple(keys.acl(instance_id) for keys in role.redis_keys),
        redis_commands=role.redis_commands,
    )


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether `subject` (itself possibly a wildcard) lies within `pattern` (`*` one token, `>` the rest)."""
    pattern_tokens, subject_tokens = pattern.split("."), subject.split(".")
    for index, token in enumerate(pattern_tokens):
        if token == ">":
            return len(subject_tokens) > index
        if index >= len(subject_tokens):
            return False
        other = subject_tokens[index]
        if other == ">" or (token != "*" and (other == "*" or token != other)):
            return False
    return len(pattern_tokens) == len(subject_tokens)


def may_publish(grant_: Grant, subject: str) -> bool:
    return any(subject_matches(pattern, subject) for pattern in grant_.publish)


def may_subscribe(grant_: Grant, subject: str) -> bool:
    return any(subject_matches(pattern, subject) for pattern in grant_.subscribe)


# ---- nats-server configuration ----------------------------------------------------------------------------------


def _quoted(text: str) -> str:
    # JSON strings are nats-server config strings; quoting also keeps `$SRV` from reading as a variable.
    return json.dumps(text)


def _list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(_quoted(item) for item in items) + "]"


@dataclass(frozen=True)
class NatsUser:
    """A user of the nats-server config: a password (plain, or bcrypt `$2...`) or an NKey public key, and its grant."""

    grant: Grant
    password: str = ""
    nkey: str = ""


def nats_authorization(users: list[NatsUser], auth_timeout_s: float = 2.0) -> str:
    """The `authorization { users = [...] }` block for these users (a nats-server config fragment)."""
    lines = ["authorization {", f"  timeout: {auth_timeout_s:g}", "  users: ["]
    for user in users:
        g = user.grant
        credentials = f"nkey: {_quoted(user.nkey)}" if user.nkey else f"user: {_quoted(g.user)}, password: {_quoted(user.password)}"
        lines.append(f"    # {g.role}")
        lines.append(
            f"    {{{credentials}, permissions: {{publish: {{allow: {_list(g.publish)}}}, "
            f"subscribe: {{allow: {_list(g.subscribe)}}}}}}}"
        )
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


# ---- Redis ACL -------------------------------------------------------------------------------------------------------


def redis_password_hash(password: str) -> str:
    """How an ACL file holds a password (`#<sha256>`), so the file never shows it."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def redis_acl_rules(grant_: Grant, password: str) -> list[str]:
    """One user's ACL rules (as `ACL SETUSER <user>` takes them): its keys, no channels, only its commands."""
    rules = ["on", redis_password_hash(password), "resetkeys", *grant_.redis_keys, "resetchannels", "-@all"]
    return rules + [f"+{command}" for command in grant_.redis_commands]


def redis_acl_line(grant_: Grant, password: str) -> str:
    """One `user ...` line of a Redis ACL file."""
    return f"user {grant_.user} " + " ".join(redis_acl_rules(grant_, password))


# ---- the documentation tables ------------------------------------------------------------------------------------


def _cell(items: tuple[str, ...] | list[str]) -> str:
    # A `|` inside a table cell must be escaped, code span or not.
    return "<br>".join("`" + item.replace("|", "\\|") + "`" for item in items) or "-"


def markdown_tables() -> str:
    """The permission tables of docs/security.md (a test checks that the file holds exactly these)."""
    nats = [
        "| role | runs as | publish | subscribe | answers requests of |",
        "|---|---|---|---|---|",
    ]
    redis = [
        "| role | keys (`~` read-write, `%R~` read-only) | commands |",
        "|---|---|---|",
    ]
    for role in ROLES.values():
        runs_as = f"`python -m services.{role.service}`" if role.service else "a client"
        subscribe = [subject.replace(ROLE, role.name) for subject in role.subscribe]
        nats.append(f"| {role.name} | {runs_as} | {_cell(role.publish)} | {_cell(subscribe)} | {', '.join(role.answers) or '-'} |")
        if role.redis_keys:
            redis.append(f"| {role.name} | {_cell([keys.acl(ID) for keys in role.redis_keys])} | {_cell(role.redis_commands)} |")
    return "\n".join(["### NATS", "", *nats, "", "### Redis", "", *redis]) + "\n"
