"""The LoRA adapters an ingress can serve: the bus's adapter listing, read again at most once a second.

A request names an adapter as its `model`; the ingress runs it on the
adapter's base model's workers, which load the adapter themselves. A listing
a second old is fresh enough: a newly published adapter is asked for after
its `kvlane adapters add` returned, and a removed one that is still asked
for fails at the worker's fetch with a clear error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from shared.adapter_store import AdapterError, AdapterInfo, AdapterStore, NoObjectStore

log = structlog.get_logger("kvlane.ingress.adapters")


class AdapterCatalog:
    def __init__(self, store: AdapterStore | None, max_age_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        # None: no bus with an object store (tests of the HTTP surface alone): no adapter exists.
        self._store = store
        self._max_age_s = max_age_s
        self._clock = clock
        self._adapters: dict[str, AdapterInfo] = {}
        self._read_at = -float("inf")
        self._reading: asyncio.Future[None] | None = None

    async def get(self, name: str) -> AdapterInfo | None:
        await self._fresh()
        return self._adapters.get(name)

    async def all(self) -> list[AdapterInfo]:
        await self._fresh()
        return list(self._adapters.values())

    async def _fresh(self) -> None:
        if self._store is None or self._clock() - self._read_at < self._max_age_s:
            return
        # One listing at a time, shared by every request that finds the last one too old.
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read(self._store))
        await asyncio.shield(self._reading)

    async def _read(self, store: AdapterStore) -> None:
        try:
            self._adapters = {info.name: info for info in await store.list()}
        except NoObjectStore:
            self._adapters = {}  # a bus without JetStream: no adapter can exist, nothing to warn about
        except AdapterError as exc:
            # Keep the last listing: a bus hiccup should not make every adapter a 404.
            log.warning("adapter_listing_failed", error=str(exc))
        finally:
            # A failed listing too: requests meanwhile do not each wait for another one.
            self._read_at = self._clock()
