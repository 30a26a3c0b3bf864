"""The ingress's adapter listing (services/ingress/adapters.py): read again at most once per `max_age_s`, one
listing shared by concurrent requests, the last listing kept when the bus fails, none without JetStream."""

from __future__ import annotations

import asyncio

from services.ingress.adapters import AdapterCatalog
from shared.adapter_store import AdapterError, AdapterInfo, NoObjectStore

ADAPTER = AdapterInfo(name="a", base="m", revision="r", rank=8, tensor_bytes=10)


class ListingStore:
    """What the catalog asks of `AdapterStore`: its listing, or the error the bus gave."""

    def __init__(self) -> None:
        self.listings = 0
        self.answer: list[AdapterInfo] | Exception = [ADAPTER]

    async def list(self) -> list[AdapterInfo]:
        self.listings += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def test_a_listing_serves_until_it_is_max_age_old() -> None:
    now = [0.0]
    store = ListingStore()
    catalog = AdapterCatalog(store, max_age_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert await asyncio.gather(catalog.get("a"), catalog.get("a"), catalog.get("b")) == [ADAPTER, ADAPTER, None]
    assert store.listings == 1
    store.answer = []
    now[0] = 0.5
    assert await catalog.get("a") == ADAPTER and store.listings == 1
    now[0] = 1.0
    assert await catalog.get("a") is None and store.listings == 2


async def test_a_failed_listing_keeps_the_last_one_and_waits_its_turn() -> None:
    now = [0.0]
    store = ListingStore()
    catalog = AdapterCatalog(store, max_age_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]
    await catalog.all()
    store.answer, now[0] = AdapterError("the bus is down"), 2.0
    assert await catalog.all() == [ADAPTER]
    assert await catalog.all() == [ADAPTER] and store.listings == 2  # not asked again within max_age_s


async def test_no_jetstream_means_no_adapters() -> None:
    store = ListingStore()
    store.answer = NoObjectStore("JetStream is not enabled")
    assert await AdapterCatalog(store).all() == []  # type: ignore[arg-type]
    assert await AdapterCatalog(None).get("a") is None
