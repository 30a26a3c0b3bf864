"""`kvlane keys` with a keys file (no Redis): create prints the key once and stores only its hash; list; revoke."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from kvlane.cli import build_parser
from shared.api_keys import load_keys_file


def test_keys_file_created_by_the_cli(tmp_path: Path, capsys) -> None:
    path = tmp_path / "keys.toml"
    parser = build_parser()

    def cli(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        args = parser.parse_args(["keys", *argv])
        code = args.handler(args, Console(width=200))
        return code, capsys.readouterr().out

    code, key = cli("create", "--tenant", "t", "--rpm", "7", "--models", "a, b", "--file", str(path))
    key = key.strip()
    assert code == 0 and key.startswith("kvl_") and key not in path.read_text()
    key_id = key.split("_")[1]
    (record,) = load_keys_file(path).values()
    assert record.matches(key) and record.tenant == "t"
    # A second key is added beside the first.
    assert cli("create", "--tenant", "u", "--file", str(path))[0] == 0 and len(load_keys_file(path)) == 2
    code, out = cli("list", "--json", "--file", str(path))
    entries = {entry["id"]: entry for entry in map(json.loads, out.splitlines())}
    assert (entries[key_id]["rpm"], entries[key_id]["models"], entries[key_id]["tenant"]) == (7, ["a", "b"], "t")
    assert all("hash" not in entry for entry in entries.values()) and key[17:] not in out
    table = cli("list", "--file", str(path))[1]
    assert key_id in table and "a,b" in table and key[17:] not in table
    assert cli("revoke", f"kvl_{key_id}", "--file", str(path))[0] == 0
    assert key_id not in cli("list", "--json", "--file", str(path))[1]
    assert cli("revoke", key_id, "--file", str(path))[0] == 1  # gone already


def test_a_bad_limit_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--rpm", "-1"], ["--priority-max", "10"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["keys", "create", "--tenant", "t", *argv])


def test_keys_is_in_the_help() -> None:
    assert "keys" in build_parser().format_help()
