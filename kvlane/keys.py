"""`kvlane keys create | list | revoke`: API keys and their tenant policy (shared/api_keys.py).

Keys go to the Redis of the configuration (`redis.url`, or `--redis-url`),
where every ingress finds them, or with `--file` to a keys file
(`ingress.auth.keys_file`). `create` prints the key once, alone on standard
output (`KEY=$(kvlane keys create --tenant acme)`), and notes on standard
error; nothing else ever shows it: only its hash is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import msgspec
from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table

from shared.api_keys import KEY_PREFIX, PRIORITY_MAX, ApiKeyStore, KeyRecord, load_keys_file, make_record, write_keys_file
from shared.config import load_config

T = TypeVar("T")


def add_arguments(keys: argparse.ArgumentParser) -> None:
    actions = keys.add_subparsers(dest="keys_action", required=True)

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", help="TOML configuration file (for the Redis URL)")
        parser.add_argument("--redis-url", help="Redis URL (default: redis.url from the configuration)")
        parser.add_argument("--file", help="a keys file (TOML, or JSON if it ends in .json) instead of Redis")

    create = actions.add_parser("create", help="create a key for a tenant and print it (once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--rpm", type=_non_negative, default=0, help="requests per minute (0: no limit)")
    create.add_argument("--tpm", type=_non_negative, default=0, help="tokens per minute, prompt + max_tokens (0: no limit)")
    create.add_argument("--max-concurrency", type=_non_negative, default=0, help="requests at once (0: no limit)")
    create.add_argument("--models", default="", help="comma-separated models the key may use (default: all)")
    create.add_argument("--priority-max", type=int, choices=range(PRIORITY_MAX + 1), default=PRIORITY_MAX,
                        metavar=f"0..{PRIORITY_MAX}", help="higher request priorities are lowered to this")
    create.add_argument("--weight", type=float, default=1.0,
                        help="the tenant's weight in fair sharing under overload (2: twice the tokens of weight 1)")
    common(create)
    listing = actions.add_parser("list", help="the keys (ids, tenants, limits; never the keys themselves)")
    listing.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    common(listing)
    revoke = actions.add_parser("revoke", help="delete a key: ingresses refuse it within ingress.auth.cache_ttl_s")
    revoke.add_argument("id", help=f"the key's id (or {KEY_PREFIX}<id>)")
    common(revoke)


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def run(args: argparse.Namespace, console: Console) -> int:
    notes = Console(stderr=True)
    try:
        match args.keys_action:
            case "create":
                return _create(args, notes)
            case "list":
                return _list(args, console)
            case _:
                return _revoke(args, notes)
    except ValueError as exc:  # a bad keys file or configuration
        notes.print(f"[red]{exc}[/]")
        return 2
    except (OSError, RedisError) as exc:
        notes.print(f"[red]cannot reach Redis:[/] {exc}")
        return 1


def _with_store(args: argparse.Namespace, action: Callable[[ApiKeyStore], Awaitable[T]]) -> T:
    from shared.state import connect_redis

    settings = load_config(args.config).redis
    if args.redis_url:
        settings = msgspec.structs.replace(settings, url=args.redis_url)

    async def main() -> T:
        client = connect_redis(settings)
        try:
            return await action(ApiKeyStore(client))
        finally:
            await client.aclose()

    return asyncio.run(main())


def _file_records(path: str) -> list[KeyRecord]:
    return list(load_keys_file(path).values()) if Path(path).exists() else []


def _create(args: argparse.Namespace, notes: Console) -> int:
    models = [model.strip() for model in args.models.split(",") if model.strip()]
    try:
        record, key = make_record(args.tenant, rpm=args.rpm, tpm=args.tpm, max_concurrency=args.max_concurrency, models=models,
                                  priority_max=args.priority_max, weight=args.weight)
    except msgspec.ValidationError as exc:
        notes.print(f"[red]{exc}[/]")
        return 2
    if args.file:
        write_keys_file(args.file, [*_file_records(args.file), record])
        where = args.file
    else:
        if not _with_store(args, lambda store: store.add(record)):
            notes.print("[red]a key with this id exists already; run the command again[/]")
            return 1
        where = "Redis"
    notes.print(f"created key [bold]{record.prefix}[/] for tenant [bold]{record.tenant}[/] ({_limits(record)}) in {where}.")
    notes.print("This is the only time the key is shown: keep it now.")
    print(key, flush=True)
    return 0


def _list(args: argparse.Namespace, console: Console) -> int:
    records = _file_records(args.file) if args.file else _with_store(args, lambda store: store.list())
    if args.json:
        for record in records:
            shown = {name: value for name, value in msgspec.structs.asdict(record).items() if name != "hash"}
            print(json.dumps({**shown, "prefix": record.prefix}))
        return 0
    table = Table("id", "prefix", "tenant", "weight", "rpm", "tpm", "concurrency", "models", "priority max", "created")
    for record in records:
        table.add_row(record.id, record.prefix, record.tenant, f"{record.weight:g}", _limit(record.rpm), _limit(record.tpm),
                      _limit(record.max_concurrency), ",".join(record.models) or "all", str(record.priority_max),
                      _when(record.created_at))
    console.print(table)
    return 0


def _revoke(args: argparse.Namespace, notes: Console) -> int:
    key_id = args.id.removeprefix(KEY_PREFIX)
    if args.file:
        records = _file_records(args.file)
        kept = [record for record in records if record.id != key_id]
        found = len(kept) < len(records)
        if found:
            write_keys_file(args.file, kept)
    else:
        found = _with_store(args, lambda store: store.revoke(key_id))
    if not found:
        notes.print(f"[red]no key {key_id}[/]")
        return 1
    notes.print(f"revoked {KEY_PREFIX}{key_id}: ingresses refuse it within ingress.auth.cache_ttl_s")
    return 0


def _limit(value: int) -> str:
    return str(value) if value else "-"


def _limits(record: KeyRecord) -> str:
    parts = [f"{name} {value}" for name, value in (("rpm", record.rpm), ("tpm", record.tpm),
                                                  ("concurrency", record.max_concurrency)) if value]
    if record.models:
        parts.append("models " + ",".join(record.models))
    if record.priority_max < PRIORITY_MAX:
        parts.append(f"priority at most {record.priority_max}")
    if record.weight != 1.0:
        parts.append(f"weight {record.weight:g}")
    return ", ".join(parts) or "no limits"


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ") if timestamp else "-"
