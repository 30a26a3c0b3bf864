"""HTTP spoken by hand over a socket: what a client library would never send."""

from __future__ import annotations

import asyncio
import time


async def exchange(port: int, *parts: bytes, pause: float = 0.0, source: str | None = None,
                   timeout: float = 15.0) -> tuple[float, bytes]:
    """Send `parts` (`pause` apart) on a new connection to 127.0.0.1:`port`, from `source` if given, then read until
    the server closes it: (seconds it took, everything read)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0) if source else None)
    started = time.monotonic()
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause)
        answer = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    return time.monotonic() - started, answer
