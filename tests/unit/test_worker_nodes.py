"""A worker process's simulated nodes (`worker.nodes`) and its command-line flags (services/worker/main.py)."""

from __future__ import annotations

import pytest

from services.worker.main import command_line_overrides, node_ids, node_settings
from shared.config import SimSettings, WorkerSettings, load_config


def test_one_node_keeps_the_worker_id() -> None:
    assert node_ids("w0", 1) == ["w0"]


def test_several_nodes_get_numbered_ids() -> None:
    assert node_ids("w0", 3) == ["w0-0", "w0-1", "w0-2"]


def test_node_ids_too_long_for_a_subject_token_are_refused() -> None:
    with pytest.raises(SystemExit, match="longer than 64 characters"):
        node_ids("w" * 62, 100)


def test_each_node_samples_with_its_own_seed() -> None:
    settings = WorkerSettings(sim=SimSettings(seed=7))
    assert [node_settings(settings, k).sim.seed for k in range(3)] == [7, 8, 9]
    assert node_settings(settings, 2).sim.profile == settings.sim.profile


def test_engine_and_nodes_flags_become_config_overrides() -> None:
    rest, env = command_line_overrides(["--config", "x.toml", "--engine", "sim", "--nodes", "16"])
    assert rest == ["--config", "x.toml"]
    config = load_config(None, env)
    assert (config.worker.engine, config.worker.nodes) == ("sim", 16)


def test_no_flags_override_nothing() -> None:
    assert command_line_overrides([]) == ([], {})


def test_zero_nodes_is_a_configuration_error() -> None:
    from shared.config import ConfigError

    _, env = command_line_overrides(["--nodes", "0"])
    with pytest.raises(ConfigError, match="nodes"):
        load_config(None, env)
