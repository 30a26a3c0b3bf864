"""`kvlane up`'s flags: they override the configuration file only when given, and a flag of the other mode is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlane.cli import _up_flags_refused, build_parser, up_config


def parse(*argv: str):
    return build_parser().parse_args(["up", *argv])


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("KVLANE_CONFIG", raising=False)
    path = tmp_path / "kvlane.toml"
    path.write_text('[worker]\nengine = "vllm"\n\n[ingress]\nport = 9123\nhost = "0.0.0.0"\n')
    return path


def test_flags_not_given_leave_the_file_alone(config_file: Path) -> None:
    config = up_config(parse("--config", str(config_file)))
    assert (config.worker.engine, config.ingress.port, config.ingress.host) == ("vllm", 9123, "0.0.0.0")


def test_flags_given_override_the_file(config_file: Path) -> None:
    config = up_config(parse("--config", str(config_file), "--engine", "sim", "--port", "8100", "--host", "127.0.0.2"))
    assert (config.worker.engine, config.ingress.port, config.ingress.host) == ("sim", 8100, "127.0.0.2")


@pytest.mark.parametrize(("argv", "refused"), [
    (["--mode", "disaggregated", "--workers", "3"], "--workers applies to --mode aggregated only"),
    (["--mode", "disaggregated", "--fleet", "h100:2"], "--fleet applies to --mode aggregated only"),
    (["--prefill-workers", "2"], "--prefill-workers applies to --mode disaggregated only"),
    (["--mode", "aggregated", "--decode-workers", "2"], "--decode-workers applies to --mode disaggregated only"),
    (["--mode", "disaggregated", "--kv-share"], "--kv-share applies to --mode aggregated only"),
])
def test_a_flag_of_the_other_mode_is_refused(argv: list[str], refused: str) -> None:
    assert _up_flags_refused(parse(*argv)) == refused


def test_kv_share_turns_prefix_pulls_on_and_its_absence_leaves_the_file_alone(tmp_path: Path, config_file: Path) -> None:
    assert up_config(parse("--config", str(config_file), "--kv-share")).worker.kv_share
    assert not up_config(parse("--config", str(config_file))).worker.kv_share
    sharing = tmp_path / "sharing.toml"
    sharing.write_text("[worker]\nkv_share = true\n")
    assert up_config(parse("--config", str(sharing))).worker.kv_share


def test_the_chosen_mode_gets_its_defaults() -> None:
    aggregated = parse()
    assert _up_flags_refused(aggregated) is None and aggregated.workers == 2
    disaggregated = parse("--mode", "disaggregated", "--decode-workers", "3")
    assert _up_flags_refused(disaggregated) is None
    assert (disaggregated.prefill_workers, disaggregated.decode_workers) == (1, 3)


def test_every_command_is_in_the_help() -> None:
    text = build_parser().format_help()
    for command in ("up", "status", "bench", "simulate", "calibrate", "schema", "make-tiny-model"):
        assert command in text


def test_contradictory_restart_settings_stop_kvlane_up_before_it_starts_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from kvlane.cli import _up

    monkeypatch.delenv("KVLANE_CONFIG", raising=False)
    path = tmp_path / "kvlane.toml"
    path.write_text("[supervision]\nfirst_delay_s = 5.0\nmax_delay_s = 1.0\n")
    console = Console(record=True, width=200)
    assert _up(parse("--config", str(path), "--log-dir", str(tmp_path / "logs")), console) == 2
    assert "supervision: max_delay_s (1.0) must be at least first_delay_s (5.0)" in console.export_text()
    assert not (tmp_path / "logs").exists()


def test_cache_manager_replicas_default_to_one_and_must_be_at_least_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse().cache_managers == 1
    assert parse("--cache-managers", "3").cache_managers == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parse("--cache-managers", bad)
    assert "--cache-managers" in capsys.readouterr().err


def test_start_fleet_refuses_no_cache_manager_before_starting_anything(tmp_path: Path) -> None:
    from launch.fleet import start_fleet
    from launch.launcher import Launcher
    from shared.config import KvlaneConfig

    launcher = Launcher(tmp_path)
    with pytest.raises(ValueError, match="cache_managers must be at least 1"):
        start_fleet(launcher, KvlaneConfig(), 1, cache_managers=0)
    assert launcher.processes == []


def test_nodes_per_worker_sets_worker_nodes_and_must_be_at_least_one(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert up_config(parse("--config", str(config_file))).worker.nodes == 1
    assert up_config(parse("--config", str(config_file), "--nodes-per-worker", "64")).worker.nodes == 64
    with pytest.raises(SystemExit):
        parse("--nodes-per-worker", "0")
    assert "--nodes-per-worker" in capsys.readouterr().err
