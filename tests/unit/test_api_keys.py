"""API keys, pure parts (shared/api_keys.py): the format, hashing, header parsing, policy checks and the keys file."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.api_keys import (
    KeyRecord,
    bearer_token,
    hash_key,
    key_id_of,
    load_keys_file,
    make_record,
    new_key,
    record_key,
    write_keys_file,
)
from services.ingress.key_limits import limit_keys


def test_a_new_key_carries_its_id_and_256_random_bits() -> None:
    key_id, key = new_key()
    assert key.startswith(f"kvl_{key_id}_") and len(key_id) == 12
    assert key_id_of(key) == key_id
    secret = key.removeprefix(f"kvl_{key_id}_")
    assert len(secret) == 43  # 32 bytes, base64url
    assert len({new_key()[1] for _ in range(200)}) == 200


@pytest.mark.parametrize("bad", [
    "", "kvl_", "sk-abc", "kvl_ABCDEF012345_" + "a" * 43, "kvl_0123456789ab_" + "a" * 42, "kvl_0123456789ab_" + "a" * 44,
    "kvl_0123456789ab-" + "a" * 43, "kvl_0123456789ab_" + "a" * 42 + "!", " kvl_0123456789ab_" + "a" * 43,
])
def test_malformed_keys_have_no_id(bad: str) -> None:
    assert key_id_of(bad) is None


def test_only_the_hash_is_stored_and_it_matches_only_its_key() -> None:
    record, key = make_record("acme")
    assert record.hash == hash_key(key) and record.hash.startswith("sha256:") and len(record.hash) == 7 + 64
    assert key not in msgspec.json.encode(record).decode()
    secret = key[17:]
    assert secret not in msgspec.json.encode(record).decode()
    assert record.matches(key)
    other_record, other = make_record("acme")
    assert not record.matches(other) and not other_record.matches(key)
    # The same id with another secret is not the key.
    assert not record.matches(f"kvl_{record.id}_{'A' * 43}")


@given(st.text(max_size=80))
def test_hashing_is_deterministic_and_never_contains_the_key(text: str) -> None:
    assert hash_key(text) == hash_key(text)
    if len(text) > 8:
        assert text not in hash_key(text)


@pytest.mark.parametrize(("headers", "token"), [
    ({"Authorization": "Bearer kvl_x"}, "kvl_x"),
    ({"authorization": "bearer   kvl_x  "}, "kvl_x"),  # a NATS message's headers are a plain dict: any case
    ({"AUTHORIZATION": "BEARER kvl_x"}, "kvl_x"),
    ({"Authorization": "Basic dXNlcjpwdw=="}, None),
    ({"Authorization": "Bearer"}, None),
    ({"Authorization": "Bearer "}, None),
    ({"Authorization": ""}, None),
    ({"X-Other": "Bearer kvl_x"}, None),
    ({}, None),
    (None, None),
])
def test_bearer_token(headers: dict | None, token: str | None) -> None:
    assert bearer_token(headers) == token


def test_aiohttp_headers_are_case_insensitive() -> None:
    from multidict import CIMultiDict

    assert bearer_token(CIMultiDict({"authorization": "Bearer k"})) == "k"


def test_policy_checks() -> None:
    open_record, _ = make_record("t")
    assert open_record.allows_model("anything") and open_record.clamp_priority(9) == 9 and not open_record.limited
    record, _ = make_record("t", models=["a", "b"], priority_max=3, rpm=5)
    assert record.allows_model("a") and record.allows_model("b") and not record.allows_model("c")
    assert [record.clamp_priority(p) for p in range(10)] == [0, 1, 2, 3, 3, 3, 3, 3, 3, 3]
    assert record.limited and record.prefix == f"kvl_{record.id}"


@pytest.mark.parametrize("fields", [{"tenant": ""}, {"rpm": -1}, {"priority_max": 10}, {"max_concurrency": -2}])
def test_bad_policies_are_refused(fields: dict) -> None:
    tenant = fields.pop("tenant", "t")
    with pytest.raises(msgspec.ValidationError):
        make_record(tenant, **fields)


def test_every_redis_key_of_a_key_id_shares_one_hash_tag() -> None:
    # Redis Cluster puts keys with the same {tag} in one slot: the Lua script may touch them all.
    keys = [record_key("0123456789ab"), *limit_keys("0123456789ab")]
    assert all("{key:0123456789ab}" in key and key.startswith("kvlane:v1:") for key in keys)
    assert len(set(keys)) == 5


@pytest.mark.parametrize("name", ["keys.toml", "keys.json"])
def test_keys_files_round_trip(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    first, key = make_record("acme", rpm=10, tpm=1000, max_concurrency=2, models=["m", "n\u00e9"], priority_max=4)
    second, _ = make_record("other")
    write_keys_file(path, [first, second])
    loaded = load_keys_file(path)
    assert loaded == {first.id: first, second.id: second}
    assert key not in path.read_text()
    assert loaded[first.id].matches(key)


def test_a_hand_written_toml_file_loads(tmp_path: Path) -> None:
    record, key = make_record("static")
    path = tmp_path / "keys.toml"
    path.write_text(f'# static keys\n[[keys]]\nid = "{record.id}"\nhash = "{record.hash}"\ntenant = "static"\nrpm = 5\n')
    (loaded,) = load_keys_file(path).values()
    assert loaded.matches(key) and loaded.rpm == 5 and loaded.models == [] and loaded.priority_max == 9


@pytest.mark.parametrize(("name", "text", "says"), [
    ("k.toml", "[[keys]]\nid = 'x'\n", "keys file"),
    ("k.toml", "not toml [", "keys file"),
    ("k.json", json.dumps({"keys": [{"id": "0123456789ab", "hash": "sha256:00", "tenant": "t"}]}), "hash"),
    ("k.json", json.dumps({"keys": [], "extra": 1}), "extra"),
])
def test_a_bad_keys_file_is_named(tmp_path: Path, name: str, text: str, says: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=says):
        load_keys_file(path)


def test_a_missing_keys_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read keys file"):
        load_keys_file(tmp_path / "absent.toml")


def test_records_forbid_unknown_fields() -> None:
    record, _ = make_record("t")
    data = {**msgspec.structs.asdict(record), "key": "kvl_..."}
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(data, KeyRecord)
