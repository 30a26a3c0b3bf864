"""API keys and their tenant policy: the key format, hashing, the pure policy checks, and where keys are kept.

A key reads `kvl_<id>_<secret>`: `id` is 12 hex digits (public: `kvlane keys
list` shows `kvl_<id>`, logs and spans may name it), `secret` 32 random bytes
(base64url, 43 characters). Only `sha256:<hex of SHA-256(key)>` is stored.

Why plain SHA-256 and not a slow password hash or an HMAC with a pepper: the
secret has 256 bits of entropy from `secrets`, so nobody can guess a key
from its hash by trying candidates (what bcrypt/argon2 and peppers defend
against is low-entropy passwords), and one fast hash keeps the check cheap
on the ingress's hot path. A pepper would also be one more secret that every
ingress replica and the CLI must share. The id in the key finds its record
without a hash index; the hash, compared in constant time, proves the rest.

Keys live in Redis (one JSON record per key, shared by every ingress
replica; `ApiKeyStore`) and, for static setups, in a file (TOML `[[keys]]`
tables or JSON `{"keys": [...]}` of the same records; `load_keys_file`).
All of a key's Redis keys share the hash tag `{key:<id>}`, so its record and
its rate-limit state sit in one Redis Cluster slot.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
import tomllib
from pathlib import Path
from typing import Annotated

import msgspec
import redis.asyncio as redis
from msgspec import Meta, Struct

from contracts import subjects

KEY_PREFIX = "kvl_"
_KEY = re.compile(r"^kvl_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
_ID = re.compile(r"^[0-9a-f]{12}$")
# `priority` in a request body is 0..9 (contracts/openai_api.py): 9 leaves it unclamped.
PRIORITY_MAX = 9
# The set of every key id in Redis (so `kvlane keys list` needs no SCAN).
INDEX_KEY = f"{subjects.REDIS_PREFIX}:api_keys"

NonNegativeInt = Annotated[int, Meta(ge=0)]


class KeyRecord(Struct, forbid_unknown_fields=True, kw_only=True):
    """One key's hash and its tenant policy (limits of 0 mean unlimited; no models: every model)."""

    id: Annotated[str, Meta(pattern=r"^[0-9a-f]{12}$")]
    hash: Annotated[str, Meta(pattern=r"^sha256:[0-9a-f]{64}$")]
    tenant: Annotated[str, Meta(min_length=1, max_length=128)]
    rpm: NonNegativeInt = 0
    tpm: NonNegativeInt = 0
    max_concurrency: NonNegativeInt = 0
    models: list[str] = []
    priority_max: Annotated[int, Meta(ge=0, le=PRIORITY_MAX)] = PRIORITY_MAX
    created_at: float = 0.0
    # The tenant's weight in the balancers' fair sharing: weight 2 is served twice the tokens of weight 1 while both
    # keep requests waiting.
    weight: Annotated[float, Meta(gt=0.0, le=1000.0)] = 1.0

    @property
    def prefix(self) -> str:
        """What identifies the key without revealing it (`kvl_<id>`)."""
        return f"{KEY_PREFIX}{self.id}"

    @property
    def limited(self) -> bool:
        """Whether any per-key limit applies (without one, admission needs no Redis round trip)."""
        return bool(self.rpm or self.tpm or self.max_concurrency)

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models

    def clamp_priority(self, priority: int) -> int:
        """A request may not ask for more than its key's maximum priority: higher asks are lowered to it."""
        return min(priority, self.priority_max)

    def matches(self, key: str) -> bool:
        """Whether `key` is this record's key (constant-time comparison of the hashes)."""
        return hmac.compare_digest(hash_key(key), self.hash)


def new_key() -> tuple[str, str]:
    """A fresh (id, key)."""
    key_id = secrets.token_hex(6)
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def key_id_of(key: str) -> str | None:
    """The id inside a well-formed key, else None (nothing is looked up for a malformed one)."""
    match = _KEY.match(key)
    return match.group(1) if match else None


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def bearer_token(headers: object) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (names compared case-insensitively), else None.

    `headers`: any mapping (aiohttp's case-insensitive one, or the plain dict of a NATS message).
    """
    if headers is None:
        return None
    value = headers.get("Authorization")  # type: ignore[attr-defined]
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == "authorization"), None)  # type: ignore[attr-defined]
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def make_record(
    tenant: str, *, rpm: int = 0, tpm: int = 0, max_concurrency: int = 0, models: list[str] | None = None,
    priority_max: int = PRIORITY_MAX, created_at: float | None = None, weight: float = 1.0,
) -> tuple[KeyRecord, str]:
    """A new key and its record (validated as a stored record would be); the key is returned once, here only."""
    key_id, key = new_key()
    record = msgspec.convert(
        {"id": key_id, "hash": hash_key(key), "tenant": tenant, "rpm": rpm, "tpm": tpm, "max_concurrency": max_concurrency,
         "models": list(models or []), "priority_max": priority_max, "weight": weight,
         "created_at": time.time() if created_at is None else created_at},
        KeyRecord,
    )
    return record, key


# --- Redis ------------------------------------------------------------------------------


def record_key(key_id: str) -> str:
    return f"{subjects.REDIS_PREFIX}:{{key:{key_id}}}"


class ApiKeyStore:
    """The keys in Redis: one JSON record per key under `kvlane:v1:{key:<id>}`, their ids in one set."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._decoder = msgspec.json.Decoder(KeyRecord)

    async def add(self, record: KeyRecord) -> bool:
        """Store a new record; False if its id is taken already."""
        if not await self._redis.set(record_key(record.id), msgspec.json.encode(record), nx=True):
            return False
        await self._redis.sadd(INDEX_KEY, record.id)
        return True

    async def get(self, key_id: str) -> KeyRecord | None:
        raw = await self._redis.get(record_key(key_id))
        return None if raw is None else self._decoder.decode(raw)

    async def list(self) -> list[KeyRecord]:
        ids = sorted(member.decode() for member in await self._redis.smembers(INDEX_KEY))
        records = []
        for key_id in ids:
            record = await self.get(key_id)
            if record is not None:
                records.append(record)
        return records

    async def revoke(self, key_id: str) -> bool:
        """Delete a key; False if there was none. Ingresses stop accepting it within their cache's lifetime."""
        deleted = await self._redis.delete(record_key(key_id))
        await self._redis.srem(INDEX_KEY, key_id)
        return bool(deleted)


# --- the keys file ------------------------------------------------------------------------


class KeysFile(Struct, forbid_unknown_fields=True):
    keys: list[KeyRecord] = []


def load_keys_file(path: str | Path) -> dict[str, KeyRecord]:
    """The records of a keys file (TOML, or JSON when the name ends in .json), by id; raises ValueError naming the problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read keys file {path}: {exc.strerror}") from exc
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        keys = msgspec.convert(data, KeysFile).keys
    except (ValueError, msgspec.ValidationError) as exc:
        raise ValueError(f"keys file {path} is invalid: {exc}") from exc
    return {record.id: record for record in keys}


def write_keys_file(path: str | Path, records: list[KeyRecord]) -> None:
    """Write (replace) a keys file: JSON when the name ends in .json, else TOML `[[keys]]` tables."""
    path = Path(path)
    if path.suffix == ".json":
        text = json.dumps({"keys": msgspec.to_builtins(records)}, indent=2) + "\n"
    else:
        text = "".join(_toml_table(record) for record in records)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # readers never see half a file


def _toml_table(record: KeyRecord) -> str:
    lines = ["[[keys]]"]
    for name, value in msgspec.structs.asdict(record).items():
        lines.append(f"{name} = {json.dumps(value)}")  # JSON strings, numbers and lists of strings are valid TOML
    return "\n".join(lines) + "\n\n"


def valid_id(key_id: str) -> bool:
    return bool(_ID.match(key_id))
