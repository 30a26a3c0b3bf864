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
])
def test_a_flag_of_the_other_mode_is_refused(argv: list[str], refused: str) -> None:
    assert _up_flags_refused(parse(*argv)) == refused


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
