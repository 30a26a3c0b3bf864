"""A live bench's LoRA adapters: tiny ones made here once per bench, then published to each run's fleet.

The sim engine runs an adapter by its name and never reads its weights, but
a request for one takes the path a real adapter's takes: published into the
bus's object store as `kvlane adapters add` publishes it, resolved by the
ingress from the bus's listing, fetched and checked by the worker. Adapters
of the tiny test model's shape (`launch/tiny_model.py`) are a few tens of
kilobytes, made in milliseconds, and every run of a bench reuses them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from launch.tiny_adapter import make_tiny_adapter
from launch.tiny_model import MODEL_SHAPE
from shared.adapter_store import CONFIG_FILE, adapter_store_at
from shared.config import NatsSettings


def ensure_tiny_adapters(directory: Path, names: Sequence[str]) -> dict[str, Path]:
    """Adapter `names[k]` (seed k, for the tiny model's shape) under `directory`, made unless it is there already."""
    base = directory / "base"
    if not (base / "config.json").is_file():
        base.mkdir(parents=True, exist_ok=True)
        (base / "config.json").write_text(json.dumps(MODEL_SHAPE))
    adapters = {}
    for seed, name in enumerate(names):
        path = directory / name
        # make_tiny_adapter renames a complete directory into place: one with its config holds the rest too.
        adapters[name] = path.resolve() if (path / CONFIG_FILE).is_file() else make_tiny_adapter(path, base, seed=seed)
    return adapters


async def publish_adapters(settings: NatsSettings, base_model: str, adapters: Mapping[str, Path]) -> None:
    """Publish each adapter as an adapter of `base_model` to the bus at `settings` (`AdapterError` if one fails)."""
    async with adapter_store_at(settings) as store:
        for name, directory in adapters.items():
            await store.publish(name, base_model, directory)
