"""Configuration: one TOML file plus environment overrides, decoded strictly.

Every section forbids unknown keys, so a misspelt setting fails at start-up
with the offending path named, instead of being silently ignored.

Environment overrides use `KVLANE__SECTION__KEY=value` (double underscores
separate levels, names are case-insensitive); a value that starts with `"`,
`[` or `{` is read as JSON, anything else as text that numeric and boolean
fields convert. `KVLANE_CONFIG` names the file.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

ENV_PREFIX = "KVLANE__"
CONFIG_FILE_ENV = "KVLANE_CONFIG"

PositiveFloat = Annotated[float, Meta(gt=0)]
PositiveInt = Annotated[int, Meta(ge=1)]


class ConfigError(ValueError):
    """Raised with a message that names the bad key and where it came from."""


class _Section(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class NatsSettings(_Section):
    url: str = "nats://127.0.0.1:4222"
    connect_timeout_s: PositiveFloat = 2.0
    reconnect_wait_s: PositiveFloat = 0.5
    # -1: keep reconnecting for ever; a service outlives a NATS restart.
    max_reconnect_attempts: int = -1


class RedisSettings(_Section):
    url: str = "redis://127.0.0.1:6379/0"
    socket_timeout_s: PositiveFloat = 2.0


class LoggingSettings(_Section):
    format: Literal["json", "console"] = "json"
    level: Literal["debug", "info", "warning", "error"] = "info"


class TracingSettings(_Section):
    exporter: Literal["none", "console", "otlp"] = "none"
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    sample_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0


class ClusterSettings(_Section):
    heartbeat_interval_s: PositiveFloat = 1.0
    heartbeat_ttl_s: PositiveFloat = 3.0
    # How often a process re-reads the live node set from Redis, besides
    # listening to heartbeats (recovers the view after a restart).
    resync_interval_s: PositiveFloat = 2.0
    # Workers publish prefix-cache changes in batches this far apart.
    kv_events_interval_s: PositiveFloat = 0.05


class IngressSettings(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    ingress_id: str = ""
    request_timeout_s: PositiveFloat = 600.0
    route_timeout_s: PositiveFloat = 5.0
    accept_timeout_s: PositiveFloat = 2.0
    # A stream with no frame for this long is failed (worker stalled or gone).
    stall_timeout_s: PositiveFloat = 30.0
    dispatch_attempts: PositiveInt = 3
    max_tokens_default: PositiveInt = 512
    max_body_bytes: PositiveInt = 8 * 1024 * 1024


class BalancerSettings(_Section):
    policy: Literal["least_loaded"] = "least_loaded"


class SimSettings(_Section):
    profile: str = "tiny-cpu"
    # Simulated seconds per real second: 10 runs ten times faster than the GPU.
    speed: PositiveFloat = 1.0
    num_blocks: PositiveInt = 4096
    block_size: PositiveInt = 16
    max_num_seqs: PositiveInt = 64
    max_batched_tokens: PositiveInt = 2048
    max_model_len: PositiveInt = 4096
    seed: int = 0


class WorkerSettings(_Section):
    worker_id: str = ""
    model: str = "kvlane-sim"
    engine: Literal["sim"] = "sim"
    role: Literal["aggregated"] = "aggregated"
    drain_timeout_s: PositiveFloat = 30.0
    sim: SimSettings = msgspec.field(default_factory=SimSettings)


class KvlaneConfig(_Section):
    nats: NatsSettings = msgspec.field(default_factory=NatsSettings)
    redis: RedisSettings = msgspec.field(default_factory=RedisSettings)
    logging: LoggingSettings = msgspec.field(default_factory=LoggingSettings)
    tracing: TracingSettings = msgspec.field(default_factory=TracingSettings)
    cluster: ClusterSettings = msgspec.field(default_factory=ClusterSettings)
    ingress: IngressSettings = msgspec.field(default_factory=IngressSettings)
    balancer: BalancerSettings = msgspec.field(default_factory=BalancerSettings)
    worker: WorkerSettings = msgspec.field(default_factory=WorkerSettings)


def _parse_env_value(raw: str) -> Any:
    # Only quoted strings, lists and tables are JSON: a bare 123 stays a
    # string here (a worker id may be "123") and becomes a number later only
    # where the field is numeric.
    if raw[:1] in ('"', "[", "{"):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.upper().startswith(ENV_PREFIX):
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        if not all(path):
            raise ConfigError(f"environment variable {name}: empty key segment")
        node = tree
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"environment variable {name}: {part} is both a value and a section")
            node = child
        node[path[-1]] = _parse_env_value(raw)
    return tree


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> KvlaneConfig:
    """Read the file (if any), apply environment overrides, validate strictly."""
    env = os.environ if env is None else env
    path = path or env.get(CONFIG_FILE_ENV) or None
    data: dict[str, Any] = {}
    source = "defaults"
    if path:
        source = str(path)
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    overrides = _env_overrides(env)
    if overrides:
        source += " + KVLANE__* environment"
    try:
        # strict=False lets environment strings such as "8001" become ints.
        return msgspec.convert(_merge(data, overrides), KvlaneConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration ({source}): {exc}") from exc


def to_env(config: KvlaneConfig) -> dict[str, str]:
    """Flatten a config into KVLANE__* variables (how `kvlane up` configures children)."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                walk(f"{prefix}__{key.upper()}" if prefix else key.upper(), child)
        else:
            flat[ENV_PREFIX + prefix] = json.dumps(value)

    walk("", msgspec.to_builtins(config))
    return flat
