"""`kvlane adapters add | list | remove`: LoRA adapters on the bus (shared/adapter_store.py).

`add` checks the adapter's files (its config, its tensors' shapes and bytes)
and publishes them to the JetStream object store of the configuration's NATS
(`nats.url`, or `--nats-url`); every ingress lists it under `/v1/models` at
once, and a worker of its base model loads it on the first request for it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from rich.console import Console
from rich.table import Table

from shared.adapter_store import AdapterError, AdapterStore, adapter_store_at
from shared.config import load_config

T = TypeVar("T")


def add_arguments(adapters: argparse.ArgumentParser) -> None:
    actions = adapters.add_subparsers(dest="adapters_action", required=True)

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", help="TOML configuration file (for the NATS URL)")
        parser.add_argument("--nats-url", help="NATS URL (default: nats.url from the configuration)")

    add = actions.add_parser("add", help="publish a PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors)")
    add.add_argument("name", help="what clients name as `model`")
    add.add_argument("path", help="the adapter's directory")
    add.add_argument("--base", required=True, help="the served model it adapts")
    common(add)
    listing = actions.add_parser("list", help="the published adapters")
    listing.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    common(listing)
    remove = actions.add_parser("remove", help="unpublish an adapter: requests for it get 404, workers drop it when idle")
    remove.add_argument("name")
    common(remove)


def run(args: argparse.Namespace, console: Console) -> int:
    try:
        match args.adapters_action:
            case "add":
                info = _with_store(args, lambda store: store.publish(args.name, args.base, args.path))
                console.print(f"published adapter {info.name} of {info.base}: rank {info.rank}, "
                              f"{_size(info.tensor_bytes)} of tensors, revision {info.revision}")
            case "list":
                _print(_with_store(args, AdapterStore.list), args.json, console)
            case "remove":
                if not _with_store(args, lambda store: store.remove(args.name)):
                    console.print(f"[red]no adapter named {args.name}[/]")
                    return 1
                console.print(f"removed adapter {args.name}")
    except AdapterError as exc:
        console.print(f"[red]{exc}[/]")
        return 1
    return 0


def _with_store(args: argparse.Namespace, action: Callable[[AdapterStore], Awaitable[T]]) -> T:
    settings = load_config(args.config).nats
    if args.nats_url:
        settings = msgspec.structs.replace(settings, url=args.nats_url)

    async def main() -> T:
        async with adapter_store_at(settings) as store:
            return await action(store)

    return asyncio.run(main())


def _print(adapters, as_json: bool, console: Console) -> None:
    if as_json:
        for info in adapters:
            print(json.dumps({"name": info.name, "base": info.base, "revision": info.revision, "rank": info.rank,
                              "tensor_bytes": info.tensor_bytes, "created": info.created}))
        return
    table = Table("adapter", "base", "rank", "tensors", "revision", "published")
    for info in adapters:
        when = datetime.datetime.fromtimestamp(info.created).isoformat(timespec="seconds") if info.created else "-"
        table.add_row(info.name, info.base, str(info.rank), _size(info.tensor_bytes), info.revision[:12], when)
    console.print(table)


def _size(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"
