"""Configuration loading: TOML file, KVLANE__* overrides, strict validation (shared/config.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.config import (
    ConfigError,
    KvlaneConfig,
    SimSettings,
    WorkerSettings,
    load_config,
    to_env,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvlane.toml"
    path.write_text(text)
    return path


# --- defaults and file ----------------------------------------------------------


def test_defaults_load_without_file_or_env() -> None:
    config = load_config(env={})
    assert config == KvlaneConfig()
    assert config.ingress.port == 8000
    assert config.ingress.max_tokens_default == 512
    assert config.worker.sim.block_size == 16
    assert config.worker.sim.speed == 1.0
    assert config.balancer.policy == "jffc_per_request"
    assert config.nats.max_reconnect_attempts == -1


def test_unrelated_environment_is_ignored() -> None:
    config = load_config(env={"PATH": "/bin", "KVLANE_OTHER": "x", "HOME": "/root"})
    assert config == KvlaneConfig()


def test_file_values_are_read_and_the_rest_keeps_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[ingress]
port = 9001
host = "0.0.0.0"

[worker]
model = "m1"

[worker.sim]
speed = 10
block_size = 32
""",
    )
    config = load_config(path, env={})
    assert config.ingress.port == 9001
    assert config.ingress.host == "0.0.0.0"
    assert config.ingress.request_timeout_s == 600.0
    assert config.worker.model == "m1"
    assert config.worker.sim.speed == 10.0
    assert isinstance(config.worker.sim.speed, float)
    assert config.worker.sim.block_size == 32
    assert config.worker.sim.num_blocks == SimSettings().num_blocks
    assert config.nats == KvlaneConfig().nats


def test_file_named_by_kvlane_config_env(tmp_path: Path) -> None:
    path = write(tmp_path, "[ingress]\nport = 7000\n")
    config = load_config(env={"KVLANE_CONFIG": str(path)})
    assert config.ingress.port == 7000


def test_explicit_path_wins_over_kvlane_config_env(tmp_path: Path) -> None:
    a = write(tmp_path, "[ingress]\nport = 7000\n")
    b = tmp_path / "other.toml"
    b.write_text("[ingress]\nport = 7001\n")
    assert load_config(b, env={"KVLANE_CONFIG": str(a)}).ingress.port == 7001


# --- environment overrides --------------------------------------------------------


def test_env_values_are_json_parsed() -> None:
    config = load_config(
        env={
            "KVLANE__INGRESS__PORT": "8001",
            "KVLANE__CLUSTER__HEARTBEAT_TTL_S": "4.5",
            "KVLANE__NATS__MAX_RECONNECT_ATTEMPTS": "-1",
            "KVLANE__WORKER__MODEL": '"quoted-model"',
        }
    )
    assert config.ingress.port == 8001
    assert config.cluster.heartbeat_ttl_s == 4.5
    assert config.nats.max_reconnect_attempts == -1
    assert config.worker.model == "quoted-model"


def test_env_value_that_is_not_json_is_a_plain_string() -> None:
    config = load_config(env={"KVLANE__NATS__URL": "nats://10.0.0.1:4222", "KVLANE__LOGGING__FORMAT": "console"})
    assert config.nats.url == "nats://10.0.0.1:4222"
    assert config.logging.format == "console"


def test_env_names_are_case_insensitive() -> None:
    config = load_config(env={"kvlane__ingress__port": "8123", "KvLaNe__Logging__Level": "debug"})
    assert config.ingress.port == 8123
    assert config.logging.level == "debug"


def test_nested_env_override() -> None:
    config = load_config(env={"KVLANE__WORKER__SIM__SPEED": "25", "KVLANE__WORKER__SIM__SEED": "7"})
    assert config.worker.sim.speed == 25.0
    assert config.worker.sim.seed == 7
    assert config.worker.sim.block_size == 16


def test_env_overrides_file_and_merges_within_a_section(tmp_path: Path) -> None:
    path = write(tmp_path, "[ingress]\nport = 9001\nhost = \"0.0.0.0\"\n\n[worker.sim]\nspeed = 3.0\nnum_blocks = 100\n")
    config = load_config(path, env={"KVLANE__INGRESS__PORT": "9002", "KVLANE__WORKER__SIM__SPEED": "4"})
    assert config.ingress.port == 9002
    assert config.ingress.host == "0.0.0.0"  # kept from the file
    assert config.worker.sim.speed == 4.0
    assert config.worker.sim.num_blocks == 100  # kept from the file


def test_numeric_looking_env_value_for_a_string_field() -> None:
    config = load_config(env={"KVLANE__WORKER__WORKER_ID": "123", "KVLANE__INGRESS__INGRESS_ID": "7"})
    assert config.worker.worker_id == "123"
    assert config.ingress.ingress_id == "7"


# --- errors -----------------------------------------------------------------------


def test_unknown_key_in_file_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "[ingress]\nprot = 9001\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert "prot" in str(info.value)
    assert "ingress" in str(info.value)
    assert str(path) in str(info.value)


def test_unknown_section_in_file_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "[ingres]\nport = 9001\n")
    with pytest.raises(ConfigError, match="ingres"):
        load_config(path, env={})


def test_unknown_key_in_env_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVLANE__WORKER__SIM__SPEEED": "2"})
    message = str(info.value)
    assert "speeed" in message
    assert "environment" in message


def test_empty_env_key_segment() -> None:
    with pytest.raises(ConfigError, match="empty key segment"):
        load_config(env={"KVLANE__INGRESS____PORT": "1"})


def test_env_value_and_section_conflict() -> None:
    with pytest.raises(ConfigError):
        load_config(env={"KVLANE__WORKER": "1", "KVLANE__WORKER__MODEL": "x"})


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[ingress]\nport = "eighty"\n', "port"),
        ("[ingress]\nport = 70000\n", "port"),
        ("[worker.sim]\nspeed = 0\n", "speed"),
        ("[worker.sim]\nblock_size = -4\n", "block_size"),
        ('[logging]\nlevel = "verbose"\n', "level"),
        ("[tracing]\nsample_ratio = 1.5\n", "sample_ratio"),
        ("worker = 5\n", "worker"),
    ],
)
def test_wrong_type_or_value_in_file(tmp_path: Path, toml: str, key: str) -> None:
    path = write(tmp_path, toml)
    with pytest.raises(ConfigError, match=key):
        load_config(path, env={})


def test_wrong_type_in_env() -> None:
    with pytest.raises(ConfigError, match="port"):
        load_config(env={"KVLANE__INGRESS__PORT": "eighty"})
    with pytest.raises(ConfigError, match="speed"):
        load_config(env={"KVLANE__WORKER__SIM__SPEED": "-1"})


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(missing, env={})


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path, env={})


def test_invalid_toml(tmp_path: Path) -> None:
    path = write(tmp_path, "[ingress\nport = = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, env={})


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# --- to_env -----------------------------------------------------------------------


def test_to_env_names_and_values() -> None:
    flat = to_env(KvlaneConfig())
    assert flat["KVLANE__INGRESS__PORT"] == "8000"
    assert flat["KVLANE__NATS__URL"] == '"nats://127.0.0.1:4222"'
    assert flat["KVLANE__WORKER__SIM__SPEED"] == "1.0"
    assert all(name.startswith("KVLANE__") and name == name.upper() for name in flat)


def test_to_env_round_trips_defaults() -> None:
    assert load_config(env=to_env(KvlaneConfig())) == KvlaneConfig()


def test_to_env_round_trips_a_file_config(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[worker]\nworker_id = "123"\nmodel = "true"\n[worker.sim]\nspeed = 2.5\n[logging]\nformat = "console"\n',
    )
    config = load_config(path, env={})
    assert config.worker.worker_id == "123"
    assert load_config(env=to_env(config)) == config


def test_a_model_s_own_autoscaler_bounds_are_read_and_travel_to_children(tmp_path: Path) -> None:
    path = write(tmp_path, '[autoscaler.aggregated]\nmax = 4\n[autoscaler.models."org/Big-7B".aggregated]\nmin = 0\nmax = 2\n')
    config = load_config(path, env={})
    assert (config.autoscaler.bounds("org/Big-7B", "aggregated").min, config.autoscaler.bounds("org/Big-7B", "aggregated").max) == (0, 2)
    assert config.autoscaler.bounds("org/Big-7B", "decode") == config.autoscaler.decode
    assert config.autoscaler.bounds("other", "aggregated").max == 4
    # The model's name keeps its case through the environment `kvlane up` configures its children with.
    assert load_config(env=to_env(config)) == config
    with pytest.raises(ConfigError, match="agregated"):
        load_config(write(tmp_path, '[autoscaler.models."m".agregated]\nmin = 0\n'), env={})


positive_floats = st.floats(min_value=1e-6, max_value=1e9, allow_nan=False, allow_infinity=False)


@given(
    port=st.integers(0, 65535),
    speed=positive_floats,
    ttl=positive_floats,
    seed=st.integers(-(2**53), 2**53),
    num_blocks=st.integers(1, 2**31),
    sample_ratio=st.floats(0.0, 1.0),
    model=st.text(min_size=0, max_size=20),
)
def test_to_env_round_trip_property(
    port: int, speed: float, ttl: float, seed: int, num_blocks: int, sample_ratio: float, model: str
) -> None:
    base = KvlaneConfig()
    config = KvlaneConfig(
        ingress=type(base.ingress)(port=port),
        cluster=type(base.cluster)(heartbeat_ttl_s=ttl),
        tracing=type(base.tracing)(sample_ratio=sample_ratio),
        worker=WorkerSettings(model=model, sim=SimSettings(speed=speed, seed=seed, num_blocks=num_blocks)),
    )
    assert load_config(env=to_env(config)) == config
